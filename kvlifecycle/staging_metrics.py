"""What the host staging tier is doing, as numbers an engine exports (vLLM's ``/metrics``, a benchmark's JSON).

Fed by the two ledgers' events (a listener on each), so the numbers are those of the log, live or replayed:

- ``staged_blocks``: GPU blocks handed over to the host pool (released as ``staged``), in all;
- ``pool_occupancy``: host slots held now (copying, staged or being read), and ``pool_slots``;
- ``pinned_block_seconds``: GPU blocks pinned under leases, integrated over the ledger clock (one block pinned for
  one second is one); the cost a slow consumer puts on P's KV cache, which staging exists to cut.
"""

from __future__ import annotations

from kvlifecycle import events as ev
from kvlifecycle.source_ledger import SourceLedger
from kvlifecycle.staging_ledger import StagingLedger


class StagingMetrics:
    """Counters over a source ledger and its host pool; :meth:`attach` subscribes to both."""

    def __init__(self, pool_slots: int) -> None:
        self.pool_slots = pool_slots
        self.staged_blocks = 0
        self.pool_occupancy = 0
        self._pinned_closed = 0.0  # block-seconds of leases that ended
        self._open: dict[str, tuple[int, float]] = {}  # transfer -> (blocks, granted at)
        self._blocks_of: dict[str, int] = {}  # request -> its blocks (source side)
        self._slots_of: dict[str, int] = {}  # transfer -> slots its copy holds
        self._now = 0.0

    @classmethod
    def attach(cls, source: SourceLedger, pool: StagingLedger) -> StagingMetrics:
        metrics = cls(pool.num_blocks)
        source.listeners.append(metrics.on_source)
        pool.listeners.append(metrics.on_pool)
        return metrics

    def pinned_block_seconds(self, now: float | None = None) -> float:
        """Block-seconds pinned so far; leases still live count up to ``now`` (default: the last event's time)."""
        at = self._now if now is None else now
        return self._pinned_closed + sum(blocks * max(0.0, at - since) for blocks, since in self._open.values())

    def on_source(self, e: ev.Event) -> None:
        self._now = max(self._now, e.at)
        if isinstance(e, ev.SrcAllocated | ev.SrcShared):
            self._blocks_of[e.request] = len(e.blocks) // ev.BLOCK_DTYPE.itemsize
        elif isinstance(e, ev.SrcGranted):
            self._open[e.transfer] = (self._blocks_of.get(e.request, 0), e.at)
        elif isinstance(e, ev.SrcLeaseReleased):
            blocks, since = self._open.pop(e.transfer, (0, e.at))
            self._pinned_closed += blocks * max(0.0, e.at - since)
            if e.reason == "staged":
                self.staged_blocks += blocks
        elif isinstance(e, ev.SrcFreed | ev.SrcAborted):
            self._blocks_of.pop(e.request, None)

    def on_pool(self, e: ev.Event) -> None:
        self._now = max(self._now, e.at)
        if isinstance(e, ev.StgStarted):
            self._slots_of[e.transfer] = len(e.blocks) // ev.BLOCK_DTYPE.itemsize
            self.pool_occupancy += self._slots_of[e.transfer]
        elif isinstance(e, ev.StgAborted | ev.StgReleased):
            self.pool_occupancy -= self._slots_of.pop(e.transfer, 0)

    def as_dict(self) -> dict[str, float]:
        return {"staged_blocks": self.staged_blocks, "pool_occupancy": self.pool_occupancy,
                "pool_slots": self.pool_slots, "pinned_block_seconds": self.pinned_block_seconds()}
