"""Producer (P) and Consumer (D): a ledger tied to a transport and a side channel.

Flow (pull, the vLLM way): P's engine allocates and prefills (``SourceLedger.allocate`` / ``prefill_done``), then
:meth:`Producer.grant` pins the blocks under a lease and publishes a :class:`GrantReply`. D reserves target blocks
(``TargetLedger.reserve``) and calls :meth:`Consumer.pull`: the load starts in D's ledger, D claims the lease with a
heartbeat, posts one READ for all regions, and its completion notification tells P (``consumer_done``); the last
consumer releases the lease. Push (the SGLang way): :meth:`Consumer.request_push` asks P to WRITE into D's blocks;
P's completion is P's ``consumer_done`` and a notification to D (``part_done``). Failures travel both ways (a
failed write tells D; a failed read tells P) and every end goes through the ledgers' one release path.

Threads: the caller (an engine's scheduler) only touches ledgers and queues. Each side runs one service thread
that claims, posts, polls, drains notifications, heartbeats, sweeps expired leases and commits the log; the
transport's own thread does the NIXL calls; the side channel has its thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    EpochTracker,
    GetMeta,
    HandshakePlan,
    MetaReply,
    negotiate,
    scale_view,
)
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sidechannel import Ack, SideChannelClient, SideChannelError, SideChannelRefused, SideChannelServer
from kvlifecycle.transport import (
    Notification,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    RemoteMismatchError,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
)

log = logging.getLogger("kvlifecycle.handoff")


# --- control messages ---------------------------------------------------------------------------------------------


class GetGrant(msgspec.Struct, frozen=True, tag=True):
    request: str


class GrantReply(msgspec.Struct, frozen=True, tag=True):
    """A published grant (what vLLM carries in ``kv_transfer_params``)."""

    request: str
    transfer: str
    generation: int
    worker: str
    block_ids: list[int]
    consumers: int
    ttl_s: float
    agent: str
    epoch: int
    tp_rank: int = 0


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    transfer: str
    generation: int
    agent: str = ""  # the consumer's agent: P binds the lease to it, so the consumer's restart releases it
    hlc: int = 0  # the sender's hybrid logical clock (0: unknown): what P records next sorts after it


class BlockMappingError(ValueError):
    """D's blocks cannot all be filled from the grant: some would be marked ready without their bytes."""


def map_blocks(target: np.ndarray, source: np.ndarray, target_split: int = 1,
               source_split: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Pair D's (target) blocks with P's (source) blocks, unit for unit: with a block-size change the bigger side's
    blocks are cut into sub-blocks in token order; when P granted more than D reserved (D already holds a prefix),
    D's blocks take P's **tail**. Refuses (:class:`BlockMappingError`) when a D block would receive nothing: it
    would become READY_FOR_ATTENTION without its bytes."""
    blocks = target.size
    if target_split > 1:  # D blocks are bigger: D sub-blocks in token order, one per P block
        target = (target[:, None] * target_split + np.arange(target_split)[None, :]).reshape(-1)[: source.size]
    if source_split > 1:  # P blocks are bigger: P sub-blocks in token order, one per D block
        source = (source[:, None] * source_split + np.arange(source_split)[None, :]).reshape(-1)[: target.size]
    n = min(target.size, source.size)
    if blocks and n < (blocks - 1) * target_split + 1:
        raise BlockMappingError(f"{blocks} target blocks but the grant fills only {n} unit(s) of "
                                f"{target_split} per block: the rest would be marked ready without bytes")
    return target[:n], source[-n:] if source.size > n else source


class PushRequest(msgspec.Struct, frozen=True, tag=True):
    """D → P: write the granted blocks into mine (``blocks``), then notify ``target_request`` part ``part``."""

    transfer: str
    generation: int
    agent: str
    epoch: int
    blocks: list[int]
    target_request: str
    part: int = 0


class LoadFailed(msgspec.Struct, frozen=True, tag=True):
    """D → P: my read of this grant failed; release it now rather than at lease expiry."""

    transfer: str
    generation: int
    reason: str
    hlc: int = 0


REPLY_TYPES = (MetaReply, GrantReply)


@dataclass(frozen=True, slots=True)
class HandoffOptions:
    secret: bytes | None = None
    host: str = "127.0.0.1"
    port: int = 0
    service_poll_s: float = 0.0005  # while transfers are in flight
    idle_poll_s: float = 0.005  # nothing in flight: sweep leases and commit the log at this rhythm
    request_timeout_s: float = 5.0
    load_timeout_s: float = 60.0
    heartbeat_every_s: float | None = None  # default: a sixth of the grant's TTL (vLLM's rhythm)
    unit_bytes: int = 0  # head_size × dtype bytes, for heterogeneous TP views (0: views are already in bytes)
    probe: bool = True  # move a small test payload at connect time and record its bandwidth
    probe_floor_gbps: float = 0.2  # warn below this: a silent slow path is never silent
    on_connect: Callable[[PeerLink, ProbeResult | None], None] | None = None  # e.g. transports.select / OTel
    # a load that never started (claim refused: P's lease was already gone): the engine learns it here — the
    # ledger has no load to fail, the reservation was cancelled (policy "fail") or kept for recompute
    on_abandoned: Callable[[str, str], None] | None = None


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
        options: HandoffOptions = HandoffOptions(),
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
            negotiate(msg.compat, self.compat, d_rank=msg.tp_rank)
        except CompatMismatchError as exc:
            raise SideChannelRefused("compat", str(exc)) from exc
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

    def _on_heartbeat(self, msg: Heartbeat, _peer: bytes) -> Ack:
        if msg.hlc:
            self.ledger.hlc.observe(msg.hlc)
        ok = self.ledger.heartbeat(msg.transfer, msg.generation, peer=msg.agent)
        expect = getattr(self.transport, "expect_activity", None)
        if ok and expect is not None:  # a claim precedes a read: let the data plane poll tightly meanwhile
            expect(1.0)
        return Ack(ok, "" if ok else "lease is gone (released, expired or stale)")

    def _on_load_failed(self, msg: LoadFailed, _peer: bytes) -> Ack:
        if msg.hlc:  # D settled its load before telling us: our release must sort after that
            self.ledger.hlc.observe(msg.hlc)
        return Ack(self.ledger.fail(msg.transfer, msg.generation, f"consumer: {msg.reason}"))

    def _on_push(self, msg: PushRequest, _peer: bytes) -> Ack:
        lease = self.ledger.leases.get(msg.transfer)
        plan = self._push_plans.get((msg.agent, msg.epoch))
        if lease is None or plan is None:
            why = self._push_refusals.get((msg.agent, msg.epoch), "handshake with push metadata first")
            return Ack(False, "no live lease" if lease is None else f"push unavailable: {why}")
        if not self.ledger.heartbeat(msg.transfer, msg.generation):  # claim before the write
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
            hlc=self.ledger.hlc.tick(),
        )
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
                note, kind="failed", payload=reason.encode()[:512], hlc=self.ledger.hlc.tick()
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
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            if note.kind == "done":
                self.ledger.consumer_done(note.transfer, note.generation, note.part)
            elif note.kind == "failed":
                self.ledger.fail(note.transfer, note.generation, f"consumer: {note.payload.decode(errors='replace')}")

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
                self.ledger.commit()
            except Exception:
                log.exception("producer service step failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.server.close()
        self.ledger.commit()


# --- Consumer -----------------------------------------------------------------------------------------------------


def _noop() -> None:
    pass


@dataclass(slots=True)
class PeerLink:
    """D's view of one P rank after a handshake."""

    address: str
    agent: str
    epoch: int
    plan: HandshakePlan
    prepared: PreparedPlan  # the descriptor lists for this P rank's read
    client: SideChannelClient
    probe: ProbeResult | None = None
    data: Transport | None = None  # the transport that moves this link's bytes (None: the Consumer's own)
    data_peer: str = ""  # P's name on ``data`` ("" : ``agent``)
    choice: Any = None  # why ``data`` was chosen and what its self-test measured (cuda_ipc.Choice)


@dataclass(slots=True)
class _Load:
    request: str
    transfer: str  # D ledger's transfer id
    mode: str  # pull | push
    parts: list[tuple[PeerLink, GrantReply, int]]  # (link, grant, part index)
    started: float
    handles: dict[int, TransferHandle] = field(default_factory=dict)  # part -> handle
    via: dict[int, Transport] = field(default_factory=dict)  # part -> the transport that owns its handle
    done: set[int] = field(default_factory=set)
    last_beat: float = 0.0
    failed: bool = False
    claimed: int = 0
    live: bool = False  # claimed and started in the ledger


class Consumer:
    """D side: handshakes with P ranks, pulls (or asks for pushes), heartbeats leases, settles its ledger."""

    def __init__(
        self,
        ledger: TargetLedger,
        transport: Transport,
        compat: CompatInfo,
        *,
        tp_rank: int = 0,
        options: HandoffOptions = HandoffOptions(),
        fast_transport: Transport | None = None,
    ) -> None:
        """``fast_transport``: a same-node fast path (CUDA IPC) registered over the same KV regions as
        ``transport``. At connect, :func:`kvlifecycle.transports.cuda_ipc.select_same_node` picks it for a P rank
        that offers it when both sides hold VRAM on one node and the self-test passes; ``transport`` (NIXL) stays
        the fallback and carries pushes."""
        self.ledger, self.transport, self.compat, self.tp_rank = ledger, transport, compat, tp_rank
        self.fast_transport = fast_transport
        self.options = options
        self.links: dict[str, PeerLink] = {}
        self.epochs = EpochTracker()
        self._loads: dict[str, _Load] = {}
        self._by_p_transfer: dict[str, str] = {}
        self.abandoned: dict[str, str] = {}  # request -> why its load never started (claim refused, ...)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified whenever a load leaves ``_loads``
        self._stop = threading.Event()
        self._wakeful = False
        add_listener = getattr(transport, "add_completion_listener", None)
        if add_listener is not None:  # the transport wakes us when a transfer settles: no tight polling needed
            add_listener(lambda _handle: self._jobs.put(_noop))
            # a fast path without listeners completes only when polled: keep the tight rhythm then
            self._wakeful = fast_transport is None or hasattr(fast_transport, "add_completion_listener")
        self._thread = threading.Thread(target=self._serve, name=f"consumer-{transport.agent}", daemon=True)
        self._thread.start()

    # -- handshake --------------------------------------------------------------------------------------------------
    def connect(self, address: str, *, push: bool = True) -> PeerLink:
        """Handshake with the P rank at ``address`` (compat check, epochs, metadata both ways, prepared plans).

        Raises :class:`CompatMismatchError` (field by field) or :class:`SideChannelRefused`."""
        with self._lock:
            old = self.links.get(address)
            client = (
                old.client
                if old is not None
                else SideChannelClient(
                    address, REPLY_TYPES, secret=self.options.secret, timeout_s=self.options.request_timeout_s
                )
            )
        me: PeerMetadata | None = self.transport.local_metadata() if push else None
        try:
            reply: MetaReply = client.request(
                GetMeta(self.compat, self.tp_rank, self.transport.agent, self.transport.epoch, me)
            )
        except SideChannelRefused as exc:
            if old is None:
                client.close()
            if exc.code == "compat":
                raise CompatMismatchError(exc.message, []) from exc
            raise
        plan = negotiate(self.compat, reply.compat, d_rank=self.tp_rank)  # D refuses too, field by field
        change = self.epochs.observe(address, reply.meta.epoch)
        if change.kind == "stale":
            raise SideChannelRefused("stale_epoch", f"{address}: epoch {reply.meta.epoch} < {change.previous}")
        if change.kind == "restarted":
            self._peer_restarted(reply.meta.agent, reply.meta.epoch)
        self.ledger.peer_restarted(reply.meta.agent, reply.meta.epoch)  # records new epochs; fails stale loads
        agent = self.transport.add_peer(reply.meta)  # a new epoch: old agent removed first (vLLM #49238)
        reads = [r for r in plan.reads if r.p_rank == reply.tp_rank]
        if not reads:
            raise CompatMismatchError(
                f"D rank {self.tp_rank} reads P ranks {[r.p_rank for r in plan.reads]}, not {reply.tp_rank}", []
            )
        read, unit = reads[0], self.options.unit_bytes
        prepared = self.transport.prepare(
            agent,
            local_view=scale_view(read.local_view, unit) if unit else read.local_view,
            remote_view=scale_view(read.remote_view, unit) if unit else read.remote_view,
        )
        link = PeerLink(address, agent, reply.meta.epoch, plan, prepared, client)
        self._select_data_path(link, reply, read, unit)
        with self._lock:
            self.links[address] = link
        probe = self._probe(link) if self.options.probe else None
        if self.options.on_connect is not None:
            self.options.on_connect(link, probe)
        return link

    def _select_data_path(self, link: PeerLink, reply: MetaReply, read: Any, unit: int) -> None:
        """Same node, VRAM on both sides, the self-test passed: reads go through the fast path (CUDA IPC); else
        they stay on ``transport`` (NIXL). The choice is logged and reported to the selection listeners by
        ``select_same_node``; ``link.choice`` keeps it."""
        fast = self.fast_transport
        if fast is None or getattr(fast, "layout", None) is None:
            return
        from kvlifecycle.transports.cuda_ipc import select_same_node  # lazily: the core imports no transport

        chosen, peer, choice = select_same_node(
            fast.layout,
            fast,
            reply.fast_meta,  # type: ignore[arg-type]
            lambda: self.transport,
            fallback_name=self.transport.name,
        )
        link.choice = choice
        if chosen is self.transport:
            return
        try:
            link.prepared = chosen.prepare(
                peer,
                local_view=scale_view(read.local_view, unit) if unit else read.local_view,
                remote_view=scale_view(read.remote_view, unit) if unit else read.remote_view,
            )
        except TransportError as exc:  # a view the fast path cannot express: NIXL's plan stays
            log.info("fast path to %s not used: %s", link.agent, exc)
            return
        link.data, link.data_peer = chosen, peer

    def _probe(self, link: PeerLink) -> ProbeResult | None:
        try:
            result = (link.data or self.transport).probe(link.data_peer or link.agent)
        except (TransportError, AttributeError) as exc:
            log.info("no connect-time probe of %s: %s", link.agent, exc)
            return None
        link.probe = result
        self.ledger.observe_transfer(
            f"probe:{link.agent}",
            t_post_s=0.0,
            t_xfer_s=result.seconds,
            nbytes=result.bytes,
            descriptors=1,
            backend=result.backend,
            ok=True,
        )
        if result.gbps < self.options.probe_floor_gbps:
            log.warning(
                "slow path to %s: %.3f GB/s over %s is below the floor of %.3f GB/s",
                link.agent,
                result.gbps,
                result.backend,
                self.options.probe_floor_gbps,
            )
        return result

    def _peer_restarted(self, agent: str, epoch: int) -> None:
        with self._lock:
            for load in self._loads.values():
                if any(link.agent == agent and link.epoch < epoch for link, _, _ in load.parts):
                    load.failed = True

    def invalidate_peer(self, agent: str, epoch: int, reason: str = "peer lost", *,
                        timeout_s: float = 10.0) -> list[str]:
        """The control plane declared P agent ``agent`` gone up to ``epoch`` (its etcd lease expired, or its key was
        deleted): at once, its loads fail per the ledger's failure policy, its links and transport peer are dropped,
        and whatever it still sends (late notifications) matches no load and is ignored. The other P ranks of a
        failed multi-part load are told (``LoadFailed``); the lost one is not waited for. Runs on the service thread;
        returns the D transfer ids it failed. A later :meth:`connect` to a new incarnation works as usual. Never call
        it from the service thread (an ``on_abandoned`` hook): it waits for that thread."""
        done: queue.SimpleQueue[list[str]] = queue.SimpleQueue()

        def lost(link: PeerLink) -> bool:
            return link.agent == agent and link.epoch <= epoch

        def job() -> None:  # loads started before this job have been launched (claimed, live) or abandoned
            with self._lock:
                loads = [ld for ld in self._loads.values() if ld.live and any(lost(lk) for lk, _, _ in ld.parts)]
                links = [self.links.pop(addr) for addr in [a for a, lk in self.links.items() if lost(lk)]]
                for load in loads:
                    load.failed = True
                    self._loads.pop(load.transfer, None)
                self._settled.notify_all()
            why = f"{reason}: {agent} epoch {epoch}"
            for load in loads:
                for part, handle in load.handles.items():
                    with contextlib.suppress(TransportError):
                        load.via.get(part, self.transport).release(handle)
                if load.transfer in self.ledger.loads:
                    self.ledger.fail(load.transfer, why)
                for link, grant, _ in load.parts:  # the other P ranks of a multi-part load release now
                    if not lost(link):
                        with contextlib.suppress(SideChannelError):
                            link.client.request(LoadFailed(grant.transfer, grant.generation, why,
                                                           self.ledger.hlc.tick()), timeout_s=1.0)
            for link in links:
                for data, peer in {(self.transport, link.agent), (link.data or self.transport,
                                                                   link.data_peer or link.agent)}:
                    try:
                        data.remove_peer(peer)
                    except TransportError as exc:
                        log.info("removing lost peer %s from %s: %s", agent, data.name, exc)
            # a load started meanwhile still holds a link: its launch (queued behind this job) runs before the close
            self._jobs.put(lambda: [link.client.close() for link in links])
            log.warning("peer %s (epoch <= %d) invalidated (%s): %d load(s) failed, %d link(s) dropped",
                        agent, epoch, reason, len(loads), len(links))
            done.put([load.transfer for load in loads])

        self._jobs.put(job)
        try:
            return done.get(timeout=timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(f"invalidating {agent} did not finish in {timeout_s}s") from exc

    def fetch_grant(self, address: str, request: str) -> GrantReply:
        """Ask P for a published grant (engines usually carry it in the request instead)."""
        link = self.links[address]
        return link.client.request(GetGrant(request))

    # -- loads ------------------------------------------------------------------------------------------------------
    def pull(
        self, request: str, grants: Sequence[tuple[str, GrantReply]] | GrantReply, *, address: str | None = None
    ) -> str:
        """Start loading ``request`` (already reserved) by READs of each (P address, grant). Returns D's transfer
        id. Non-blocking: the claim and the post happen on the service thread."""
        return self._start(request, grants, address, "pull")

    def request_push(self, request: str, grant: GrantReply, *, address: str) -> str:
        """Ask P to WRITE the granted blocks into ``request``'s reserved blocks. Non-blocking."""
        return self._start(request, grant, address, "push")

    def _start(self, request: str, grants: Any, address: str | None, mode: str) -> str:
        pairs = [(address, grants)] if isinstance(grants, GrantReply) else list(grants)
        parts = [(self.links[addr], grant, i) for i, (addr, grant) in enumerate(pairs)]
        if len(parts) != parts[0][0].plan.parts:
            raise ValueError(f"this D rank reads {parts[0][0].plan.parts} P rank(s); got {len(parts)} grant(s)")
        if mode == "push" and len(parts) != 1:
            raise ValueError("push supports one P rank with equal layouts")
        transfer = pairs[0][1].transfer if len(pairs) == 1 else f"{request}<-" + "+".join(g.transfer for _, g in pairs)
        if request not in self.ledger.requests:
            raise KeyError(f"request {request!r} is not reserved in the target ledger")
        load = _Load(request, transfer, mode, parts, time.monotonic(), last_beat=time.monotonic())
        with self._lock:
            self._loads[transfer] = load
            for _, grant, _ in parts:
                self._by_p_transfer[grant.transfer] = transfer
        self._jobs.put(lambda: self._launch(load))
        return transfer

    def _consumer_index(self, link: PeerLink) -> int:
        # D TP > P TP: D ranks sharing one P rank count as consumers 0..r-1 of P's lease
        return self.tp_rank % link.plan.consumers_per_p_rank

    def _launch(self, load: _Load) -> None:
        """Claim every lease first; only then does the load start in D's ledger (so D never loads a transfer P
        already released), then post the reads or ask for the push."""
        req = self.ledger.requests.get(load.request)
        if req is None:
            self._abandon(load, "request no longer reserved")
            return
        blocks = req.blocks
        mapped = {}
        for link, grant, part in load.parts:  # before any claim: a load that cannot fill every block never starts
            try:
                mapped[part] = self._map_blocks(blocks, np.asarray(grant.block_ids, dtype=np.int32), link)
            except BlockMappingError as exc:
                self._abandon(load, str(exc), hand_back_all=True)  # P's lease is of no use: release it now
                return
        for link, grant, _ in load.parts:
            try:
                # claim first: the claim binds the lease to this agent
                beat = link.client.request(
                    Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick())
                )
            except SideChannelError as exc:
                self._abandon(load, f"claim failed: {exc}")
                return
            if not beat.ok:
                self._abandon(load, f"lease refused: {beat.detail}")
                return
            load.claimed += 1
        # One ledger step: start_load gates the posts at once, and its record joins the log after the launch.
        with self.ledger.step():
            self._start_and_post(load, blocks, mapped)

    def _start_and_post(self, load: _Load, blocks: np.ndarray,
                        mapped: dict[int, tuple[np.ndarray, np.ndarray]]) -> None:
        first = load.parts[0]
        try:
            self.ledger.start_load(
                load.request,
                load.transfer,
                parts=len(load.parts),
                generation=first[1].generation,
                peer=first[0].agent,
                peer_epoch=first[0].epoch,
                mode=load.mode,
            )
        except Exception as exc:  # e.g. the peer restarted meanwhile (stale peer epoch): refused and recorded
            self._abandon(load, f"start_load refused: {exc}")
            return
        load.live = True
        for link, grant, part in load.parts:
            if load.mode == "push":
                try:
                    ack = link.client.request(
                        PushRequest(
                            grant.transfer,
                            grant.generation,
                            self.transport.agent,
                            self.transport.epoch,
                            blocks.tolist(),
                            load.request,
                            part,
                        )
                    )
                except SideChannelError as exc:
                    self._fail(load, f"push request failed: {exc}")
                    return
                if not ack.ok:
                    self._fail(load, f"push refused: {ack.detail}")
                    return
                continue
            prepared = link.prepared
            data = link.data or self.transport
            local, remote = mapped[part]
            note = Notification(
                grant.request,
                grant.transfer,
                grant.generation,
                data.epoch,
                "done",
                self._consumer_index(link),
                hlc=self.ledger.hlc.tick(),
            )
            try:
                load.handles[part] = data.post(
                    XferOp.READ, prepared, local, remote, notification=note, transfer=grant.transfer
                )
                load.via[part] = data
            except (TransportError, ValueError) as exc:
                self._fail(load, f"post failed: {exc}")
                return
        load.last_beat = time.monotonic()

    @staticmethod
    def _map_blocks(local: np.ndarray, remote: np.ndarray, link: PeerLink) -> tuple[np.ndarray, np.ndarray]:
        return map_blocks(local, remote, link.plan.local_split, link.plan.remote_split)

    def _abandon(self, load: _Load, reason: str, *, hand_back_all: bool = False) -> None:
        """The load could not start (a claim was refused or failed, or the grant cannot fill D's blocks): the
        reservation goes back, per policy, and the leases already claimed (``hand_back_all``: every lease) are
        handed back to P."""
        log.warning("load %s of %s not started: %s", load.transfer, load.request, reason)
        load.failed = True
        with self._lock:
            self._loads.pop(load.transfer, None)
            for _, grant, _ in load.parts:
                self._by_p_transfer.pop(grant.transfer, None)
            self.abandoned[load.request] = reason
            self._settled.notify_all()
        if self.ledger.failure_policy == "fail" and load.request in self.ledger.requests:
            self.ledger.cancel(load.request)  # RESERVED → FREE; policy recompute keeps the blocks for local prefill
        if self.options.on_abandoned is not None:
            try:
                self.options.on_abandoned(load.request, reason)
            except Exception:
                log.exception("on_abandoned hook failed")
        for link, grant, _ in load.parts if hand_back_all else load.parts[: load.claimed]:
            try:
                link.client.request(
                    LoadFailed(grant.transfer, grant.generation, reason, self.ledger.hlc.tick()), timeout_s=1.0
                )
            except SideChannelError as exc:
                log.info("could not hand %s back to %s: %s", grant.transfer, link.address, exc)

    def _fail(self, load: _Load, reason: str) -> None:
        if load.failed and load.transfer not in self._loads:
            return
        load.failed = True
        with self._lock:
            self._loads.pop(load.transfer, None)
            self._settled.notify_all()
        for part, handle in load.handles.items():
            with contextlib.suppress(TransportError):
                load.via.get(part, self.transport).release(handle)
        if load.transfer in self.ledger.loads:
            self.ledger.fail(load.transfer, reason)
        for link, grant, _ in load.parts:  # tell P now rather than at lease expiry
            try:
                link.client.request(
                    LoadFailed(grant.transfer, grant.generation, reason, self.ledger.hlc.tick()), timeout_s=1.0
                )
            except SideChannelError as exc:
                log.info("could not tell %s that %s failed: %s", link.address, grant.transfer, exc)

    # -- service thread ---------------------------------------------------------------------------------------------
    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            loads = list(self._loads.values())
        for load in loads:
            if load.failed and load.live:
                self._fail(load, "peer restarted (new agent epoch)")
                continue
            if not load.live:
                continue
            for part, handle in list(load.handles.items()):
                data = load.via.get(part, self.transport)
                status = data.poll(handle)
                if status is XferStatus.PENDING:
                    continue
                if status is XferStatus.FAILED:
                    self._fail(load, f"read failed: {data.error(handle)}")
                    break
                # The blocks become visible first; metrics and the handle's release (which may send the copy's
                # notification to P) change no block state and follow, off the request's latency path.
                del load.handles[part]
                self._part_done(load, part)
                stats = data.stats(handle)
                if stats is not None:
                    self.ledger.observe_transfer(
                        load.transfer,
                        t_post_s=stats.t_post_s,
                        t_xfer_s=stats.t_xfer_s,
                        nbytes=stats.bytes,
                        descriptors=stats.desc_count,
                        backend=stats.backend,
                        ok=True,
                    )
                data.release(handle)
            if load.transfer in self._loads and now - load.started > self.options.load_timeout_s:
                self._fail(load, f"load timed out after {self.options.load_timeout_s}s")
            elif load.transfer in self._loads and load.live:
                self._heartbeat(load, now)
        notes = list(self.transport.notifications())
        if self.fast_transport is not None:  # also sends the notifications of reads that completed meanwhile
            notes += self.fast_transport.notifications()
        for _sender, note in notes:  # push completions / failures from P
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            transfer = self._by_p_transfer.get(note.transfer)
            load = self._loads.get(transfer) if transfer else None
            if load is None:
                continue
            if note.kind == "done":
                self._part_done(load, note.part)
            elif note.kind == "failed":
                self._fail(load, f"producer: {note.payload.decode(errors='replace')}")

    def _heartbeat(self, load: _Load, now: float) -> None:
        ttl = min(g.ttl_s for _, g, _ in load.parts)
        every = self.options.heartbeat_every_s or ttl / 6
        if now - load.last_beat < every:
            return
        load.last_beat = now
        for link, grant, _ in load.parts:
            try:
                beat = link.client.request(
                    Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick()),
                    timeout_s=every,
                )
            except SideChannelError as exc:
                log.info("heartbeat to %s failed: %s", link.address, exc)
                continue
            if not beat.ok:
                self._fail(load, f"lease lost: {beat.detail}")
                return

    def _part_done(self, load: _Load, part: int) -> None:
        if part in load.done:
            return
        load.done.add(part)
        self.ledger.part_done(load.transfer, part)
        if len(load.done) == len(load.parts):
            with self._lock:
                self._loads.pop(load.transfer, None)
                for _, grant, _ in load.parts:
                    self._by_p_transfer.pop(grant.transfer, None)
                self._settled.notify_all()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                busy = self._loads and not self._wakeful
                poll = self.options.service_poll_s if busy else self.options.idle_poll_s
                job = self._jobs.get(timeout=poll)
                job()
            except queue.Empty:
                pass
            except Exception:
                log.exception("consumer job failed")
            try:
                self._step()
                self.ledger.commit()
            except Exception:
                log.exception("consumer service step failed")

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block (bounded, without spinning) until no load is pending."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._loads, timeout=timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for link in self.links.values():
            link.client.close()
        self.ledger.commit()
