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
  :class:`~kvlifecycle.protocol.producer.ProducerProtocol`'s, unchanged;
- **pushes**: at a push handshake the host transport adds D as a peer too (:meth:`add_push_peer`), so a
  ``PushRequest`` for a staged lease is written from its host slots (:meth:`admit_push`, one WRITE per part, ever),
  polled on the service step (:meth:`poll_pushes`): DONE ends the claimant's read, and a write still in flight
  when the copy's lease ends, or that D handed back (:meth:`hand_back`), is cancelled (released) before the read
  ends and the sweep may free its slots.

Every method that decides runs under the Producer's lock (the Producer takes it), so a claim and a copy's
completion are ordered: a claim either finds the copy whole and is served from host, or claims the GPU lease,
which :meth:`SourceLedger.hand_over_staged` then refuses to release.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvlifecycle.digest import BlockDigester
from kvlifecycle.handoff.block_mapping import map_blocks
from kvlifecycle.machines import HostSlotState
from kvlifecycle.path_selection import PushPath
from kvlifecycle.protocol.producer import LEASE_GONE, Answer, ProducerProtocol
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagedCopy
from kvlifecycle.staging_policy import StageWhen
from kvlifecycle.transport import (
    Notification,
    PeerMetadata,
    PreparedPlan,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
)

__all__ = ["StagedPush", "StagingCopier", "StagingTier"]

_WHOLE = (HostSlotState.STAGED, HostSlotState.SERVING)


class StagingCopier(Protocol):
    """What copies P's KV blocks into the pool's slots when the host transport does not read them itself."""

    def post(self, op: XferOp, plan: None, local_blocks: np.ndarray, remote_blocks: np.ndarray, *,
             transfer: str = "") -> TransferHandle: ...

    def poll(self, handle: TransferHandle) -> XferStatus: ...

    def error(self, handle: TransferHandle) -> TransportError | None: ...

    def release(self, handle: TransferHandle) -> None: ...


@dataclass(slots=True)
class StagedPush:
    """One WRITE of a staged lease's slots into a decoder's blocks."""

    transfer: str
    generation: int
    part: int
    path: PushPath
    src: np.ndarray  # the pool's slots
    dst: np.ndarray  # D's blocks
    handle: TransferHandle | None = None
    note: Notification | None = None
    handed_back: str = ""  # D gave its load up while the write was in flight: cancel it, then end the read
    read_over: bool = False  # the claimant's read of the copy was ended here (a failure reported to D ends no more)


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
    # what copies the KV cache into the pool instead of a READ by ``transport`` (a KV cache in VRAM: the gather
    # kernel on a CUDA stream, transports.staging_copy_cuda.CudaStagingCopy); it posts READs of (slots, blocks)
    copier: StagingCopier | None = None
    _kv_plan: PreparedPlan | None = None
    _copies: dict[str, TransferHandle] = field(default_factory=dict)  # transfer -> its copy in flight
    # pushes from the pool: (D agent, its epoch) -> where writes to it go; (transfer, generation, part) accepted
    _push_paths: dict[tuple[str, int], PushPath] = field(default_factory=dict)
    _written: set[tuple[str, int, int]] = field(default_factory=set)
    _pushes: list[StagedPush] = field(default_factory=list)

    def attach(self, kv: Transport) -> None:
        """Reach P's KV cache from the host transport (the copies read it): called once by the Producer. A
        ``copier`` reads the KV cache itself."""
        if self.copier is None:
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
                if self.copier is not None:
                    handle = self.copier.post(XferOp.READ, None, plan.slots, plan.gpu_blocks, transfer=transfer)
                elif self._kv_plan is None:
                    raise TransportError("the host transport was not attached to P's KV transport")
                else:
                    handle = self.transport.post(XferOp.READ, self._kv_plan, plan.slots, plan.gpu_blocks,
                                                 transfer=transfer)
            except (TransportError, ValueError) as exc:
                self.staging.copy_done(transfer, ok=False, reason=f"copy not posted: {exc}")
                continue
            self._copies[transfer] = handle

    def poll_copies(self) -> list[str]:
        """Settle the copies that ended: a whole copy hands its GPU lease over. The transfers handed over."""
        handed = []
        via: StagingCopier | Transport = self.copier or self.transport
        for transfer, handle in list(self._copies.items()):
            status = via.poll(handle)
            if status is XferStatus.PENDING:
                continue
            del self._copies[transfer]
            reason = "" if status is XferStatus.DONE else f"copy failed: {via.error(handle)}"
            via.release(handle)
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

    # -- pushes from the pool ---------------------------------------------------------------------------------------
    def add_push_peer(self, meta: PeerMetadata, prepare: Callable[[Transport, str], PreparedPlan]) -> str:
        """A push handshake: D becomes a peer of the host transport, with a plan of the same views as the KV
        cache's (``prepare``). Returns "" or why pushes of staged leases to this D are unavailable."""
        try:
            peer = self.transport.add_peer(meta)
            self._push_paths[(peer, meta.epoch)] = PushPath(self.transport, peer, prepare(self.transport, peer))
        except TransportError as exc:
            return str(exc)
        return ""

    def admit_push(self, transfer: str, generation: int, part: int, agent: str, epoch: int,
                   blocks: np.ndarray) -> tuple[Answer | None, StagedPush | None]:
        """A ``PushRequest`` (its claim token checked) for a lease whose copy is whole in the pool: renew it and
        map D's blocks onto its slots; the push to post, or None with the answer (a duplicate is acknowledged and
        not written again). ``(None, None)``: not a staged lease, the GPU lease's path answers."""
        copy = self.whole_copy(transfer, generation)
        if copy is None:
            return None, None
        key = (transfer, generation, part)
        if key in self._written:
            return Answer(True, "duplicate: this part's write was already accepted"), None
        path = self._push_paths.get((agent, epoch))
        if path is None:
            return Answer(False, "push from P's host staging pool unavailable: no plan to this decoder"), None
        if not self.staging.pool.renew(transfer, generation, agent):  # renewed before the write, as on the GPU
            return Answer(False, LEASE_GONE), None
        dst, src = map_blocks(np.asarray(blocks, dtype=np.int32), copy.blocks)  # BlockMappingError: refused
        self._written.add(key)
        return Answer(True), StagedPush(transfer, generation, part, path, src, dst)

    def post_push(self, push: StagedPush, note: Notification) -> str:
        """Post an admitted push's WRITE from the slots (service thread); "" or why it was not posted."""
        if self.whole_copy(push.transfer, push.generation) is None:
            return "the staged copy ended before its write"
        try:
            push.handle = push.path.transport.post(XferOp.WRITE, push.path.plan, push.src, push.dst,
                                                   notification=note, transfer=push.transfer)
        except (TransportError, ValueError) as exc:
            return f"post failed: {exc}"
        push.note = note
        self._pushes.append(push)
        return ""

    def hand_back(self, transfer: str, generation: int, reason: str) -> bool:
        """D gave up a load whose write from the pool is in flight (its ``LoadFailed``): the write is cancelled on
        the next step, and only then is the read ended and D told (:data:`WRITE_IN_FLIGHT`, as on the GPU), so D
        never frees blocks the write may still land in. False: no write of this lease in flight."""
        pending = [p for p in self._pushes if (p.transfer, p.generation) == (transfer, generation)]
        for push in pending:
            push.handed_back = push.handed_back or reason
        return bool(pending)

    def push_deadlines(self) -> list[float]:
        """The lease ends of the staged copies a write from the pool is in flight for (the pool's clock)."""
        copies = [self.whole_copy(push.transfer, push.generation) for push in self._pushes]
        return [copy.expires_at for copy in copies if copy is not None]

    def poll_pushes(self, now: float) -> list[tuple[StagedPush, str]]:
        """Settle the pushes that ended: DONE ends the claimant's read (the copy ends with its last one). Returns
        the failed ones with why, for the caller to tell D outside its lock (D's ``LoadFailed`` then ends the read).
        A write still in flight when its copy's lease has run out (``now``, the pool's clock), or that D handed
        back, is cancelled first: the sweep that follows may free its slots."""
        failed: list[tuple[StagedPush, str]] = []
        still = []
        for push in self._pushes:
            via, handle = push.path.transport, push.handle
            assert handle is not None
            if push.handed_back:  # cancelled before the read ends: its slots and D's blocks are then free to go
                via.release(handle)
                push.read_over = self.read_ended(push.transfer, push.generation, push.part, ok=False,
                                                 reason=push.handed_back)
                failed.append((push, f"write cancelled: the consumer gave the load up ({push.handed_back})"))
                continue
            status = via.poll(handle)
            if status is XferStatus.PENDING:
                copy = self.whole_copy(push.transfer, push.generation)
                if copy is not None and now < copy.expires_at:
                    still.append(push)
                    continue
                via.release(handle)  # cancels the write: it never reads slots past their lease
                failed.append((push, "write cancelled: the staged copy's lease ended"))
                continue
            if status is XferStatus.DONE:
                self.read_ended(push.transfer, push.generation, push.part, ok=True)
            else:
                failed.append((push, f"write failed: {via.error(handle)}"))
            via.release(handle)
        self._pushes = still
        if self._written:  # a lease that ended takes its accepted parts along
            self._written = {k for k in self._written if self.is_live(k[0], k[1])}
        return failed

    @property
    def pushes_in_flight(self) -> int:
        return len(self._pushes)

    def close(self) -> None:
        for push in self._pushes:
            if push.handle is not None:
                push.path.transport.release(push.handle)
        self._pushes.clear()
        for handle in self._copies.values():
            (self.copier or self.transport).release(handle)
        self._copies.clear()
