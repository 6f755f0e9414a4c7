"""Simulated time: one global :class:`~kvlifecycle.clock.ManualClock` that only the scheduler advances, and a
per-node view of it with a drift (as TigerBeetle's ``time.zig`` models oscillator skew).

A node's clock stays monotonic (drift > -1), so leases computed on one node's clock behave as on a real host whose
clock runs a little fast or slow; the HLC of each node reads that node's clock, so merged logs stay causal only
through the stamps messages carry, as in production.
"""

from __future__ import annotations

from kvlifecycle.clock import HybridLogicalClock, ManualClock


class NodeClock:
    """A node's monotonic clock: the global simulated time scaled by ``1 + drift`` plus a fixed offset."""

    __slots__ = ("drift", "global_clock", "offset")

    def __init__(self, global_clock: ManualClock, *, drift: float = 0.0, offset: float = 0.0) -> None:
        if drift <= -1.0:
            raise ValueError("a drift of -1 or less would stop or reverse the clock")
        self.global_clock, self.drift, self.offset = global_clock, drift, offset

    def now(self) -> float:
        return self.offset + self.global_clock.now() * (1.0 + self.drift)

    def global_at(self, local: float) -> float:
        """The global time at which this clock reads ``local``."""
        return (local - self.offset) / (1.0 + self.drift)

    def hlc(self, skew_s: float = 0.0) -> HybridLogicalClock:
        """A hybrid logical clock over the simulated wall time (ms) with this node's NTP-sized skew, never the
        system clock. (Monotonic clocks of different hosts share no origin; their wall clocks agree to ms.)"""
        return HybridLogicalClock(wall_ms=lambda: int((self.global_clock.now() + skew_s) * 1000.0))
