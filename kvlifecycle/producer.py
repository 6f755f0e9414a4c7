"""Producer (P): serves metadata, grants, claims and heartbeats on a side channel, writes pushes, and counts the
consumers' completions. The flow and the threads are described in :mod:`kvlifecycle.handoff`, which shares its
options, block mapping and messages with this module."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np

from kvlifecycle.claims import TOKEN_BYTES, ClaimBook
from kvlifecycle.control import Claimed, GetGrant, GrantReply, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.handoff import BlockMappingError, HandoffOptions, map_blocks
from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    EpochTracker,
    GetMeta,
    MalformedHandshakeError,
    MetaReply,
    check_get_meta,
    negotiate,
)
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.sidechannel import Ack, SideChannelRefused, SideChannelServer
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
)

log = logging.getLogger("kvlifecycle.handoff")
_DEFAULT_OPTIONS = HandoffOptions()


# --- Producer -----------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Push:
    handle: TransferHandle
    transfer: str
    generation: int
    peer: str
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
    ) -> None:
        """``fast_transport``: a same-node fast path (CUDA IPC) registered over the same KV regions as
        ``transport``; its metadata travels in the handshake reply next to ``transport``'s, and the notifications
        of reads through it are drained like ``transport``'s."""
        self.ledger, self.transport, self.compat, self.tp_rank = ledger, transport, compat, tp_rank
        self.fast_transport = fast_transport
        self.options = options
        self.grants: dict[str, GrantReply] = {}
        self.epochs = EpochTracker()
        self._push_plans: dict[tuple[str, int], PreparedPlan] = {}
        self._push_refusals: dict[tuple[str, int], str] = {}
        self._pushes: list[_Push] = []
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.notifications_seen = 0
        self._pushes_accepted: set[tuple[str, int, int]] = set()  # (transfer, generation, part): writes accepted
        self.claims = ClaimBook()  # per-claim tokens: only a lease's claimant may renew, fail or complete it
        self.server = SideChannelServer(
            {
                GetMeta: self._on_get_meta,
                GetGrant: self._on_get_grant,
                Heartbeat: self._on_heartbeat,
                PushRequest: self._on_push,
                LoadFailed: self._on_load_failed,
            },
            host=options.host,
            port=options.port,
            secret=options.secret,
            name=f"side-{transport.agent}",
        )
        self._thread = threading.Thread(target=self._serve, name=f"producer-{transport.agent}", daemon=True)
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
        return reply

    # -- side-channel handlers (side-channel thread: short) ---------------------------------------------------------
    def _on_get_meta(self, msg: GetMeta, _peer: bytes) -> MetaReply:
        try:
            check_get_meta(msg)
        except MalformedHandshakeError as exc:
            raise SideChannelRefused("malformed", str(exc)) from exc
        try:
            negotiate(msg.compat, self.compat, d_rank=msg.tp_rank)
        except CompatMismatchError as exc:  # the fields travel too: D's error lists them like P's
            raise SideChannelRefused("compat", str(exc), msgspec.msgpack.encode(exc.fields)) from exc
        change = self.epochs.observe(msg.agent, msg.epoch)
        if change.kind == "stale":
            raise SideChannelRefused("stale_epoch", f"{msg.agent}: epoch {msg.epoch} < known {change.previous}")
        if change.kind in ("new", "restarted"):
            self.ledger.peer_restarted(msg.agent, msg.epoch)  # records the epoch; drops push leases of the old one
        if msg.meta is not None:  # push mode: P writes into D, so P needs D's metadata too
            peer = self.transport.add_peer(msg.meta)
            try:
                self._push_plans[(peer, msg.meta.epoch)] = self.transport.prepare(peer)
            except RemoteMismatchError as exc:  # e.g. heterogeneous TP: D pulls its slices, P does not push
                log.info("push to %s unavailable: %s", peer, exc)
                self._push_refusals[(peer, msg.meta.epoch)] = str(exc)
        return MetaReply(self.compat, self.tp_rank, self.transport.local_metadata(), self._fast_meta())

    def _fast_meta(self) -> PeerMetadata | None:
        if self.fast_transport is None:
            return None
        try:
            return self.fast_transport.local_metadata()
        except TransportError as exc:  # not registered, or closed: D falls back to NIXL
            log.info("no fast-path metadata offered: %s", exc)
            return None

    def forget(self, request: str) -> GrantReply | None:
        """Stop publishing ``request``'s grant (the engine dropped it); the lease itself ends through the ledger."""
        with self._lock:
            return self.grants.pop(request, None)

    def _on_get_grant(self, msg: GetGrant, _peer: bytes) -> GrantReply:
        with self._lock:
            reply = self.grants.get(msg.request)
        if reply is None:
            raise SideChannelRefused("unknown_request", f"no grant published for {msg.request!r}")
        return reply

    def _check_claim(self, transfer: str, generation: int, token: bytes, *, consumer: int | None = None,
                     unclaimed_ok: bool = False) -> str:
        """The claim-token check of a live lease; a lease that ended is the ledger's to refuse (stale token)."""
        if not self._lease_is_live(transfer, generation):
            return ""
        return self.claims.check(transfer, generation, token, consumer=consumer, unclaimed_ok=unclaimed_ok)

    def _lease_is_live(self, transfer: str, generation: int) -> bool:
        lease = self.ledger.leases.get(transfer)
        return lease is not None and lease.generation == generation

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
            ok = self._renew(msg.transfer, msg.generation, msg.agent)
            return Ack(ok, "" if ok else "lease is gone (released, expired or stale)")
        return self._claim(msg)

    def _claim(self, msg: Heartbeat) -> Claimed:
        lease = self.ledger.leases.get(msg.transfer)
        if lease is not None and lease.generation == msg.generation and not 0 <= msg.consumer < lease.consumers:
            why = f"claim token: consumer {msg.consumer} not in [0, {lease.consumers})"
            return Claimed(False, self._refuse_token("heartbeat", msg.transfer, why))
        token = self.claims.claim(msg.transfer, msg.generation, msg.consumer)
        if token is None:
            why = f"claim token: consumer {msg.consumer} of this lease is claimed already"
            return Claimed(False, self._refuse_token("heartbeat", msg.transfer, why))
        if not self._renew(msg.transfer, msg.generation, msg.agent):
            self.claims.unclaim(msg.transfer, msg.generation, msg.consumer)
            return Claimed(False, "lease is gone (released, expired or stale)")
        return Claimed(True, "", token)

    def _renew(self, transfer: str, generation: int, agent: str) -> bool:
        ok = self.ledger.heartbeat(transfer, generation, peer=agent)
        expect = getattr(self.transport, "expect_activity", None)
        if ok and expect is not None:  # a claim precedes a read: let the data plane poll tightly meanwhile
            expect(1.0)
        return ok

    def _on_load_failed(self, msg: LoadFailed, _peer: bytes) -> Ack:
        # Without a token only a lease nobody claimed can be handed back (an engine that never started the load);
        # a claimed lease is the claimant's to fail.
        why = self._check_claim(msg.transfer, msg.generation, msg.token, unclaimed_ok=True)
        if why:
            return Ack(False, self._refuse_token("fail", msg.transfer, why))
        if msg.hlc:  # D settled its load before telling us: our release must sort after that
            self.ledger.hlc.observe(msg.hlc)
        return Ack(self.ledger.fail(msg.transfer, msg.generation, f"consumer: {msg.reason}"))

    def _on_push(self, msg: PushRequest, _peer: bytes) -> Ack:
        lease = self.ledger.leases.get(msg.transfer)
        plan = self._push_plans.get((msg.agent, msg.epoch))
        if lease is None or plan is None:
            why = self._push_refusals.get((msg.agent, msg.epoch), "handshake with push metadata first")
            return Ack(False, "no live lease" if lease is None else f"push unavailable: {why}")
        why = self._check_claim(msg.transfer, msg.generation, msg.token)  # only the claimant has P write for it
        if why:
            return Ack(False, self._refuse_token("push", msg.transfer, why))
        key = (msg.transfer, msg.generation, msg.part)
        if key in self._pushes_accepted:
            # a duplicated request (a retry, or the network delivering it twice): one WRITE per part, ever; a second
            # would read the source blocks after the first's completion freed them, or land in blocks D recomputed
            return Ack(True, "duplicate: this part's write was already accepted")
        if not self.ledger.heartbeat(msg.transfer, msg.generation):  # renew before the write
            return Ack(False, "lease is gone (released, expired or stale)")
        try:  # D may hold a prefix already: it then gets P's tail; a D block left empty is refused
            dst, src = map_blocks(np.asarray(msg.blocks, dtype=np.int32), lease.blocks)
        except BlockMappingError as exc:  # D fails its load and answers LoadFailed, which releases the lease
            return Ack(False, str(exc))
        note = Notification(
            msg.target_request,
            msg.transfer,
            msg.generation,
            self.transport.epoch,
            "done",
            msg.part,
            msg.token,  # the claim's token: D takes this completion (or failure) only from the P it claimed
            hlc=self.ledger.hlc.tick(),
        )
        self._pushes_accepted.add(key)
        self._jobs.put(lambda: self._start_push(plan, src, dst, msg, note))
        return Ack(True)

    # -- service thread ---------------------------------------------------------------------------------------------
    def _start_push(
        self, plan: PreparedPlan, src: np.ndarray, dst: np.ndarray, msg: PushRequest, note: Notification
    ) -> None:
        try:
            handle = self.transport.post(XferOp.WRITE, plan, src, dst, notification=note, transfer=msg.transfer)
        except (TransportError, ValueError) as exc:
            self._push_failed(msg.transfer, msg.generation, plan.peer, note, f"post failed: {exc}")
            return
        self._pushes.append(_Push(handle, msg.transfer, msg.generation, plan.peer, note))

    def _push_failed(self, transfer: str, generation: int, peer: str, note: Notification, reason: str) -> None:
        """A failed write must reach D (SGLang #36033). D settles its load first and answers ``LoadFailed``, which
        releases the lease here — so P never releases under a load D still thinks is in flight. If D cannot be
        told, the lease is released now; if D never answers, lease expiry reclaims the blocks."""
        log.warning("push %s to %s failed: %s", transfer, peer, reason)
        try:
            failed = msgspec.structs.replace(
                note, kind="failed", payload=note.payload + reason.encode()[:512], hlc=self.ledger.hlc.tick()
            )
            self.transport.send_notification(peer, failed)
        except TransportError as exc:
            log.warning("could not tell %s that push %s failed (%s): releasing now", peer, transfer, exc)
            self.ledger.fail(transfer, generation, reason)

    def _poll_pushes(self) -> None:
        still = []
        for push in self._pushes:
            status = self.transport.poll(push.handle)
            if status is XferStatus.PENDING:
                still.append(push)
                continue
            stats = self.transport.stats(push.handle)
            if status is XferStatus.DONE:
                if stats is not None:
                    self.ledger.observe_transfer(
                        push.transfer,
                        t_post_s=stats.t_post_s,
                        t_xfer_s=stats.t_xfer_s,
                        nbytes=stats.bytes,
                        descriptors=stats.desc_count,
                        backend=stats.backend,
                        ok=True,
                    )
                self.ledger.consumer_done(push.transfer, push.generation, push.note.part)
            else:
                err = self.transport.error(push.handle)
                self._push_failed(push.transfer, push.generation, push.peer, push.note, f"write failed: {err}")
            self.transport.release(push.handle)
        self._pushes = still

    def _drain(self) -> None:
        notes = list(self.transport.notifications())
        if self.fast_transport is not None:  # D's reads through the fast path notify there, after their event
            notes += self.fast_transport.notifications()
        for _sender, note in notes:
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
            if note.kind == "done":
                self.ledger.consumer_done(note.transfer, note.generation, note.part)
            else:
                self.ledger.fail(note.transfer, note.generation, f"consumer: {rest.decode(errors='replace')}")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                # pushes are polled tightly; pulls only wait for D's notification, so the idle rhythm serves them
                job = self._jobs.get(timeout=self.options.service_poll_s if self._pushes else self.options.idle_poll_s)
                job()
            except queue.Empty:
                pass
            except Exception:
                log.exception("producer job failed")
            try:
                if self._pushes:
                    self._poll_pushes()
                self._drain()
                self.ledger.sweep()
                if len(self.claims):
                    self.claims.prune(self._lease_is_live)
                if self._pushes_accepted:  # a push of a lease that ended is refused anyway: forget it
                    self._pushes_accepted = {k for k in self._pushes_accepted if self._lease_is_live(k[0], k[1])}
                self.ledger.commit()
            except Exception:
                log.exception("producer service step failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.server.close()
        self.ledger.commit()
