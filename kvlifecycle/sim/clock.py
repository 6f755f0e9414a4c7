"""Simulated time: one global :class:`~kvlifecycle.clock.ManualClock` that only the scheduler advances, and a
per-node view of it with a drift (as TigerBeetle's ``time.zig`` models oscillator skew).

A node's clock stays monotonic (drift > -1), so leases computed on one node's clock behave as on a real host whose
clock runs a little fast or slow; the HLC of each node reads that node's wall clock, so merged logs stay causal only
through the stamps messages carry, as in production.

A node's wall clock also jumps (:meth:`NodeClock.jump`): NTP steps a host's clock by seconds, forward or back, when
its offset grew too large (after a suspend, a VM migration, a misconfigured source). Only the HLC's wall source
moves; the monotonic clock that leases, deadlines and read bounds run on does not (``CLOCK_MONOTONIC`` is slewed,
never stepped).
"""

from __future__ import annotations

from kvlifecycle.clock import HybridLogicalClock, ManualClock


class NodeClock:
    """A node's monotonic clock: the global simulated time scaled by ``1 + drift`` plus a fixed offset."""

    __slots__ = ("drift", "global_clock", "offset", "wall_step")

    def __init__(self, global_clock: ManualClock, *, drift: float = 0.0, offset: float = 0.0) -> None:
        if drift <= -1.0:
            raise ValueError("a drift of -1 or less would stop or reverse the clock")
        self.global_clock, self.drift, self.offset = global_clock, drift, offset
        self.wall_step = 0.0  # seconds the wall clock was stepped by, in all (NTP steps), on top of its skew

    def now(self) -> float:
        return self.offset + self.global_clock.now() * (1.0 + self.drift)

    def global_at(self, local: float) -> float:
        """The global time at which this clock reads ``local``."""
        return (local - self.offset) / (1.0 + self.drift)

    def hlc(self, skew_s: float = 0.0) -> HybridLogicalClock:
        """A hybrid logical clock over the simulated wall time (ms) with this node's NTP-sized skew, never the
        system clock. (Monotonic clocks of different hosts share no origin; their wall clocks agree to ms.) As the
        real one, it reads the wall clock once and carries it forward by the steady clock (the global time: NTP
        disciplines a host's clock rate, so its stamps do not drift apart as the oscillators of :meth:`now` do), so
        a wall-clock step reaches the stamps of the node's next start, not of this one."""
        return HybridLogicalClock(wall_ms=lambda: int((self.global_clock.now() + skew_s + self.wall_step) * 1000.0),
                                  steady_ms=lambda: int(self.global_clock.now() * 1000.0))

    def jump(self, seconds: float) -> None:
        """The wall clock steps by ``seconds`` (back if negative), as NTP steps a host's clock; :meth:`now` (the
        monotonic clock) does not move."""
        self.wall_step += seconds
