"""Clocks. Leases read an injectable monotonic clock (tests use :class:`ManualClock`); events carry a hybrid
logical clock so that P's and D's logs merge in causal order."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on a monotonic scale (only differences matter)."""
        ...


class MonotonicClock:
    __slots__ = ()

    def now(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to: leases expire exactly when a test says so."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
        return self._now

    def set(self, value: float) -> None:
        if value < self._now:
            raise ValueError("a clock does not go backwards")
        self._now = float(value)


LOGICAL_BITS = 16
_time_ns = time.time_ns
LOGICAL_MASK = (1 << LOGICAL_BITS) - 1


def hlc_pack(wall_ms: int, logical: int) -> int:
    return (wall_ms << LOGICAL_BITS) | logical


def hlc_wall_seconds(stamp: int) -> float:
    """The wall-clock part of an HLC stamp, in seconds since the epoch."""
    return (stamp >> LOGICAL_BITS) / 1e3


class HybridLogicalClock:
    """Hybrid logical clock (Kulkarni et al.): a 63-bit stamp = wall ms << 16 | logical counter
    (a burst of more than 65,536 events in one ms borrows from the next ms, which keeps the order).

    ``tick()`` stamps a local event; ``observe(remote)`` folds in a stamp received from a peer, so anything this side
    does after seeing a peer's message sorts after that message in a merged log.

    The physical part is the wall clock read once, at construction, and carried forward by the monotonic clock
    (``steady_ms``): NTP steps a host's wall clock by seconds when its offset grew too large, and a step mid-run
    would move every later stamp of this process by that much against its peers' — causal order survives (the max
    with the last stamp), but merged logs order the events no message links (P's lease expiry against D's end of
    its read, ``replay --check``'s read-outlived-lease) by their wall clocks, which then disagree by the step. The
    monotonic clock is slewed by NTP, never stepped; a step reaches the stamps at the next start (a new ledger and
    its clock). With ``wall_ms`` and no ``steady_ms``, the stamps follow ``wall_ms`` as it is (tests).
    """

    def __init__(self, wall_ms: Callable[[], int] | None = None, *, steady_ms: Callable[[], int] | None = None) -> None:
        self._wall_ms = wall_ms  # None: the system clock
        self._steady_ms = steady_ms
        self._last = 0
        self._lock = threading.Lock()
        if wall_ms is None:
            self._anchor_ns = _time_ns() - time.monotonic_ns()  # wall minus monotonic, read once
            # shadow the method on the instance: the inlined system-clock tick, once per recorded event
            self.tick = self._tick_system_clock  # type: ignore[method-assign]
        elif steady_ms is not None:
            self._anchor_ms = wall_ms() - steady_ms()

    def _physical(self) -> int:
        if self._wall_ms is None:
            wall = (self._anchor_ns + time.monotonic_ns()) // 1_000_000
        elif self._steady_ms is not None:
            wall = self._anchor_ms + self._steady_ms()
        else:
            wall = self._wall_ms()
        return wall << LOGICAL_BITS

    def tick(self) -> int:
        physical = self._physical()
        with self._lock:
            last = self._last
            stamp = physical if physical > last else last + 1
            self._last = stamp
        return stamp

    def _tick_system_clock(self) -> int:
        # tick() with the system clock inlined: this runs once per recorded event
        physical = (self._anchor_ns + time.monotonic_ns()) // 1_000_000 << 16  # 16 = LOGICAL_BITS
        with self._lock:
            last = self._last
            stamp = physical if physical > last else last + 1
            self._last = stamp
        return stamp

    def observe(self, remote: int) -> int:
        physical = self._physical()
        with self._lock:
            self._last = max(physical, self._last + 1, remote + 1)
            return self._last

    @property
    def last(self) -> int:
        return self._last


class StepTimer:
    """Where a multi-step wait went: each :meth:`lap` names the step that just ended; :meth:`summary` gives the
    total and every step's share, as text for a log line."""

    __slots__ = ("laps", "last", "start")

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()
        self.laps: list[tuple[str, float]] = []

    def lap(self, step: str) -> None:
        now = time.monotonic()
        self.laps.append((step, now - self.last))
        self.last = now

    def summary(self) -> tuple[float, str]:
        """(seconds from start to the last lap, ``"step 0.123 s, ..."``)."""
        return self.last - self.start, ", ".join(f"{step} {seconds:.3f} s" for step, seconds in self.laps)
