"""Many handoffs written by a real P and D ledger through the real event log, on a manual clock: the logs the
timeline tests cut, sample and aggregate.

``python tests/timeline_logs.py OUT N`` writes ``N`` handoffs under ``OUT/p0`` and ``OUT/d0``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.ledger import SourceLedger, TargetLedger, open_ledger

START_S = 1_800_000_000.0  # 2027-01-15T08:00:00Z
BLOCKS = 4  # per request
IN_FLIGHT = 4  # handoffs overlapping at once


def handoffs(root: Path, n: int, *, d_prefix: str = "", lazy_free: int = 3) -> tuple[Path, Path]:
    """``n`` pull handoffs, ``IN_FLIGHT`` at a time, each granted, claimed, read (one observed transfer) and completed
    ``IN_FLIGHT`` ms after its prefill; D names request ``r{i}`` ``{d_prefix}r{i}`` (vLLM's D names it anew) and
    finishes it. P frees a released request only once ``lazy_free`` more were released (engines free lazily): the
    last ``lazy_free`` stay RELEASABLE where the log ends. Request ``i`` is allocated ``i + 1`` ms after the start."""
    clock = ManualClock(START_S)
    hlc = HybridLogicalClock(wall_ms=lambda: int(clock.now() * 1000))
    common = {"clock": clock, "hlc": hlc, "fsync": "never"}
    p: SourceLedger = open_ledger("source", BLOCKS * n, str(root / "p0"), worker="p0", default_ttl_s=30.0,
                                  **common)  # type: ignore[assignment]
    d: TargetLedger = open_ledger("target", BLOCKS * n, str(root / "d0"), worker="d0",
                                  **common)  # type: ignore[assignment]
    pending: list[tuple[str, object]] = []  # granted and loading, oldest first
    released: list[str] = []

    def complete(request: str, grant: object) -> None:
        transfer, generation = grant.transfer, grant.generation  # type: ignore[attr-defined]
        d.observe_transfer(transfer, t_post_s=0.0001, t_xfer_s=0.0005, nbytes=BLOCKS << 14, descriptors=BLOCKS,
                           backend="UCX", ok=True)
        d.part_done(transfer, 0)
        p.consumer_done(transfer, generation)
        d.finish(d_prefix + request)
        released.extend(r.request for r in p.take_released())
        while len(released) > lazy_free:
            p.free(released.pop(0))

    for i in range(n):
        request = f"r{i}"
        clock.advance(0.001)
        p.allocate(request, list(range(BLOCKS * i, BLOCKS * (i + 1))))
        p.prefill_done(request)
        grant = p.grant(request, peer="d0")
        d.reserve(d_prefix + request, list(range(BLOCKS * i, BLOCKS * (i + 1))))
        assert p.heartbeat(grant.transfer, grant.generation, peer="d0")
        d.start_load(d_prefix + request, grant.transfer, generation=grant.generation, peer="p0")
        pending.append((request, grant))
        if len(pending) > IN_FLIGHT:
            complete(*pending.pop(0))
    for request, grant in pending:
        clock.advance(0.001)
        complete(request, grant)
    p.log.close()
    d.log.close()
    return root / "p0", root / "d0"


if __name__ == "__main__":
    handoffs(Path(sys.argv[1]), int(sys.argv[2]))
