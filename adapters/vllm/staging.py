"""P's host staging tier in the vLLM worker: the pool, its ledger and transport, and what vLLM is told about it.

The decisions are the core's (:mod:`kvlifecycle.staging`, :mod:`kvlifecycle.handoff.staging_tier`): the Producer
copies a due, unclaimed lease into the host pool and releases the GPU lease as ``staged`` only once the copy is
whole and no consumer claimed the GPU copy. This module builds the parts on a worker and keeps two facts the
worker needs for vLLM:

- a request whose lease was released as ``staged`` is reported ``finished_sending`` (vLLM frees its blocks), but
  its grant stays published: D still fetches it and is served from the host pool. The grant is dropped when the
  staged copy ends (its pool record released: read, failed, cancelled or expired);
- the numbers for ``/metrics`` (:class:`StagingGauges`): staged blocks, pool occupancy, pinned-block-seconds.

The pool is host memory laid out like the KV cache and registered with a NIXL agent of its own (DRAM); D reads the
slots from that agent. The copy into the pool is that agent's READ of P's KV agent (on vLLM's CPU backend a local
memory copy), or, for a KV cache in VRAM, the gather kernel on a CUDA stream (``CudaStagingCopy``; where it cannot
be built, the NIXL READ, logged).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from kvlifecycle import events as ev
from kvlifecycle.eventlog import EventLog
from kvlifecycle.handoff.staging_tier import StagingTier
from kvlifecycle.source_ledger import SourceLedger
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_metrics import StagingMetrics
from kvlifecycle.staging_policy import StagingPolicy
from kvlifecycle.transport import KVLayout, MemoryKind, Transport, TransportError

__all__ = ["StagingGauges", "WorkerStaging"]

log = logging.getLogger("kvlifecycle.adapters.vllm")


class WorkerStaging:
    """A P worker's host staging tier (``tier`` goes to its Producer) and the grants of the leases it took over."""

    def __init__(self, tier: StagingTier, pool: StagingLedger, transport: Transport, memory: object) -> None:
        self.tier, self.pool, self.transport = tier, pool, transport
        self._memory = memory  # the HostPool whose buffers the transport registered: kept alive as long as it
        self.copy_path = "cuda stream" if tier.copier is not None else "nixl read"
        self._lock = threading.Lock()
        self._handed_over: dict[str, str] = {}  # transfer -> request: GPU lease released as staged, grant published
        self._ended: list[str] = []  # transfers whose staged copy ended (pool listener, the Producer's thread)
        pool.listeners.append(self._on_pool_event)

    @classmethod
    def build(cls, policy: StagingPolicy, source: SourceLedger, kv_layout: KVLayout, agent: str,
              backends: tuple[str, ...], log_dir: str | None, fsync: str) -> WorkerStaging:
        """The pool (``policy.pool_blocks`` slots per KV region), its NIXL agent and its ledger (logged beside the
        source ledger's, sharing its clocks so that the two logs order and replay together)."""
        from kvlifecycle.transports.host_pool import HostPool
        from kvlifecycle.transports.nixl import NixlTransport

        memory = HostPool(kv_layout, policy.pool_blocks)
        transport = NixlTransport(agent, backends=backends)
        transport.register(memory.layout)
        log = EventLog(log_dir, fsync=fsync) if log_dir is not None else None
        pool = StagingLedger(policy.pool_blocks, clock=source.clock, hlc=source.hlc, source_worker=source.worker,
                             log=log)
        tier = StagingTier(HostStaging(source, pool, policy), transport, copier=_cuda_copier(kv_layout, memory))
        return cls(tier, pool, transport, memory)

    def _on_pool_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.StgReleased | ev.StgAborted):
            with self._lock:
                self._ended.append(event.transfer)

    def take_ended(self) -> list[str]:
        """Transfers whose staged copy ended since the last call; take them *before* the source ledger's released
        leases, so that a copy that ended is always matched to its hand-over (which precedes it)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended

    def handed_over(self, transfer: str, request: str) -> None:
        """The GPU lease of ``request`` was released as ``staged``: its grant stays published until the copy ends."""
        self._handed_over[transfer] = request

    def grants_to_forget(self, ended: list[str]) -> list[str]:
        """The requests whose grant can go now: their staged copy, among ``ended``, was handed over (a copy
        aborted before its hand-over left its GPU lease and grant as they were)."""
        return [request for transfer in ended if (request := self._handed_over.pop(transfer, None)) is not None]

    def close(self) -> None:
        """After the Producer closed (it releases the copies' handles): the copier (it waits, bounded, for copies
        still running into the pool), the pool's log and transport."""
        copier: Any = self.tier.copier
        if copier is not None:
            copier.close()
        if self.pool.log is not None:
            self.pool.log.close()
        self.transport.close()


def _cuda_copier(kv_layout: KVLayout, memory: Any) -> Any:
    """The CUDA stream copy for a KV cache in VRAM, else None (the pool's NIXL agent READs the KV cache)."""
    if kv_layout.kind is not MemoryKind.VRAM:
        return None
    try:
        from kvlifecycle.transports.staging_copy_cuda import CudaStagingCopy

        return CudaStagingCopy(kv_layout, memory)
    except (ImportError, TransportError) as exc:
        log.warning("KVLifecycleConnector: the staging copy goes through NIXL (no CUDA stream copy: %s)", exc)
        return None


class StagingGauges:
    """:class:`StagingMetrics` read from the forward thread while its listeners run on the Producer's: both behind
    one lock. :meth:`take` gives what changed since the last call, as vLLM's interval statistics want it."""

    def __init__(self, source: SourceLedger, pool: StagingLedger | None) -> None:
        self._metrics = StagingMetrics(pool.num_blocks if pool is not None else 0)
        self._lock = threading.Lock()
        self._clock = source.clock
        source.listeners.append(self._locked(self._metrics.on_source))
        if pool is not None:
            pool.listeners.append(self._locked(self._metrics.on_pool))
        self._staged_reported = 0
        self._pinned_reported = 0.0
        self._occupancy_reported = -1

    def _locked(self, listener: Callable[[ev.Event], None]) -> Callable[[ev.Event], None]:
        def call(event: ev.Event) -> None:
            with self._lock:
                listener(event)
        return call

    def take(self) -> tuple[int, float, int | None]:
        """(blocks staged, GPU pinned-block-seconds) since the last call, and the pool's occupancy if it changed."""
        with self._lock:
            m = self._metrics
            pinned = m.pinned_block_seconds(self._clock.now())  # live leases count up to now
            staged, occupancy = m.staged_blocks, m.pool_occupancy
        staged_delta, self._staged_reported = staged - self._staged_reported, staged
        pinned_delta, self._pinned_reported = max(0.0, pinned - self._pinned_reported), max(pinned,
                                                                                             self._pinned_reported)
        changed = occupancy != self._occupancy_reported
        self._occupancy_reported = occupancy
        return staged_delta, pinned_delta, occupancy if changed else None

    def totals(self) -> dict[str, float]:
        with self._lock:
            return self._metrics.as_dict()
