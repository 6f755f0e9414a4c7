"""The host staging tier on P: which leases to copy to host memory, and the hand-over between the two ledgers.

Two ledgers, one lease: P's :class:`~kvlifecycle.source_ledger.SourceLedger` pins the GPU blocks, the
:class:`~kvlifecycle.staging_ledger.StagingLedger` the host slots. A lease moves from the first to the second in
three steps, each one command and one event:

1. :meth:`HostStaging.begin` — the lease is due (:class:`~kvlifecycle.staging_policy.StagingPolicy`) and still
   unclaimed: slots are taken (STAGING) and the caller posts the device -> host copy (ordered on a stream after the
   prefill, off the scheduler's thread);
2. :meth:`HostStaging.copy_done` — the copy's completion: the slots become STAGED, and only then does the source
   ledger release the GPU lease as ``staged`` (:meth:`SourceLedger.hand_over_staged`), which it refuses if a
   consumer claimed the GPU copy meanwhile: that consumer may be reading it, so the GPU copy stays pinned until
   its read ends and the staged copy is dropped;
3. :meth:`HostStaging.claim` — a consumer's claim goes where the lease is now: to the staged copy (served from
   host memory) once it is whole, to the GPU copy before that.

The order in step 2 is the invariant ``replay --check`` verifies across the logs (``staged-before-copy``,
``staged-while-claimed``, ``staged-under-reader`` in :mod:`kvlifecycle.staging_checks`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from kvlifecycle.machines import HostSlotState
from kvlifecycle.source_ledger import SourceLedger
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StageWhen, StagingPolicy, WhenFull


class Where(enum.Enum):
    """Where a claimed lease's KV is read from."""

    GPU = "gpu"
    HOST = "host"
    NOWHERE = "nowhere"  # the token names no live lease: the consumer must not read


@dataclass(frozen=True, slots=True)
class CopyPlan:
    """One staging copy to post: P's GPU blocks, in order, into these host slots."""

    request: str
    transfer: str
    gpu_blocks: np.ndarray
    slots: np.ndarray


class HostStaging:
    """Drives the hand-over between a source ledger and its staging pool under a policy (thread-safe: each step
    is one command of one ledger, or two commands whose order is the invariant)."""

    def __init__(self, source: SourceLedger, pool: StagingLedger, policy: StagingPolicy) -> None:
        if pool.source_worker != source.worker:
            raise ValueError(f"pool takes over {pool.source_worker!r}'s leases, not {source.worker!r}'s")
        self.source, self.pool, self.policy = source, pool, policy
        self._kept: set[str] = set()  # leases a full pool left on the GPU for good (WhenFull.KEEP_GPU)

    def due(self, free_gpu_blocks: int | None = None) -> list[str]:
        """Transfers the policy wants staged now, oldest grant first: unclaimed, not yet staged, not kept."""
        policy = self.policy
        if not policy.enabled:
            return []
        now = self.source.clock.now()
        with self.source._lock:
            candidates = sorted(
                (lease for lease in self.source.leases.values()
                 if not lease.claimed and not lease.done and lease.transfer not in self.pool.requests
                 and lease.transfer not in self._kept),
                key=lambda lease: lease.granted_at)
        if policy.when is StageWhen.AFTER:
            return [lease.transfer for lease in candidates if (now - lease.granted_at) * 1e3 >= policy.stage_after_ms]
        if free_gpu_blocks is None or free_gpu_blocks >= policy.free_block_watermark:
            return []
        return [lease.transfer for lease in candidates]

    def begin(self, transfer: str) -> CopyPlan | None:
        """Take slots for ``transfer``'s copy (recorded STAGING); None when it is not stageable now (claimed,
        gone, or the pool is full: it waits, or under ``keep_gpu`` stays on the GPU)."""
        with self.source._lock:  # the lease must not be claimed between the look and the slots' record
            lease = self.source.leases.get(transfer)
            if lease is None or lease.claimed or lease.done or transfer in self.pool.requests:
                return None
            slots = self.pool.free_slots(int(lease.blocks.size))
            if slots is None:
                if self.policy.when_full is WhenFull.KEEP_GPU:
                    self._kept.add(transfer)
                return None
            self.pool.stage(lease.request, transfer, lease.generation, slots, lease.blocks, lease.epoch,
                            lease.consumers, lease.expires_at, lease.ttl_s)
            return CopyPlan(lease.request, transfer, lease.blocks.copy(), slots)

    def copy_done(self, transfer: str, ok: bool = True, reason: str = "") -> bool:
        """The copy ended. True when the GPU lease was handed over (its blocks may be freed: the source ledger's
        ``take_released`` says ``staged``). A failed copy is dropped; so is a whole one whose GPU lease a consumer
        claimed meanwhile (it reads the GPU copy) or that ended."""
        copy = self.pool.requests.get(transfer)
        if copy is None:
            return False
        if not ok:
            self.pool.abort(transfer, reason or "copy failed")
            return False
        if not self.pool.copy_completed(transfer):
            return False
        if self.source.hand_over_staged(transfer, copy.generation):
            return True
        self.pool.cancel(transfer)
        return False

    def claim(self, transfer: str, generation: int, peer: str = "") -> Where:
        """A consumer claims the lease before reading: from host memory once the staged copy is whole, else from
        the GPU (a copy still in flight is then dropped at its completion)."""
        copy = self.pool.requests.get(transfer)
        if copy is not None and copy.state in (HostSlotState.STAGED, HostSlotState.SERVING):
            return Where.HOST if self.pool.serve(transfer, generation, peer) else Where.NOWHERE
        return Where.GPU if self.source.heartbeat(transfer, generation, peer) else Where.NOWHERE

    def renew(self, transfer: str, generation: int, peer: str = "", *, claim: bool = False) -> Where:
        """A renewal that starts no read: a keepalive before the read (``claim=False``) or the reader's renewal
        during it (``claim=True``, to the GPU lease: it stays claimed). Where the lease is now, or NOWHERE."""
        copy = self.pool.requests.get(transfer)
        if copy is not None and copy.state in (HostSlotState.STAGED, HostSlotState.SERVING):
            return Where.HOST if self.pool.renew(transfer, generation, peer) else Where.NOWHERE
        return Where.GPU if self.source.heartbeat(transfer, generation, peer, claim=claim) else Where.NOWHERE

    def where(self, transfer: str, generation: int) -> Where:
        """Where a live lease's KV is read from now (no command, nothing recorded)."""
        copy = self.pool.requests.get(transfer)
        if copy is not None and copy.generation == generation and copy.state in (HostSlotState.STAGED,
                                                                                   HostSlotState.SERVING):
            return Where.HOST
        lease = self.source.leases.get(transfer)
        return Where.GPU if lease is not None and lease.generation == generation else Where.NOWHERE

    def read_done(self, where: Where, transfer: str, generation: int, consumer: int = 0, *, ok: bool = True,
                  reason: str = "") -> bool:
        """The consumer's read (claimed at ``where``) ended; the lease ends with its last consumer."""
        if where is Where.HOST:
            return self.pool.read_ended(transfer, generation, consumer, ok=ok, reason=reason)
        if where is Where.GPU:
            if ok:
                return self.source.consumer_done(transfer, generation, consumer)
            return self.source.fail(transfer, generation, reason)
        return False

    def sweep(self) -> list[str]:
        """Expire staged copies whose lease ran out (the source ledger sweeps its own)."""
        return self.pool.sweep()
