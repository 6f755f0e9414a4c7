"""Handoffs that go wrong (and one that does not), written by the real ledgers through the real event log.

Each builder returns the P and D log directories. The clock is manual and the HLC reads it, so every time in the
logs is exact and the same on every run: docs/debugging.md shows the stories and explanations of these logs.
``python tests/debug_scenarios.py OUT`` writes each scenario under ``OUT/<name>/``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.ledger import Grant, SourceLedger, TargetLedger, open_ledger

START_S = 1_800_000_000.0  # 2027-01-15T08:00:00Z


class Pair:
    """A P ledger and a D ledger on one manual clock, with logs in ``root/p0`` and ``root/d0``."""

    def __init__(self, root: Path, *, ttl_s: float = 30.0, p_worker: str = "p0", d_worker: str = "d0") -> None:
        self.root = root
        self.clock = ManualClock(START_S)
        self.hlc = HybridLogicalClock(wall_ms=lambda: int(self.clock.now() * 1000))
        common = {"clock": self.clock, "hlc": self.hlc, "fsync": "never"}
        self.p: SourceLedger = open_ledger("source", 32, str(root / p_worker), worker=p_worker, default_ttl_s=ttl_s,
                                           **common)  # type: ignore[assignment]
        self.d: TargetLedger = open_ledger("target", 32, str(root / d_worker), worker=d_worker,
                                           **common)  # type: ignore[assignment]

    def ms(self, ms: float) -> None:
        self.clock.advance(ms / 1e3)

    def grant(self, request: str, src: list[int], dst: list[int], *, ttl_s: float | None = None) -> Grant:
        """P prefills and grants; D reserves (the pull descriptor travelled)."""
        self.p.allocate(request, src)
        self.ms(2)
        self.p.prefill_done(request)
        g = self.p.grant(request, ttl_s=ttl_s)
        self.ms(1)
        self.d.reserve(request, dst)
        return g

    def pull(self, request: str, g: Grant, *, claim: bool = True, parts: int = 1) -> None:
        if claim:
            assert self.p.heartbeat(g.transfer, g.generation, peer=self.d.worker)
        self.d.start_load(request, g.transfer, generation=g.generation, peer=self.p.worker, parts=parts)

    def complete(self, request: str, g: Grant) -> None:
        self.ms(3)
        self.d.part_done(g.transfer, 0)
        self.ms(1)
        self.p.consumer_done(g.transfer, g.generation)
        for released in self.p.take_released():
            self.p.free(released.request)

    def close(self) -> tuple[Path, Path]:
        self.p.log.close()
        self.d.log.close()
        return self.root / self.p.worker, self.root / self.d.worker


def clean(root: Path) -> tuple[Path, Path]:
    """Two pull handoffs that complete, and D finishes both."""
    pair = Pair(root)
    for i, request in enumerate(("req-1", "req-2")):
        g = pair.grant(request, [4 * i + k for k in range(4)], [31 - 4 * i - k for k in range(4)])
        pair.pull(request, g)
        pair.complete(request, g)
        pair.ms(1)
        pair.d.finish(request)
    return pair.close()


def cancelled(root: Path) -> tuple[Path, Path]:
    """A request cancelled on both sides while D reads it: P defers the release (D had claimed the lease), D keeps
    its blocks LOADING until the load settles, then both let go; the late completion still reaches P."""
    pair = Pair(root)
    g = pair.grant("req-7", [8, 9, 10, 11], [20, 21, 22, 23])
    pair.pull("req-7", g)
    pair.ms(1)
    pair.p.cancel("req-7")  # claimed: the release waits for the reader
    pair.d.cancel("req-7")  # in flight: the blocks stay LOADING until the load settles
    pair.complete("req-7", g)  # the bytes land, D discards them; P's release is "cancelled"
    return pair.close()


def peer_restart(root: Path) -> tuple[Path, Path]:
    """D restarts with a new agent epoch while it reads: P releases the lease bound to it (peer_restarted)."""
    pair = Pair(root)
    g = pair.grant("req-3", [0, 1, 2], [5, 6, 7])
    pair.p.peer_restarted(pair.d.worker, 1)  # the first handshake
    pair.pull("req-3", g)
    pair.ms(4)
    pair.p.peer_restarted(pair.d.worker, 2)  # D came back: its read is gone
    for released in pair.p.take_released():
        pair.p.free(released.request)
    pair.d.fail(g.transfer, "agent restarted")  # what D's new incarnation finds of the old load
    return pair.close()


def lease_expiry(root: Path) -> tuple[Path, Path]:
    """D claims a lease and stalls; P's sweep expires it, P frees and reuses the blocks for another request, then
    D's bytes land: D's load completes from blocks that belong to someone else, and P refuses the late completion."""
    pair = Pair(root)
    g = pair.grant("req-3", [17, 18], [3, 4], ttl_s=0.02)
    pair.pull("req-3", g)
    pair.ms(25)
    pair.p.sweep()
    pair.p.take_released()
    pair.p.free("req-3")
    pair.ms(1)
    pair.p.allocate("req-4", [17, 18])
    pair.ms(4)
    pair.d.part_done(g.transfer, 0)
    pair.ms(1)
    pair.p.consumer_done(g.transfer, g.generation)
    pair.d.finish("req-3")
    pair.p.prefill_done("req-4")
    pair.p.free("req-4")
    return pair.close()


def freed_under_reader(root: Path) -> tuple[Path, Path]:
    """D reads without claiming the lease; a cancel releases it at once and P frees the blocks mid-read."""
    pair = Pair(root)
    g = pair.grant("req-5", [12, 13, 14], [0, 1, 2])
    pair.pull("req-5", g, claim=False)
    pair.ms(1)
    pair.p.cancel("req-5")
    pair.p.free("req-5")
    pair.ms(5)
    pair.d.part_done(g.transfer, 0)
    pair.p.consumer_done(g.transfer, g.generation)  # refused: no live lease
    pair.d.finish("req-5")
    return pair.close()


def load_never_completed(root: Path) -> tuple[Path, Path]:
    """D posts a read whose completion never comes; P keeps renewing."""
    pair = Pair(root)
    g = pair.grant("req-8", [2, 3], [9, 10])
    pair.pull("req-8", g, parts=2)
    pair.ms(2)
    pair.d.part_done(g.transfer, 0)
    pair.ms(10)
    pair.p.heartbeat(g.transfer, g.generation, peer=pair.d.worker)
    return pair.close()


def pinned_past_lease(root: Path) -> tuple[Path, Path]:
    """D finishes loading but its completion never reaches P, and P never sweeps: the blocks stay pinned long
    after the lease's deadline."""
    pair = Pair(root)
    g = pair.grant("req-9", [6, 7, 8], [11, 12, 13], ttl_s=0.01)
    pair.pull("req-9", g)
    pair.ms(3)
    pair.d.part_done(g.transfer, 0)
    pair.d.finish("req-9")
    pair.ms(40)
    pair.p.allocate("req-10", [0])  # P keeps serving, its clock moves on
    pair.p.prefill_done("req-10")
    pair.p.free("req-10")
    return pair.close()


def read_after_release(root: Path) -> tuple[Path, Path]:
    """The lease expires before D gets to it; D starts loading anyway, after P released the lease."""
    pair = Pair(root)
    g = pair.grant("req-6", [20, 21], [14, 15], ttl_s=0.005)
    pair.ms(10)
    pair.p.sweep()
    pair.p.take_released()
    pair.p.free("req-6")
    pair.ms(1)
    pair.d.start_load("req-6", g.transfer, generation=g.generation, peer="p0")
    pair.ms(2)
    pair.d.part_done(g.transfer, 0)
    pair.d.finish("req-6")
    return pair.close()


SCENARIOS: dict[str, Callable[[Path], tuple[Path, Path]]] = {
    "clean": clean,
    "cancelled": cancelled,
    "peer_restart": peer_restart,
    "lease_expiry": lease_expiry,
    "freed_under_reader": freed_under_reader,
    "load_never_completed": load_never_completed,
    "pinned_past_lease": pinned_past_lease,
    "read_after_release": read_after_release,
}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name, build in SCENARIOS.items():
        build(out / name)
        print(out / name)
