"""P's host staging tier inside the handoff: the Producer's plumbing around :class:`~kvlifecycle.staging.HostStaging`.

The decisions (which lease is due, when its GPU blocks may go, where a claim reads) are the core's
(:mod:`kvlifecycle.staging`); this module gives them a transport and a place in the Producer's loop:

- **the copy**: a second transport, registered over the host pool's memory
  (:class:`~kvlifecycle.transports.host_pool.HostPool`), adds P's own KV transport as a peer and posts one READ
  of the lease's GPU blocks into its slots. Posting never waits; the service step polls the handle, and only its
  completion (:meth:`HostStaging.copy_done`) hands the GPU lease over. A failed post or copy drops the staged
  copy and the GPU lease stays as it was;
- **the read**: the host transport's metadata goes to D in the handshake (``MetaReply.host_meta``); a claim that
  finds the staged copy whole is served from it (``Claimed.host_blocks`` names the slots), and D's READ of the
  slots notifies the host transport, whose notifications end the copy's reads as the KV transport's end the GPU
  lease's;
- **renewals and failures** of a staged lease go to the pool's ledger; everything else stays the
  :class:`~kvlifecycle.protocol.producer.ProducerProtocol`'s, unchanged.

Every method that decides runs under the Producer's lock (the Producer takes it), so a claim and a copy's
completion are ordered: a claim either finds the copy whole and is served from host, or claims the GPU lease,
which :meth:`SourceLedger.hand_over_staged` then refuses to release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvlifecycle.digest import BlockDigester
from kvlifecycle.machines import HostSlotState
from kvlifecycle.protocol.producer import LEASE_GONE, Answer, ProducerProtocol
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagedCopy
from kvlifecycle.staging_policy import StageWhen
from kvlifecycle.transport import (
    PeerMetadata,
    PreparedPlan,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
)

__all__ = ["StagingTier"]

_WHOLE = (HostSlotState.STAGED, HostSlotState.SERVING)


@dataclass(slots=True)
class StagingTier:
    """A Producer's host staging: the core's :class:`HostStaging` and the transport registered over its pool.

    ``free_gpu_blocks``: how many KV blocks P's engine has free (the watermark policy's input); default: the source
    ledger's FREE blocks."""

    staging: HostStaging
    transport: Transport  # registered over the host pool's layout (one slot per block, regions like the KV cache)
    free_gpu_blocks: Callable[[], int] | None = None
    # reads the pool's slots for their digests (a HostDigester over the pool's layout): a lease staged before D
    # asked for its grant is digested from its host copy, the same bytes (a digest does not depend on the slot)
    digester: BlockDigester | None = None
    _kv_plan: PreparedPlan | None = None
    _copies: dict[str, TransferHandle] = field(default_factory=dict)  # transfer -> its copy in flight

    def attach(self, kv: Transport) -> None:
        """Reach P's KV cache from the host transport (the copies read it): called once by the Producer."""
        self._kv_plan = self.transport.prepare(self.transport.add_peer(kv.local_metadata()))

    def metadata(self) -> PeerMetadata | None:
        """The host region set's metadata for the handshake; None when it cannot be exported (D reads the GPU)."""
        try:
            return self.transport.local_metadata()
        except TransportError:
            return None

    # -- the service step -------------------------------------------------------------------------------------------
    def post_due(self) -> None:
        """Start the copy of every lease the policy wants staged now (the pool takes slots, STAGING)."""
        policy = self.staging.policy
        if not policy.enabled:
            return
        free = None
        if policy.when is StageWhen.WATERMARK:
            free = (self.free_gpu_blocks() if self.free_gpu_blocks is not None
                    else self.staging.source.counts()["FREE"])
        for transfer in self.staging.due(free):
            plan = self.staging.begin(transfer)
            if plan is None:
                continue
            try:
                if self._kv_plan is None:
                    raise TransportError("the host transport was not attached to P's KV transport")
                handle = self.transport.post(XferOp.READ, self._kv_plan, plan.slots, plan.gpu_blocks,
                                             transfer=transfer)
            except (TransportError, ValueError) as exc:
                self.staging.copy_done(transfer, ok=False, reason=f"copy not posted: {exc}")
                continue
            self._copies[transfer] = handle

    def poll_copies(self) -> list[str]:
        """Settle the copies that ended: a whole copy hands its GPU lease over. The transfers handed over."""
        handed = []
        for transfer, handle in list(self._copies.items()):
            status = self.transport.poll(handle)
            if status is XferStatus.PENDING:
                continue
            del self._copies[transfer]
            reason = "" if status is XferStatus.DONE else f"copy failed: {self.transport.error(handle)}"
            self.transport.release(handle)
            if self.staging.copy_done(transfer, ok=status is XferStatus.DONE, reason=reason):
                handed.append(transfer)
        return handed

    @property
    def copies_in_flight(self) -> int:
        return len(self._copies)

    # -- claims, renewals, reads --------------------------------------------------------------------------------------
    def whole_copy(self, transfer: str, generation: int) -> StagedCopy | None:
        """The lease's staged copy if it is whole (served from host), else None (the GPU lease answers)."""
        copy = self.staging.pool.requests.get(transfer)
        if copy is None or copy.generation != generation or HostSlotState(copy.state) not in _WHOLE:
            return None
        return copy

    def digests_of(self, copy: StagedCopy, views: list[tuple[int, int]]) -> np.ndarray:
        """A staged copy's digests per (view, block), in the grant's block order, read from its host slots (the
        caller checks that the copy was whole before and after)."""
        assert self.digester is not None
        return np.stack([self.digester.digests(copy.blocks, offset=o, length=n) for o, n in views])

    def is_live(self, transfer: str, generation: int) -> bool:
        copy = self.staging.pool.requests.get(transfer)
        return copy is not None and copy.generation == generation

    def renew(self, protocol: ProducerProtocol, transfer: str, generation: int, agent: str, *, claim: bool,
              first: bool) -> tuple[Answer, np.ndarray | None]:
        """A claim (``first``), a claimant's renewal or a keepalive, wherever the lease is now; with the host slots
        to read when a claim was served from the staged copy."""
        copy = self.whole_copy(transfer, generation)
        if copy is None:
            return protocol.renew(transfer, generation, agent, claim=claim), None
        pool = self.staging.pool
        ok = pool.serve(transfer, generation, agent) if first else pool.renew(transfer, generation, agent)
        if ok and first:  # written before D may read: a crash must not lose the record of a read it answered
            pool.commit()
        return Answer(ok, "" if ok else LEASE_GONE), (copy.blocks if ok and first else None)

    def read_ended(self, transfer: str, generation: int, consumer: int, *, ok: bool, reason: str = "") -> bool:
        """A read of the staged copy ended (D's notification, or its ``LoadFailed``); a hand-back of a copy nobody
        reads drops it. False when the lease is not a staged one (the GPU lease's path takes it)."""
        copy = self.staging.pool.requests.get(transfer)
        if copy is None or copy.generation != generation:
            return False
        if copy.readers:
            self.staging.pool.read_ended(transfer, generation, max(consumer, 0), ok=ok, reason=reason)
        elif not ok and HostSlotState(copy.state) in _WHOLE:
            self.staging.pool.cancel(transfer)
        else:
            return False
        return True

    def close(self) -> None:
        for handle in self._copies.values():
            self.transport.release(handle)
        self._copies.clear()
