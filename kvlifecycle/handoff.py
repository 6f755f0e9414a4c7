"""Producer (P) and Consumer (D): a ledger tied to a transport and a side channel. This module holds the Consumer
(the options both sides take are in :mod:`kvlifecycle.handoff_options`, their block pairing in
:mod:`kvlifecycle.block_mapping`); the Producer is in :mod:`kvlifecycle.producer` (importable
from here too), the control messages in :mod:`kvlifecycle.control`, the claim tokens in :mod:`kvlifecycle.claims`,
D's messages about a grant before its claim in :mod:`kvlifecycle.unclaimed`. The two send and serve every
side-channel message: an engine's adapter calls them and reads the ledgers' events, nothing below.
One concept, longer than most: D's side of the handoff (handshake, claims, loads, heartbeats, its service
thread), which shares one lock and one table of peer links.

Flow (pull, the vLLM way): P's engine allocates and prefills (``SourceLedger.allocate`` / ``prefill_done``), then
:meth:`Producer.grant` pins the blocks under a lease and publishes a :class:`GrantReply`. D reserves target blocks
(``TargetLedger.reserve``) and calls :meth:`Consumer.pull`: D claims the lease with a heartbeat (P answers with a
per-claim token, :mod:`kvlifecycle.claims`), the load starts in D's ledger, D posts one READ for all regions, and
its completion notification (carrying the token) tells P (``consumer_done``); the last consumer releases the
lease. Renewals, failures and push requests carry the token too: only the claimant ends its claim. Push (the SGLang
way): :meth:`Consumer.request_push` asks P to WRITE into D's blocks; P's completion is P's ``consumer_done`` and a
notification to D (``part_done``), which D takes only with its claim's token. Failures travel both ways (a failed
write tells D; a failed read tells P) and every end goes through the ledgers' one release path.

Threads: the caller (an engine's scheduler) only touches ledgers and queues. Each side runs one service thread
that claims, posts, polls, drains notifications, heartbeats, sweeps expired leases and commits the log; the
transport's own thread does the NIXL calls; the side channel has its thread.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvlifecycle.block_mapping import BlockMappingError, map_blocks
from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.clock import StepTimer
from kvlifecycle.control import REPLY_TYPES as _CONTROL_REPLIES
from kvlifecycle.control import Claimed, GetGrant, GrantReply, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.handoff_options import HandoffOptions
from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    EpochTracker,
    GetMeta,
    HandshakePlan,
    MalformedHandshakeError,
    MetaReply,
    check_meta_reply,
    negotiate,
    scale_view,
)
from kvlifecycle.ledger import TargetLedger
from kvlifecycle.path_selection import PRIMARY_PATH, PathChoice, PathSelector
from kvlifecycle.producer import Producer
from kvlifecycle.protocol import consumer as rules  # D's decisions, shared with the simulator
from kvlifecycle.protocol.launch import LoadLaunch, beat_every
from kvlifecycle.sidechannel import Ack, SideChannelClient, SideChannelError, SideChannelRefused
from kvlifecycle.transport import (
    Notification,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
)
from kvlifecycle.unclaimed import UnclaimedGrants
from kvlifecycle.untrusted import RateLimitedLog, check_msgpack

__all__ = [  # the handoff's public names, wherever they are defined (Producer: kvlifecycle.producer)
    "REPLY_TYPES",
    "Ack",
    "BlockMappingError",
    "Claimed",
    "Consumer",
    "GetGrant",
    "GrantReply",
    "HandoffOptions",
    "Heartbeat",
    "LoadFailed",
    "PeerLink",
    "Producer",
    "PushRequest",
    "SideChannelError",  # what the Consumer's calls raise when P does not answer, or refuses (SideChannelRefused)
    "SideChannelRefused",
    "compat_fields",
    "map_blocks",
]

log = logging.getLogger("kvlifecycle.handoff")


REPLY_TYPES = (MetaReply, *_CONTROL_REPLIES)

_Scalar = str | int | float | bool | None
_fields_decoder = msgspec.msgpack.Decoder(list[tuple[str, _Scalar, _Scalar]])


def compat_fields(detail: bytes) -> list[tuple[str, object, object]]:
    """The (field, D's value, P's value) list P attached to its compat refusal; [] if it attached none usable."""
    try:
        check_msgpack(detail, max_depth=3)
        return [(name, mine, theirs) for name, mine, theirs in _fields_decoder.decode(detail)]
    except Exception:  # an older or hostile peer: the message still says what differs
        return []


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
    choice: PathChoice | None = None  # why ``data`` was chosen and what its self-test measured


@dataclass(slots=True)
class _Load(LoadLaunch):  # its launch, progress and duties are the protocol core's, shared with the simulator
    request: str
    transfer: str  # D ledger's transfer id
    mode: str  # pull | push
    parts: list[tuple[PeerLink, GrantReply, int]]  # (link, grant, part index)
    handles: dict[int, TransferHandle] = field(default_factory=dict)  # part -> handle
    via: dict[int, Transport] = field(default_factory=dict)  # part -> the transport that owns its handle
    tokens: dict[int, bytes] = field(default_factory=dict)  # part -> P's claim token for it


class Consumer:
    """D side: fetches grants and holds them until their claim, handshakes with P ranks, pulls (or asks for
    pushes), heartbeats leases, settles its ledger."""

    def __init__(
        self,
        ledger: TargetLedger,
        transport: Transport,
        compat: CompatInfo,
        *,
        tp_rank: int = 0,
        options: HandoffOptions = HandoffOptions(),
        fast_transport: Transport | None = None,
        path_selector: PathSelector = PRIMARY_PATH,
    ) -> None:
        """``fast_transport``: a same-node fast path (CUDA IPC) registered over the same KV regions as
        ``transport``. At connect, ``path_selector`` picks the path of each P rank's reads (the transports'
        ``SameNodeSelector``: the fast path when both sides hold VRAM on one node and the self-test passes); the
        default keeps every read on ``transport``. For pushes the fast path's metadata goes to P in the handshake,
        whose own path selector picks where its writes go; their notifications are drained from both transports."""
        self.ledger, self.transport, self.compat, self.tp_rank = ledger, transport, compat, tp_rank
        self.fast_transport = fast_transport
        self.path_selector = path_selector
        self.options = options
        self.links: dict[str, PeerLink] = {}
        self.epochs = EpochTracker()
        self._loads: dict[str, _Load] = {}
        self._by_p_transfer: dict[str, str] = {}
        self.abandoned: dict[str, str] = {}  # request -> why its load never started (claim refused, ...)
        self.forged_notifications = 0  # push completions / failures that lacked the load's claim token
        # (sender, note) -> None for the notes no load of this Consumer names (a layer-wise stream's), in order
        self.note_sinks: list[Callable[[str, Notification], None]] = []
        self._log_forged = RateLimitedLog(log)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified whenever a load leaves ``_loads``
        self._stop = threading.Event()
        self._unclaimed = UnclaimedGrants(secret=options.secret, timeout_s=options.request_timeout_s)
        self._wakeful = False
        # while any of these says so, the service loop polls at its busy rhythm whatever the transports' wake-ups
        # (a stream's notes arriving on a fast path that wakes nobody)
        self.poll_fast_while: list[Callable[[], bool]] = []
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
        steps = StepTimer()
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
        fast_me = self._fast_meta() if push else None  # P's path selector may pick it for its writes
        try:
            reply: MetaReply = client.request(
                GetMeta(self.compat, self.tp_rank, self.transport.agent, self.transport.epoch, me, fast_me)
            )
            steps.lap("get_meta")
        except SideChannelRefused as exc:
            if old is None:
                client.close()
            if exc.code == "compat":
                raise CompatMismatchError(exc.message, compat_fields(exc.detail)) from exc
            raise
        try:
            check_meta_reply(reply, address)
        except MalformedHandshakeError as exc:
            if old is None:
                client.close()
            raise SideChannelRefused("malformed", str(exc)) from exc
        plan = negotiate(self.compat, reply.compat, d_rank=self.tp_rank)  # D refuses too, field by field
        change = self.epochs.observe(address, reply.meta.epoch)
        if change.kind == "stale":
            raise SideChannelRefused("stale_epoch", f"{address}: epoch {reply.meta.epoch} < {change.previous}")
        if change.kind == "restarted":
            self._peer_restarted(reply.meta.agent, reply.meta.epoch)
        self.ledger.peer_restarted(reply.meta.agent, reply.meta.epoch)  # records new epochs; fails stale loads
        agent = self.transport.add_peer(reply.meta)  # a new epoch: old agent removed first (vLLM #49238)
        steps.lap("add_peer")
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
        steps.lap("prepare")
        link = PeerLink(address, agent, reply.meta.epoch, plan, prepared, client)
        self._select_data_path(link, reply, read, unit)
        steps.lap("select")
        with self._lock:
            self.links[address] = link
        probe = self._probe(link) if self.options.probe else None
        steps.lap("probe")
        total, laps = steps.summary()  # a slow handshake names its slow step, not just its total
        log.log(logging.WARNING if total >= self.options.request_timeout_s / 6 else logging.INFO,
                "handshake with %s (%s) took %.3f s: %s", address, agent, total, laps)
        if self.options.on_connect is not None:
            self.options.on_connect(link, probe)
        return link

    def _fast_meta(self) -> PeerMetadata | None:
        if self.fast_transport is None:
            return None
        try:
            return self.fast_transport.local_metadata()
        except TransportError as exc:  # not registered, or closed: P writes through NIXL
            log.info("no fast-path metadata offered for pushes: %s", exc)
            return None

    def _select_data_path(self, link: PeerLink, reply: MetaReply, read: Any, unit: int) -> None:
        """Ask the path selector where this P rank's reads go; ``link.choice`` keeps why (the selector logs it)."""
        path = self.path_selector.select(self.transport, self.fast_transport, reply.fast_meta)
        link.choice = path.choice
        chosen, peer = path.transport, path.peer
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
                for link, grant, part in load.parts:  # the other P ranks of a multi-part load release now
                    if not lost(link):
                        with contextlib.suppress(SideChannelError):
                            self._load_failed(load, link, grant, part, why)
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

    # -- before the claim (the engine's thread): grants held while blocks are reserved -------------------------------
    def fetch_grant(self, address: str, request: str, *, wait_s: float = 0.0) -> GrantReply:
        """The grant the P rank at ``address`` published for its request ``request``. P may publish it after D
        asks (vLLM: one scheduler step after the request finished), so an ``unknown_request`` refusal is asked
        again, with backoff, for up to ``wait_s``. Needs no handshake. Raises :class:`SideChannelRefused`
        (``unknown_request`` once ``wait_s`` is spent) or :class:`SideChannelError` (P did not answer)."""
        return self._unclaimed.fetch(address, request, wait_s=wait_s)

    def keep_alive(self, address: str, grant: GrantReply, *, timeout_s: float = 1.0) -> Ack:
        """Renew ``grant``'s lease on the P rank at ``address`` while nobody has claimed it (the engine is still
        reserving blocks; the claim of :meth:`pull` takes over). ``ok`` False: the lease is gone, ``detail`` says
        why. Raises :class:`SideChannelError` when P does not answer within ``timeout_s``."""
        return self._unclaimed.keep_alive(address, grant, timeout_s=timeout_s)

    def hand_back(self, grants: Sequence[tuple[str, GrantReply]], reason: str, *, consumer: int) -> None:
        """Tell each (P address, grant) that this D rank will read nothing of it (not needed, or its load failed
        before it started), so that P releases now rather than at lease expiry. ``consumer``: this D rank's index
        among the lease's consumers (a lease read by several D ranks is released once all of them settled). A P
        rank that does not answer is logged and left to its lease's expiry."""
        for address, grant in grants:
            try:
                self._unclaimed.hand_back(address, grant, reason, consumer=consumer, timeout_s=1.0)
            except SideChannelError as exc:
                log.info("could not tell %s that %s failed: %s", address, grant.transfer, exc)

    def fail_unstarted(self, request: str, grants: Sequence[tuple[str, GrantReply]], reason: str, *,
                       consumer: int) -> None:
        """A load of ``request`` that never started (no grant, handshake refused, a grant for another D TP size):
        the ledger records a failed load, so that the failure policy applies, and every grant fetched is handed
        back (:meth:`hand_back`). A load the ledger already started fails as it is; otherwise, since no byte was
        ever requested, a load of D's own id (``<grant transfer>/refused-by-d``, not the grant's) starts and
        fails, so that D's log never shows a read of P's transfer that did not happen."""
        req = self.ledger.requests.get(request)
        first = grants[0][1] if grants else None
        if req is not None and req.transfer is not None:
            self.ledger.fail(req.transfer, reason)
        elif req is not None:
            transfer = f"{first.transfer if first is not None else request}/refused-by-d"
            self.ledger.start_load(request, transfer, generation=first.generation if first else 0)
            self.ledger.fail(transfer, reason)
        self.hand_back(grants, reason, consumer=consumer)

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
        if mode == "push" and (len(parts) != 1 or parts[0][0].plan.consumers_per_p_rank != 1):
            # one PushRequest is one WRITE per (transfer, part): D ranks sharing a P rank's lease would collide
            raise ValueError("push after the prefill supports one P rank with equal layouts (a layer-wise stream "
                             "or pull crosses TP sizes)")
        transfer = pairs[0][1].transfer if len(pairs) == 1 else f"{request}<-" + "+".join(g.transfer for _, g in pairs)
        if request not in self.ledger.requests:
            raise KeyError(f"request {request!r} is not reserved in the target ledger")
        now = time.monotonic()
        load = _Load(request, transfer, mode, parts, started=now, last_beat=now, size=len(parts))
        with self._lock:
            self._loads[transfer] = load
            for _, grant, _ in parts:
                self._by_p_transfer[grant.transfer] = transfer
        self._jobs.put(lambda: self._launch_settled(load))
        return transfer

    def _consumer_index(self, link: PeerLink) -> int:
        # D TP > P TP: D ranks sharing one P rank count as consumers 0..r-1 of P's lease
        return self.tp_rank % link.plan.consumers_per_p_rank

    def _launch_settled(self, load: _Load) -> None:
        """Launch, and settle the load whatever goes wrong: a load left in ``_loads`` unsettled waits forever."""
        try:
            self._launch(load)
        except Exception as exc:
            log.exception("launching load %s of %s failed", load.transfer, load.request)
            reason = f"internal error: {type(exc).__name__}: {exc}"
            if load.live:
                self._fail(load, reason)
            elif load.transfer in self._loads:
                self._abandon(load, reason)

    def _launch(self, load: _Load) -> None:
        """The launch the protocol core orders (:class:`~kvlifecycle.protocol.launch.LoadLaunch`): every lease
        claimed first, then the load starts in D's ledger, then the reads are posted or the push asked for."""
        req = self.ledger.requests.get(load.request)
        step = load.begin(reserved=req is not None)
        if req is None:  # the engine gave the request up (aborted) before its load began: no lease is of use
            self._abandon(load, step.reason, hand_back_all=True)
            return
        blocks = req.blocks
        mapped = {}
        for link, grant, part in load.parts:  # before any claim: a load that cannot fill every block never starts
            try:
                mapped[part] = self._map_blocks(blocks, np.asarray(grant.block_ids, dtype=np.int32), link)
            except BlockMappingError as exc:
                self._abandon(load, str(exc), hand_back_all=True)  # P's lease is of no use: release it now
                return
        while step.action == "claim":
            link, grant, part = load.parts[step.part]
            sent = time.monotonic()
            try:
                # claim first: the claim binds the lease to this agent, and its token to this load
                beat = link.client.request(
                    Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick(),
                              consumer=self._consumer_index(link))
                )
            except SideChannelError as exc:
                step = load.claim_unanswered(str(exc))
                break
            if beat.ok:
                load.tokens[part] = getattr(beat, "token", b"")
            step = load.claim_answered(part, ok=beat.ok, detail=beat.detail, sent_at=sent, ttl_s=grant.ttl_s,
                                       reserved=True)  # a reservation cancelled meanwhile: start_load refuses
        if step.action == "abandon":
            self._abandon(load, step.reason)
            return
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
                            load.tokens.get(part, b""),
                        )
                    )
                except SideChannelError as exc:  # P may have accepted it: its write may be landing
                    self._settle_by(load, rules.on_push_unanswered(), f"push request failed: {exc}")
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
                load.tokens.get(part, b""),  # P completes only the claimant's consumer
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
        for part in load.hand_back_parts(every_lease=hand_back_all):
            link, grant, _ = load.parts[part]
            try:
                self._load_failed(load, link, grant, part, reason)
            except SideChannelError as exc:
                log.info("could not hand %s back to %s: %s", grant.transfer, link.address, exc)

    def _load_failed(self, load: _Load, link: PeerLink, grant: GrantReply, part: int, reason: str) -> Ack:
        """Tell P this part's load failed or was given up (its lease may go); raises SideChannelError."""
        return link.client.request(LoadFailed(grant.transfer, grant.generation, reason, self.ledger.hlc.tick(),
                                              load.tokens.get(part, b""), self._consumer_index(link)), timeout_s=1.0)

    def _give_up_push(self, load: _Load, reason: str) -> None:
        """D cannot tell whether P's write is landing: it hands the lease back and keeps its blocks LOADING until
        P answers — released: the load fails now; ``WRITE_IN_FLIGHT``: P cancels the write, then its ``failed``
        notification fails the load. No answer: asked again at the heartbeat rhythm."""
        load.given_up = load.given_up or reason
        for link, grant, part in load.parts:
            try:
                ack = self._load_failed(load, link, grant, part, load.given_up)
            except SideChannelError as exc:
                log.info("could not hand %s back to %s: %s", grant.transfer, link.address, exc)
                return
            if not rules.hand_back_settles(ack.ok, ack.detail):
                return
        self._fail(load, load.given_up)

    def _settle_by(self, load: _Load, how: rules.OnRefusal, reason: str) -> None:
        """What ``kvlifecycle.protocol.consumer`` decided for the load: give up (P's word settles it) or fail."""
        if how == "give_up":
            self._give_up_push(load, reason)
            return
        if how == "drain_then_fail":  # P completed (or failed) its write before releasing: its word came first
            self._drain_notifications()
        if load.transfer in self._loads:
            self._fail(load, reason)

    def _fail(self, load: _Load, reason: str, *, wait_siblings: bool = True) -> None:
        """Fail the whole load. While a sibling part's read is still in flight (several P ranks), its bytes may
        still land: the blocks stay LOADING until every posted read settled (vLLM #56104), bounded by
        ``load_timeout_s``; then the ledger fails the load and every P is told."""
        if load.failed and load.transfer not in self._loads:
            return
        pending = [part for part, handle in load.handles.items()
                   if load.via.get(part, self.transport).poll(handle) is XferStatus.PENDING]
        first = not load.failing
        settle = load.failure(reason, reads_in_flight=len(pending), wait_siblings=wait_siblings)
        if settle is None:
            if first:
                log.warning("load %s of %s failing (%s): waiting for %d sibling read(s) in flight", load.transfer,
                            load.request, reason, len(pending))
            return
        reason = settle
        load.failed = True
        with self._lock:
            self._loads.pop(load.transfer, None)
            self._settled.notify_all()
        for part, handle in load.handles.items():
            with contextlib.suppress(TransportError):
                load.via.get(part, self.transport).release(handle)
        if load.transfer in self.ledger.loads:
            self.ledger.fail(load.transfer, reason)
            self.ledger.commit()  # durable before P hears of it (outside a launch step): P finds it in our log
        for link, grant, part in load.parts:  # tell P now rather than at lease expiry
            try:
                self._load_failed(load, link, grant, part, reason)
            except SideChannelError as exc:
                log.info("could not tell %s that %s failed: %s", link.address, grant.transfer, exc)

    # -- service thread ---------------------------------------------------------------------------------------------
    def _step(self) -> None:
        now = time.monotonic()
        with self._lock:
            loads = list(self._loads.values())
        timeout = self.options.load_timeout_s
        for load in loads:
            duty = load.duty(now, reading=bool(load.handles), timeout_s=timeout)
            if duty.action == "idle":
                continue
            if duty.action != "poll":  # a read outlived its lease, a part failed, or a peer restarted
                self._fail(load, duty.reason, wait_siblings=duty.wait_siblings)
                if duty.action == "fail" and load.transfer in self._loads:
                    self._heartbeat(load, now)  # the siblings' leases must outlive their reads
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
            if load.transfer not in self._loads:
                continue
            if load.after_poll(now, timeout) == "timeout":
                self._settle_by(load, rules.on_load_timeout(load.mode), f"load timed out after {timeout}s")
            elif load.live:
                self._heartbeat(load, now)
        self._drain_notifications()

    def _drain_notifications(self) -> None:
        notes = list(self.transport.notifications())
        if self.fast_transport is not None:  # also sends the notifications of reads that completed meanwhile
            notes += self.fast_transport.notifications()
        for _sender, note in notes:  # push completions / failures from P
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            transfer = self._by_p_transfer.get(note.transfer)
            load = self._loads.get(transfer) if transfer else None
            if load is None or note.kind not in ("done", "failed"):
                for sink in self.note_sinks:
                    sink(_sender, note)
                continue
            token, reason = note.payload[:TOKEN_BYTES], note.payload[TOKEN_BYTES:]
            if not hmac.compare_digest(token, load.tokens.get(note.part, b"\0")):
                self.forged_notifications += 1  # not from the P that issued this load's claim: it changes nothing
                self._log_forged("dropped a %s notification for %s without its claim token", note.kind, transfer)
                continue
            if note.kind == "done":
                self._part_done(load, note.part)
            else:
                self._fail(load, f"producer: {reason.decode(errors='replace')}")

    def _heartbeat(self, load: _Load, now: float) -> None:
        every = beat_every(min(g.ttl_s for _, g, _ in load.parts), self.options.heartbeat_every_s)
        due = load.beat(now, every)
        if due == "hand_back":  # handed back: ask again instead of renewing the lease
            self._give_up_push(load, load.given_up)
        if due != "renew":
            return
        for link, grant, part in load.parts:
            sent = time.monotonic()
            try:
                beat = link.client.request(
                    Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick(),
                              consumer=self._consumer_index(link), token=load.tokens.get(part, b"")),
                    timeout_s=every,
                )
            except SideChannelError as exc:
                log.info("heartbeat to %s failed: %s", link.address, exc)
                continue
            if not beat.ok:
                self._settle_by(load, rules.on_renewal_refused(load.mode, beat.detail), f"lease lost: {beat.detail}")
                return
            load.renewals.acknowledged(part, sent, grant.ttl_s)

    def _part_done(self, load: _Load, part: int) -> None:
        if not load.part_done(part):
            return
        self.ledger.part_done(load.transfer, part)
        if load.complete:
            with self._lock:
                self._loads.pop(load.transfer, None)
                for _, grant, _ in load.parts:
                    self._by_p_transfer.pop(grant.transfer, None)
                self._settled.notify_all()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=self.poll_interval())
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

    def poll_interval(self) -> float:
        """How long the service loop waits for a job before its next step: the busy rhythm while a transfer is in
        flight that no transport wakes this loop for, else the idle one."""
        busy = (self._loads and not self._wakeful) or any(f() for f in self.poll_fast_while)
        return self.options.service_poll_s if busy else self.options.idle_poll_s

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
        self._unclaimed.close()
        self.ledger.commit()

