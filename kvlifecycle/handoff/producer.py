"""Producer (P): serves metadata, grants, claims and heartbeats on a side channel, writes pushes, and counts the
consumers' completions. The flow and the threads are described in :mod:`kvlifecycle.handoff`, which shares its
options, block mapping and messages with this module.

One concept, longer than most: P's side of the handoff (handshake, grants, claims, renewals, pushes, notifications,
its service loop), the mirror of the Consumer. Its host staging tier's plumbing lives in
:mod:`kvlifecycle.handoff.staging_tier`; only the few points where a staged lease is routed there are here."""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from kvlifecycle.claims import TOKEN_BYTES, ClaimBook
from kvlifecycle.control import Claimed, GetGrant, GrantReply, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.digest import BlockDigester, BlockDigests, should_digest, slice_view
from kvlifecycle.handoff.block_mapping import BlockMappingError, map_blocks
from kvlifecycle.handoff.options import HandoffOptions
from kvlifecycle.handoff.staging_tier import StagedPush, StagingTier
from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    EpochTracker,
    GetMeta,
    HandshakePlan,
    MalformedHandshakeError,
    MetaReply,
    check_get_meta,
    negotiate,
    scale_view,
)
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.path_selection import PRIMARY_PATH, PathSelector, PushPath
from kvlifecycle.protocol import RENEWAL_TOO_LATE, WRITE_IN_FLIGHT, renewal_too_late
from kvlifecycle.protocol.producer import Answer, ProducerProtocol
from kvlifecycle.sidechannel import Ack, Handler, SideChannelRefused, SideChannelServer
from kvlifecycle.transport import (
    Notification,
    PeerMetadata,
    PreparedPlan,
    RemoteMismatchError,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
    cancels_in_flight,
)

log = logging.getLogger("kvlifecycle.handoff")
_DEFAULT_OPTIONS = HandoffOptions()
ENDED_GRANTS_KEPT = 4096  # forgotten grants remembered for GetGrant (a few minutes of requests)
PEERS_KEPT = 4096  # D agents whose TP size is remembered (far more decode ranks than one P serves)
# After a handshake D's connect-time probe reads from this side; over UCX that first READ completes only once this
# agent has progressed the wire-up, so the data plane wakes and polls tightly for a while (not longer: on shared
# cores a tight poll takes CPU from the engines; past it the idle rhythm still progresses the wire-up)
WIRE_UP_ACTIVITY_S = 2.0
Handlers = dict[type, Handler]  # the side channel's handler of each message type


# --- Producer -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Push:
    handle: TransferHandle
    transfer: str
    generation: int
    path: PushPath  # the transport that owns ``handle``, and D's name on it
    note: Notification


class Producer:
    """P side: serves metadata, grants and heartbeats on a side channel; counts consumer notifications."""

    def __init__(
        self,
        ledger: SourceLedger,
        transport: Transport,
        compat: CompatInfo,
        *,
        tp_rank: int = 0,
        options: HandoffOptions = _DEFAULT_OPTIONS,
        fast_transport: Transport | None = None,
        path_selector: PathSelector = PRIMARY_PATH,
        side_channel: Callable[[Handlers], SideChannelServer] | None = None,
        thread: bool = True,
        digester: BlockDigester | None = None,
        slice_bytes: int = 0,
        staging: StagingTier | None = None,
    ) -> None:
        """``digester``: reads P's blocks for their digests (``transports.digest_host.HostDigester`` over DRAM);
        with ``options.verify`` choosing a transfer, its grant is answered with a digest per block and per head
        slice of its consumers (``slice_bytes``: the bytes of a block of the first region group that the slices
        divide; 0: one digest of each whole block), computed on the side-channel thread when D first asks.

        ``fast_transport``: a same-node fast path (CUDA IPC) registered over the same KV regions as
        ``transport``; its metadata travels in the handshake reply next to ``transport``'s, and the notifications
        of reads through it are drained like ``transport``'s. At a push handshake, ``path_selector`` (the one a
        Consumer takes: the transports' ``SameNodeSelector`` picks the fast path when both sides hold VRAM on one
        node and the self-test passes) picks the transport of P's writes into that D; the default keeps every
        write on ``transport``.

        ``staging``: P's host staging tier (:mod:`kvlifecycle.handoff.staging_tier`): the service step copies
        the leases its policy says are due to the host pool and hands their GPU blocks back (the ledger releases
        them as ``staged``) once the copy is whole; a claim after that is answered with the host slots to read
        (``Claimed.host_blocks``), one before it reads the GPU copy, which stays pinned until that read ends.
        None (the default): nothing is staged.

        The simulator's seams (the defaults are the real ones): ``side_channel`` makes the server of the handlers
        (the real one listens on ``options.host``/``port``); ``thread`` False: no service thread; the caller turns
        the loop with :meth:`step_once`."""
        self.ledger, self.transport, self.compat, self.tp_rank = ledger, transport, compat, tp_rank
        self.digester, self.slice_bytes = digester, slice_bytes
        self.fast_transport = fast_transport
        self.path_selector = path_selector
        self.options = options
        self.grants: dict[str, GrantReply] = {}
        self._aliases: dict[str, str] = {}  # request -> the other name its grant is published under
        # grants the engine forgot (their lease ended), newest last: D asking for one is told at once that it
        # ended, instead of waiting for a grant that will never be published
        self._ended: OrderedDict[str, str] = OrderedDict()  # request -> its last transfer
        self.epochs = EpochTracker()
        self._push_plans: dict[tuple[str, int], PushPath] = {}  # (D agent, its epoch) -> where P's writes go
        self._push_refusals: dict[tuple[str, int], str] = {}
        self._peer_tp: OrderedDict[str, int] = OrderedDict()  # D agent -> its TP size (its last handshake)
        self._pushes: list[_Push] = []
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.notifications_seen = 0
        self._failed_consumers: dict[tuple[str, int], tuple[set[int], str]] = {}  # (transfer, gen) -> failed, why
        self.protocol = ProducerProtocol(ledger)  # P's decisions (kvlifecycle.protocol), called under _lock
        self.claims = ClaimBook()  # per-claim tokens: only a lease's claimant may renew, fail or complete it
        self.staging = staging
        if staging is not None:
            staging.attach(transport)
        handlers: Handlers = {
            GetMeta: self._on_get_meta,
            GetGrant: self._on_get_grant,
            Heartbeat: self._on_heartbeat,
            PushRequest: self._on_push,
            LoadFailed: self._on_load_failed,
        }
        self.server = (
            SideChannelServer(handlers, host=options.host, port=options.port, secret=options.secret,
                              name=f"side-{transport.agent}")
            if side_channel is None
            else side_channel(handlers)
        )
        self._thread = threading.Thread(target=self._serve, name=f"producer-{transport.agent}", daemon=True)
        if thread:
            self._thread.start()

    @property
    def address(self) -> str:
        return self.server.address

    # -- engine-facing ----------------------------------------------------------------------------------------------
    def grant(self, request: str, *, consumers: int = 1, ttl_s: float | None = None, peer: str = "") -> GrantReply:
        g = self.ledger.grant(request, consumers=consumers, ttl_s=ttl_s, peer=peer)
        reply = GrantReply(
            g.request,
            g.transfer,
            g.generation,
            g.worker,
            g.block_ids.tolist(),
            g.consumers,
            g.ttl_s,
            self.transport.agent,
            self.transport.epoch,
            self.tp_rank,
        )
        with self._lock:
            self.grants[request] = reply
            self._ended.pop(request, None)
        return reply

    # -- side-channel handlers (side-channel thread: short) ---------------------------------------------------------
    def _on_get_meta(self, msg: GetMeta, _peer: bytes) -> MetaReply:
        try:
            check_get_meta(msg)
        except MalformedHandshakeError as exc:
            raise SideChannelRefused("malformed", str(exc)) from exc
        try:
            plan = negotiate(msg.compat, self.compat, d_rank=msg.tp_rank)
        except CompatMismatchError as exc:  # the fields travel too: D's error lists them like P's
            raise SideChannelRefused("compat", str(exc), msgspec.msgpack.encode(exc.fields)) from exc
        change = self.epochs.observe(msg.agent, msg.epoch)
        if change.kind == "stale":
            raise SideChannelRefused("stale_epoch", f"{msg.agent}: epoch {msg.epoch} < known {change.previous}")
        if change.kind in ("new", "restarted"):
            self.ledger.peer_restarted(msg.agent, msg.epoch)  # records the epoch; drops push leases of the old one
            if self.staging is not None:  # and the staged copies its old incarnation claimed
                with self._lock:
                    self.staging.staging.pool.peer_restarted(msg.agent, msg.epoch)
        with self._lock:
            self._peer_tp.pop(msg.agent, None)
            self._peer_tp[msg.agent] = msg.compat.tp_size
            while len(self._peer_tp) > PEERS_KEPT:
                self._peer_tp.popitem(last=False)
        if msg.meta is not None:  # push mode: P writes into D, so P needs D's metadata too
            peer = self.transport.add_peer(msg.meta)
            try:
                primary = PushPath(self.transport, peer, self._prepare_push(self.transport, peer, msg, plan))
            except RemoteMismatchError as exc:  # e.g. views this transport cannot express: D pulls instead
                log.info("push to %s unavailable: %s", peer, exc)
                self._push_refusals[(peer, msg.meta.epoch)] = str(exc)
            else:
                self._push_plans[(peer, msg.meta.epoch)] = self._select_push_path(primary, msg, plan)
                if self.staging is not None:  # a staged lease is written from the host pool's transport
                    why = self.staging.add_push_peer(
                        msg.meta, lambda transport, name: self._prepare_push(transport, name, msg, plan))
                    if why:
                        log.info("pushes of staged leases to %s unavailable: %s", peer, why)
        self._expect_activity(WIRE_UP_ACTIVITY_S)
        host = self.staging.metadata() if self.staging is not None else None
        return MetaReply(self.compat, self.tp_rank, self.transport.local_metadata(), self._fast_meta(), host)

    def _select_push_path(self, primary: PushPath, msg: GetMeta, plan: HandshakePlan) -> PushPath:
        """Ask the path selector where P's writes into this D go (as D asks for its reads): the fast path gets a
        plan of the same views as ``primary``'s; a view it refuses keeps ``primary`` (logged, and said in the
        choice)."""
        path = self.path_selector.select(self.transport, self.fast_transport, msg.fast_meta)
        if path.transport is self.transport:
            return dataclasses.replace(primary, choice=path.choice)
        try:
            fast = self._prepare_push(path.transport, path.peer, msg, plan)
        except TransportError as exc:
            log.info("fast path to %s not used for pushes: %s", primary.peer, exc)
            choice = path.choice and dataclasses.replace(
                path.choice, backend=self.transport.name, reason=f"the fast path refused the views: {exc}")
            return dataclasses.replace(primary, choice=choice)
        log.info("pushes to %s go through %s (%s)", primary.peer, path.transport.name,
                 path.choice.reason if path.choice is not None else "selected")
        return PushPath(path.transport, path.peer, fast, path.choice)

    def push_path(self, agent: str, epoch: int) -> PushPath | None:
        """Where P's writes into D ``agent`` (at agent epoch ``epoch``) go; ``None``: no push handshake of that
        incarnation was accepted (:meth:`push_refusal` says why, if one was refused)."""
        return self._push_plans.get((agent, epoch))

    def push_refusal(self, agent: str, epoch: int) -> str:
        """Why pushes into D ``agent`` at ``epoch`` are unavailable."""
        return self._push_refusals.get((agent, epoch), "handshake with push metadata first")

    def _prepare_push(self, transport: Transport, peer: str, msg: GetMeta, plan: HandshakePlan) -> PreparedPlan:
        """The plan of P's writes into D rank ``msg.tp_rank`` on ``transport`` (D's name there: ``peer``): whole
        blocks under equal TP; under heterogeneous TP the views of D's read of this P rank, mirrored (P's slice is
        D's remote view) and scaled to bytes as D scales them. Raises :class:`RemoteMismatchError` when this P rank
        is not one D rank ``msg.tp_rank`` reads (or ``transport``'s error for views it cannot express)."""
        if msg.compat.tp_size == self.compat.tp_size:
            return transport.prepare(peer)
        reads = [r for r in plan.reads if r.p_rank == self.tp_rank]
        if not reads:
            raise RemoteMismatchError(
                f"P rank {self.tp_rank} (TP {self.compat.tp_size}) is not a source of D rank {msg.tp_rank} "
                f"(TP {msg.compat.tp_size}), which reads P ranks {[r.p_rank for r in plan.reads]}")
        unit = self.options.unit_bytes
        local_view, remote_view = reads[0].remote_view, reads[0].local_view
        return transport.prepare(peer, local_view=scale_view(local_view, unit) if unit else local_view,
                                 remote_view=scale_view(remote_view, unit) if unit else remote_view)

    def peer_tp_size(self, agent: str) -> int | None:
        """The TP size D agent ``agent`` declared in its last accepted handshake (``None``: none seen): how many
        D ranks read each rank of this P (an engine that waits for all of them before it prefills)."""
        with self._lock:
            return self._peer_tp.get(agent)

    def _fast_meta(self) -> PeerMetadata | None:
        if self.fast_transport is None:
            return None
        try:
            return self.fast_transport.local_metadata()
        except TransportError as exc:  # not registered, or closed: D falls back to NIXL
            log.info("no fast-path metadata offered: %s", exc)
            return None

    def alias_grant(self, request: str, alias: str) -> bool:
        """Publish ``request``'s grant under ``alias`` too (a layer-wise stream's key, which D knows the request by
        when its stream fell back to the post-prefill path); :meth:`forget` of ``request`` drops both."""
        with self._lock:
            reply = self.grants.get(request)
            if reply is None:
                return False
            self.grants[alias] = reply
            self._aliases[request] = alias
            return True

    def forget(self, request: str) -> GrantReply | None:
        """Stop publishing ``request``'s grant (the engine dropped it); the lease itself ends through the ledger."""
        with self._lock:
            alias = self._aliases.pop(request, None)
            if alias is not None:
                self.grants.pop(alias, None)
            reply = self.grants.pop(request, None)
            if reply is not None:
                for name in (request,) if alias is None else (request, alias):
                    self._ended[name] = reply.transfer
                while len(self._ended) > ENDED_GRANTS_KEPT:
                    self._ended.popitem(last=False)
            return reply

    def _on_get_grant(self, msg: GetGrant, _peer: bytes) -> GrantReply:
        with self._lock:
            reply = self.grants.get(msg.request)
            ended = self._ended.get(msg.request)
        if reply is not None:
            return self._with_digests(msg.request, reply)
        if ended is not None:  # final, unlike ``unknown_request`` (not published yet): the client stops waiting
            raise SideChannelRefused("grant_ended", f"the lease of {msg.request!r} ({ended}) ended (completed, "
                                     "failed or expired): its grant is no longer published")
        raise SideChannelRefused("unknown_request", f"no grant published for {msg.request!r}")

    def _with_digests(self, request: str, reply: GrantReply) -> GrantReply:
        """``reply`` with P's digests of its blocks when verification chooses its transfer (computed once, here on
        the side-channel thread: the bytes are final since the grant, and the engine's thread never waits). A lease
        staged meanwhile is digested from its host copy; one whose blocks were released while they were read (the
        lease checked live again after) goes without digests, D loading it unchecked, never against wrong ones."""
        if reply.digests is not None or not should_digest(self.options.verify, reply.transfer):
            return reply
        slices = max(reply.consumers, 1) if self.slice_bytes else 1
        views = [slice_view(self.slice_bytes, slices, c) for c in range(slices)] if self.slice_bytes else [(0, 0)]
        values: np.ndarray | None = None
        staging, key = self.staging, (reply.transfer, reply.generation)
        if self.digester is not None and (staging is None or self.protocol.lease_is_live(*key)):
            blocks = np.asarray(reply.block_ids, dtype=np.int64)
            values = np.stack([self.digester.digests(blocks, offset=o, length=n) for o, n in views])
            if staging is not None and not self.protocol.lease_is_live(*key):
                values = None  # staged while read: the GPU blocks may hold another request's bytes now
        if values is None and staging is not None and staging.digester is not None:
            with self._lock:
                copy = staging.whole_copy(*key)
            if copy is not None:  # read outside the lock (the service step goes on), kept if still that copy
                values = staging.digests_of(copy, views)
                with self._lock:
                    values = values if staging.whole_copy(*key) is copy else None
        if values is None:
            return reply
        digested = msgspec.structs.replace(reply, digests=BlockDigests.of(values))
        with self._lock:
            if self.grants.get(request) is reply:  # still this grant: every later ask gets the same digests
                self.grants[request] = digested
        return digested

    def _check_claim(self, transfer: str, generation: int, token: bytes, *, consumer: int | None = None,
                     unclaimed_ok: bool = False) -> str:
        """The claim-token check of a live lease; a lease that ended is the ledger's to refuse (stale token)."""
        if not self._lease_is_live(transfer, generation):
            return ""
        return self.claims.check(transfer, generation, token, consumer=consumer, unclaimed_ok=unclaimed_ok)

    def _too_late(self, transfer: str, generation: int, consumer: int, since_claim: float) -> bool:
        """A claimant's renewal or push request held back in the network past its transit bound
        (:func:`~kvlifecycle.protocol.bounds.renewal_too_late`): it renews nothing, so that D's bound on a lost
        peer's writes holds (:class:`~kvlifecycle.protocol.bounds.WriteBound`)."""
        claimed_at = self.claims.claimed_at(transfer, generation, consumer)
        if claimed_at is None:
            return False
        lease = self.ledger.leases.get(transfer)
        if lease is not None and lease.generation == generation:
            ttl = lease.ttl_s
        else:
            copy = self.staging.staging.pool.requests.get(transfer) if self.staging is not None else None
            if copy is None or copy.generation != generation:
                return False  # the lease is gone: refused as such
            ttl = copy.ttl_s
        return renewal_too_late(self.ledger.clock.now(), claimed_at, since_claim, ttl)

    def _lease_is_live(self, transfer: str, generation: int) -> bool:
        lease = self.ledger.leases.get(transfer)
        if lease is not None and lease.generation == generation:
            return True
        return self.staging is not None and self.staging.is_live(transfer, generation)  # carried on in host memory

    def _refuse_token(self, command: str, transfer: str, why: str) -> str:
        """A wrong or missing claim token: recorded as the ledger's refusal of ``command``; nothing changes."""
        lease = self.ledger.leases.get(transfer)
        self.ledger.refuse(command, why, lease.request if lease is not None else "", transfer)
        return why

    def _on_heartbeat(self, msg: Heartbeat, _peer: bytes) -> Ack | Claimed:
        if msg.hlc:
            self.ledger.hlc.observe(msg.hlc)
        if msg.token or not msg.agent:  # a renewal by the claimant, or a keepalive of a lease nobody claimed yet
            why = self._check_claim(msg.transfer, msg.generation, msg.token, unclaimed_ok=not msg.token)
            if why:
                return Ack(False, self._refuse_token("heartbeat", msg.transfer, why))
            if msg.token and self._too_late(msg.transfer, msg.generation, msg.consumer, msg.since_claim):
                return Ack(False, self._refuse_token("heartbeat", msg.transfer, RENEWAL_TOO_LATE))
            answer, _ = self._renew(msg.transfer, msg.generation, msg.agent, claim=bool(msg.token))
            return Ack(answer.ok, answer.detail)
        return self._claim(msg)

    def _claim(self, msg: Heartbeat) -> Claimed:
        lease = self.ledger.leases.get(msg.transfer)
        if lease is not None and lease.generation == msg.generation and not 0 <= msg.consumer < lease.consumers:
            why = f"claim token: consumer {msg.consumer} not in [0, {lease.consumers})"
            return Claimed(False, self._refuse_token("heartbeat", msg.transfer, why))
        token = self.claims.claim(msg.transfer, msg.generation, msg.consumer, now=self.ledger.clock.now())
        if token is None:
            why = f"claim token: consumer {msg.consumer} of this lease is claimed already"
            return Claimed(False, self._refuse_token("heartbeat", msg.transfer, why))
        answer, host = self._renew(msg.transfer, msg.generation, msg.agent, first=True)
        if not answer.ok:
            self.claims.unclaim(msg.transfer, msg.generation, msg.consumer)
            return Claimed(False, answer.detail)
        if host is None:
            return Claimed(True, "", token)
        return Claimed(True, "", token, host.tolist(), self.ledger.hlc.tick())

    def _renew(self, transfer: str, generation: int, agent: str, claim: bool = True,
               first: bool = False) -> tuple[Answer, np.ndarray | None]:
        """A claim (``first``), renewal or keepalive; with the host slots to read when a claim is served from the
        staged copy."""
        with self._lock:  # a lease expired under its write is answered WRITE_IN_FLIGHT, not released under it
            if self.staging is None:
                answer, host = self.protocol.renew(transfer, generation, agent, claim=claim), None
            else:
                answer, host = self.staging.renew(self.protocol, transfer, generation, agent, claim=claim,
                                                  first=first)
        if answer.ok:  # a claim precedes a read: let the data plane poll tightly meanwhile
            self._expect_activity(1.0)
        return answer, host

    def _expect_activity(self, seconds: float) -> None:
        for transport in (self.transport, self.fast_transport):  # a split fast path holds a NIXL agent too
            expect = getattr(transport, "expect_activity", None)
            if expect is not None:
                expect(seconds)

    def _on_load_failed(self, msg: LoadFailed, _peer: bytes) -> Ack:
        # Without a token only a lease nobody claimed can be handed back (an engine that never started the load);
        # a claimed lease is the claimant's to fail.
        # a consumer index names whose token this must be: one reader cannot fail a sibling's share of the lease
        why = self._check_claim(msg.transfer, msg.generation, msg.token, unclaimed_ok=True,
                                consumer=msg.consumer if msg.consumer >= 0 and msg.token else None)
        if why:
            return Ack(False, self._refuse_token("fail", msg.transfer, why))
        if msg.hlc:  # D settled its load before telling us: our release must sort after that
            self.ledger.hlc.observe(msg.hlc)
        if self.staging is not None:
            with self._lock:  # a read of (or a hand-back of) the staged copy; a write from it in flight first ends
                if self.staging.hand_back(msg.transfer, msg.generation, msg.reason):
                    return Ack(False, WRITE_IN_FLIGHT)
                if self.staging.read_ended(msg.transfer, msg.generation, msg.consumer, ok=False, reason=msg.reason):
                    return Ack(True)
        lease = self.ledger.leases.get(msg.transfer)
        if lease is not None and lease.consumers > 1 and 0 <= msg.consumer < lease.consumers:
            with self._lock:
                key = (msg.transfer, msg.generation)
                failed, _ = self._failed_consumers.get(key, (set(), ""))
                failed.add(msg.consumer)
                self._failed_consumers[key] = (failed, msg.reason)
            self._fail_when_settled(key)  # else once every sibling consumer settled (or at lease expiry)
            return Ack(True)
        with self._lock:  # released now, or (WRITE_IN_FLIGHT) once our write of it was cancelled
            answer = self.protocol.hand_back(msg.transfer, msg.generation, msg.reason)
        return Ack(answer.ok, answer.detail)

    def _fail_when_settled(self, key: tuple[str, int]) -> bool:
        """Release a lease some of whose consumers failed once none of its consumers may still be reading."""
        lease = self.ledger.leases.get(key[0])
        with self._lock:
            entry = self._failed_consumers.get(key)
            if entry is None:
                return False
            failed, reason = set(entry[0]), entry[1]
            gone = lease is None or lease.generation != key[1]
            if lease is not None and not gone and len(failed | lease.done) < lease.consumers:
                return False
            self._failed_consumers.pop(key, None)
        if not gone:
            with self._lock:
                self.protocol.hand_back(key[0], key[1], f"{sorted(failed)}: {reason}")
        return True

    def _on_push(self, msg: PushRequest, _peer: bytes) -> Ack:
        path = self.push_path(msg.agent, msg.epoch)
        why = self._check_claim(msg.transfer, msg.generation, msg.token)  # only the claimant has P write for it
        if why:
            return Ack(False, self._refuse_token("push", msg.transfer, why))
        if self._too_late(msg.transfer, msg.generation, 0, msg.since_claim):  # a push has one consumer per P rank
            return Ack(False, self._refuse_token("push", msg.transfer, RENEWAL_TOO_LATE))
        if self.staging is not None:
            staged = self._push_from_host(msg, self.staging)
            if staged is not None:
                return staged
        unavailable = None if path is not None else self.push_refusal(msg.agent, msg.epoch)
        with self._lock:  # no live lease, no plan, a duplicate (one WRITE per part, ever), or renewed to write
            admission = self.protocol.admit_push(msg.transfer, msg.generation, msg.part, unavailable=unavailable)
        if not admission.write or path is None or admission.source is None:
            return Ack(admission.answer.ok, admission.answer.detail)
        try:  # D may hold a prefix already: it then gets P's tail; a D block left empty is refused
            dst, src = map_blocks(np.asarray(msg.blocks, dtype=np.int32), admission.source)
        except BlockMappingError as exc:  # D fails its load and answers LoadFailed, which releases the lease
            return Ack(False, str(exc))
        note = Notification(
            msg.target_request,
            msg.transfer,
            msg.generation,
            path.transport.epoch,
            "done",
            msg.part,
            msg.token,  # the claim's token: D takes this completion (or failure) only from the P it claimed
            hlc=self.ledger.hlc.tick(),
        )
        with self._lock:
            self.protocol.accept_write(msg.transfer, msg.generation, msg.part)
        self._jobs.put(lambda: self._start_push(path, src, dst, msg, note))
        return Ack(True)

    def _push_from_host(self, msg: PushRequest, tier: StagingTier) -> Ack | None:
        """A push of a lease staged to the host pool: written from its slots by the pool's transport (None: the
        lease is on the GPU, or gone: the GPU path answers)."""
        try:
            with self._lock:
                answer, push = tier.admit_push(msg.transfer, msg.generation, msg.part, msg.agent, msg.epoch,
                                               np.asarray(msg.blocks, dtype=np.int32))
        except BlockMappingError as exc:  # D fails its load and answers LoadFailed, which ends the read
            return Ack(False, str(exc))
        if answer is None:
            return None
        if push is not None:
            note = Notification(msg.target_request, msg.transfer, msg.generation, push.path.transport.epoch, "done",
                                msg.part, msg.token, hlc=self.ledger.hlc.tick())
            self._jobs.put(lambda: self._start_host_push(tier, push, note))
        return Ack(answer.ok, answer.detail)

    def _start_host_push(self, tier: StagingTier, push: StagedPush, note: Notification) -> None:
        with self._lock:
            why = tier.post_push(push, note)
        if why:
            push.note = note
            self._host_push_failed(tier, push, f"write not posted: {why}")

    def _host_push_failed(self, tier: StagingTier, push: StagedPush, reason: str) -> None:
        """As :meth:`_push_failed`: D hears it, and its ``LoadFailed`` ends the read (now, if D cannot be told)."""
        assert push.note is not None
        log.warning("push %s (staged) to %s failed: %s", push.transfer, push.path.peer, reason)
        try:
            payload = push.note.payload + reason.encode()[:512]
            failed = msgspec.structs.replace(push.note, kind="failed", payload=payload, hlc=self.ledger.hlc.tick())
            push.path.transport.send_notification(push.path.peer, failed)
        except TransportError as exc:
            log.warning("could not tell %s that push %s failed (%s): ending its read now", push.path.peer,
                        push.transfer, exc)
            if not push.read_over:
                with self._lock:
                    tier.read_ended(push.transfer, push.generation, push.part, ok=False, reason=reason)

    # -- service thread ---------------------------------------------------------------------------------------------
    def _start_push(
        self, path: PushPath, src: np.ndarray, dst: np.ndarray, msg: PushRequest, note: Notification
    ) -> None:
        why = self._must_stop(msg.transfer, msg.generation)
        if why:  # e.g. the job ran after the lease expired
            self._write_settled(msg.transfer, msg.generation, msg.part, None)
            self._push_failed(msg.transfer, msg.generation, path, note, f"write not posted: {why}")
            return
        try:
            handle = path.transport.post(XferOp.WRITE, path.plan, src, dst, notification=note,
                                         transfer=msg.transfer)
        except (TransportError, ValueError) as exc:
            self._write_settled(msg.transfer, msg.generation, msg.part, None)
            self._push_failed(msg.transfer, msg.generation, path, note, f"post failed: {exc}")
            return
        self._pushes.append(_Push(handle, msg.transfer, msg.generation, path, note))

    def _must_stop(self, transfer: str, generation: int) -> str:
        with self._lock:
            return self.protocol.stop_write(transfer, generation)

    def _write_settled(self, transfer: str, generation: int, part: int, status: XferStatus | None) -> None:
        """A write ended (DONE completes its part) or was never posted; a hand-back waiting for it releases now."""
        with self._lock:
            self.protocol.write_settled(transfer, generation, part, status)

    def _push_failed(self, transfer: str, generation: int, path: PushPath, note: Notification, reason: str) -> None:
        """A failed write must reach D (SGLang #36033). D settles its load first and answers ``LoadFailed``, which
        releases the lease here — so P never releases under a load D still thinks is in flight. If D cannot be
        told, the lease is released now; if D never answers, lease expiry reclaims the blocks."""
        log.warning("push %s to %s failed: %s", transfer, path.peer, reason)
        try:
            failed = msgspec.structs.replace(
                note, kind="failed", payload=note.payload + reason.encode()[:512], hlc=self.ledger.hlc.tick()
            )
            path.transport.send_notification(path.peer, failed)  # D drains its fast path's notifications too
        except TransportError as exc:
            log.warning("could not tell %s that push %s failed (%s): releasing now", path.peer, transfer, exc)
            self.ledger.fail(transfer, generation, reason)

    def write_deadline(self) -> float:
        """The earliest lease end among the writes in flight (inf: none), in P's clock: there the service loop
        cancels a write still running (it polls every millisecond while any runs, so within one of the end)."""
        ends = []
        for push in self._pushes:
            lease = self.ledger.leases.get(push.transfer)
            if lease is not None and lease.generation == push.generation:
                ends.append(lease.expires_at)
        if self.staging is not None:
            ends += self.staging.push_deadlines()
        now = self.ledger.clock.now()
        return min((end for end in ends if end > now), default=math.inf)

    def _poll_pushes(self) -> None:
        still = []
        for push in self._pushes:
            via = push.path.transport
            status = via.poll(push.handle)
            if status is XferStatus.PENDING:
                why = self._must_stop(push.transfer, push.generation)
                if not why or not cancels_in_flight(via):  # a device copy runs to its end: D hears once it did
                    still.append(push)
                    continue
                via.release(push.handle)  # cancels the write: it never outlives its lease
                self._write_settled(push.transfer, push.generation, push.note.part, None)
                self._push_failed(push.transfer, push.generation, push.path, push.note, f"write cancelled: {why}")
                continue
            stats = via.stats(push.handle)
            if status is XferStatus.DONE:
                if stats is not None:
                    self.ledger.observe_transfer_stats(push.transfer, stats)
                self._write_settled(push.transfer, push.generation, push.note.part, status)
            else:
                err = via.error(push.handle)
                self._write_settled(push.transfer, push.generation, push.note.part, None)
                self._push_failed(push.transfer, push.generation, push.path, push.note, f"write failed: {err}")
            via.release(push.handle)
        self._pushes = still

    def _drain(self) -> None:
        notes = list(self.transport.notifications())
        if self.fast_transport is not None:  # D's reads through the fast path notify there, after their event
            notes += self.fast_transport.notifications()
        staged = [] if self.staging is None else self.staging.transport.notifications()  # reads of staged copies
        for index, (_sender, note) in enumerate([*notes, *staged]):
            self.notifications_seen += 1
            if note.kind not in ("done", "failed"):
                continue
            # the claimant's token opens the payload; a failure's reason follows it
            token, rest = note.payload[:TOKEN_BYTES], note.payload[TOKEN_BYTES:]
            consumer = note.part if note.kind == "done" else None
            why = self._check_claim(note.transfer, note.generation, token, consumer=consumer)
            if why:
                self._refuse_token("consumer_done" if note.kind == "done" else "fail", note.transfer, why)
                continue
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            with self._lock:
                if index >= len(notes) and self.staging is not None:
                    self.staging.read_ended(note.transfer, note.generation, note.part, ok=note.kind == "done",
                                            reason=rest.decode(errors="replace"))
                    continue
                self.protocol.on_notification(note.kind, note.transfer, note.generation, note.part,
                                              rest.decode(errors="replace"))

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                # pushes are polled tightly; pulls only wait for D's notification, so the idle rhythm serves them
                busy = self._pushes or (self.staging is not None and self.staging.pushes_in_flight)
                job = self._jobs.get(timeout=self.options.service_poll_s if busy else self.options.idle_poll_s)
                job()
            except queue.Empty:
                pass
            except Exception:
                log.exception("producer job failed")
            try:
                self._step()
            except Exception:
                log.exception("producer service step failed")

    def _step(self) -> None:
        if self._pushes:
            self._poll_pushes()
        self._drain()
        for key in list(self._failed_consumers):
            self._fail_when_settled(key)
        with self._lock:  # a lease expired under its write waits for the write's cancel
            self.protocol.sweep()
        if self.staging is not None:
            self._step_staging(self.staging)
        if len(self.claims):
            self.claims.prune(self._lease_is_live)
        self.ledger.commit()

    def _step_staging(self, tier: StagingTier) -> None:
        """Post the copies now due, settle those that ended (a whole one hands its GPU lease over: the engine
        frees its blocks on ``take_released``'s ``staged``), expire staged copies; commit the pool's log."""
        failed: list[tuple[StagedPush, str]] = []
        with self._lock:  # the lease's claim and its copy's post or completion are ordered
            tier.post_due()
            tier.poll_copies()
            if tier.pushes_in_flight:  # a write past its copy's lease is cancelled before the sweep frees slots
                failed = tier.poll_pushes(tier.staging.pool.clock.now())
            tier.staging.sweep()
        tier.staging.pool.commit()  # a read ended by a cancel is in the log before D hears of it
        for push, why in failed:  # D is told outside the lock
            self._host_push_failed(tier, push, why)

    def step_once(self) -> None:
        """One turn of the service loop without waiting (the simulator's scheduler turns it): every queued job,
        then a step."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job()
        self._step()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self.server.close()
        if self.staging is not None:
            self.staging.close()
            self.staging.staging.pool.commit()
        self.ledger.commit()
