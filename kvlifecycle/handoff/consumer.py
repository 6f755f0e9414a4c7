"""Consumer (D): fetches grants and holds them until their claim, handshakes with P ranks, pulls (or asks for
pushes), heartbeats leases and settles its ledger. The flow and the threads are described in
:mod:`kvlifecycle.handoff`.
One concept, longer than most: D's side of the handoff (handshake, claims, loads, heartbeats, its service
thread), which shares one lock and one table of peer links.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from kvlifecycle.choices import TransferModeName
from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.clock import StepTimer
from kvlifecycle.control import Claimed, GrantReply, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.digest import DIGEST_ALGO, BlockDigester, DigestError, VerifyMode, expected_digests, mismatched
from kvlifecycle.handoff.block_mapping import BlockMappingError, map_blocks
from kvlifecycle.handoff.held_grants import RENEWALS_PER_TTL, GrantCountError, HeldGrants
from kvlifecycle.handoff.links import REPLY_TYPES, PeerLink, compat_fields
from kvlifecycle.handoff.options import HandoffOptions
from kvlifecycle.handoff.peer_calls import PeerCalls
from kvlifecycle.handoff.unclaimed_grants import UnclaimedGrants
from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    EpochTracker,
    GetMeta,
    MalformedHandshakeError,
    MetaReply,
    check_meta_reply,
    negotiate,
    scale_view,
)
from kvlifecycle.ledger import TargetLedger
from kvlifecycle.path_selection import PRIMARY_PATH, PathSelector
from kvlifecycle.protocol import RENEWAL_TOO_LATE
from kvlifecycle.protocol import consumer as rules  # D's decisions, shared with the simulator
from kvlifecycle.protocol.launch import LaunchStep, LoadLaunch, beat_every
from kvlifecycle.sidechannel import Ack, SideChannelClient, SideChannelError, SideChannelRefused
from kvlifecycle.transfer_ids import load_id, refused_load_id
from kvlifecycle.transport import (
    BlockView,
    Notification,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    TransferHandle,
    Transport,
    TransportError,
    XferOp,
    XferStatus,
    cancels_in_flight,
    landed_digests,
)
from kvlifecycle.untrusted import RateLimitedLog

__all__ = ["Consumer"]

log = logging.getLogger("kvlifecycle.handoff")



HELD_RENEWAL_S = 1.0  # a held grant's renewal waits this long for P's answer (on the peer's worker)
HAND_BACK_TIMEOUT_S = 1.0  # a LoadFailed's wait for P's answer (on the peer's worker, not the service thread)


def _noop() -> None:
    pass


def _ignore_reply(_reply: Any, _sent: float) -> None:
    pass


def _ignore_error(_exc: Exception) -> None:
    pass


@dataclass(slots=True)
class _Load(LoadLaunch):  # its launch, progress and duties are the protocol core's, shared with the simulator
    request: str
    transfer: str  # D ledger's transfer id
    mode: TransferModeName
    parts: list[tuple[PeerLink, GrantReply, int]]  # (link, grant, part index)
    handles: dict[int, TransferHandle] = field(default_factory=dict)  # part -> handle
    via: dict[int, Transport] = field(default_factory=dict)  # part -> the transport that owns its handle
    tokens: dict[int, bytes] = field(default_factory=dict)  # part -> P's claim token for it
    blocks: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int32))  # D's reserved blocks
    mapped: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # part -> (local, remote)
    handed_back: set[int] = field(default_factory=set)  # push given up: the parts whose P released
    lost: set[str] = field(default_factory=set)  # addresses of its P ranks invalidated: told nothing more
    hosts: dict[int, np.ndarray] = field(default_factory=dict)  # part -> P's host slots (claimed from its staging)


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
        clock: Callable[[], float] = time.monotonic,
        peer_calls: Callable[[Callable[[Callable[[], None]], None]], PeerCalls] | None = None,
        side_channel: Callable[[str], SideChannelClient] | None = None,
        thread: bool = True,
        digester: BlockDigester | None = None,
    ) -> None:
        """``digester``: reads D's landed blocks for their digests (``transports.digest_host.HostDigester`` over
        DRAM); with ``options.verify`` not ``none``, every part whose grant carries digests is checked before its
        ``part_done``, and a mismatch fails the load (:meth:`_verified`).

        ``fast_transport``: a same-node fast path (CUDA IPC) registered over the same KV regions as
        ``transport``. At connect, ``path_selector`` picks the path of each P rank's reads (the transports'
        ``SameNodeSelector``: the fast path when both sides hold VRAM on one node and the self-test passes); the
        default keeps every read on ``transport``. For pushes the fast path's metadata goes to P in the handshake,
        whose own path selector picks where its writes go; their notifications are drained from both transports.

        The simulator's seams (the defaults are the real ones): ``clock`` (the monotonic clock of bounds and
        timeouts), ``peer_calls`` (makes the off-loop caller of P from the job queue's ``put``), ``side_channel``
        (makes the client of a P address), ``thread`` False: no service thread; the caller turns the loop with
        :meth:`step_once`."""
        self.ledger, self.transport, self.compat, self.tp_rank = ledger, transport, compat, tp_rank
        self.digester = digester
        self.verified_parts = 0  # parts whose landed bytes matched P's digests
        self.unverified_parts = 0  # parts loaded without a check (no digests sent, a block-size split)
        self.copy_verified_parts = 0  # of those checked, the parts whose digests the copy computed (no read-back)
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
        self._now = clock
        self._client_for = side_channel
        self._calls = (PeerCalls(self._jobs.put, name=f"consumer-{transport.agent}") if peer_calls is None
                       else peer_calls(self._jobs.put))  # side-channel calls, off-loop
        self._lock = threading.RLock()
        self._settled = threading.Condition(self._lock)  # notified whenever a load leaves ``_loads``
        self._stop = threading.Event()
        self._unclaimed = UnclaimedGrants(secret=options.secret, timeout_s=options.request_timeout_s)
        self._held = HeldGrants()  # grants of requests whose loads have not started (announced ones renewed)
        # (agent, epoch, reason, may_write) -> None, told after invalidate_peer and a peer's restart (may_write: the
        # process may still run and write: cut off from the control plane, or an old incarnation in a rolling restart)
        self.peer_lost_sinks: list[Callable[[str, int, str, bool], object]] = []
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
        if thread:
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
                if self._client_for is None
                else self._client_for(address)
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
        # records new epochs; dooms the old incarnation's loads, which fail once their sibling reads settled
        doomed = self.ledger.peer_restarted(reply.meta.agent, reply.meta.epoch)
        if change.kind == "restarted" or doomed:
            self._peer_restarted(reply.meta.agent, reply.meta.epoch, doomed)
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
        if reply.host_meta is not None:  # P's host staging pool: claims may be served from it
            link.host = self._prepare_host(reply.host_meta, read, unit)
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

    def _prepare_host(self, meta: PeerMetadata, read: Any, unit: int) -> PreparedPlan | None:
        """The plan of reads from P's host staging pool (laid out like its KV cache: the same views), on D's own
        transport (host memory is never a fast path's); None if it cannot be reached (a claim served from it then
        fails its load, and P releases the staged copy)."""
        try:
            peer = self.transport.add_peer(meta)
            return self.transport.prepare(
                peer,
                local_view=scale_view(read.local_view, unit) if unit else read.local_view,
                remote_view=scale_view(read.remote_view, unit) if unit else read.remote_view,
            )
        except TransportError as exc:
            log.warning("P's host staging pool %s is unreachable: %s", meta.agent, exc)
            return None

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

    def _peer_restarted(self, agent: str, epoch: int, doomed: Sequence[str] = ()) -> None:
        """P agent ``agent`` came back under ``epoch``: the loads reading an older incarnation (and those the ledger
        doomed) fail at the next step, once their sibling reads settled; the layer-wise streams it wrote end (told
        as for a lost peer, its epochs before this one). A new incarnation does not prove the old one gone (a
        rolling restart runs both for a while): a push it writes fails only at its write bound, and its streams
        end as those of a P declared lost."""
        now = self._now()
        with self._lock:
            for load in self._loads.values():
                old = any(link.agent == agent and link.epoch < epoch for link, _, _ in load.parts)
                if load.transfer in doomed or old:
                    load.failed = True
                if old and load.mode == "push":
                    load.writes_until = max(load.writes_until, load.writes.deadline())
                    if load.writes_until > now:
                        load.failing = load.failing or f"peer restarted: {agent} epoch {epoch}"
        for sink in self.peer_lost_sinks:
            sink(agent, epoch - 1, f"peer restarted: {agent} epoch {epoch}", True)

    def invalidate_peer(self, agent: str, epoch: int, reason: str = "peer lost", *,
                        timeout_s: float = 10.0) -> list[str]:
        """The control plane declared P agent ``agent`` gone up to ``epoch`` (its etcd lease expired, or its key was
        deleted): at once, its loads fail per the ledger's failure policy, its links and transport peer are dropped,
        and whatever it still sends (late notifications) matches no load and is ignored. The other P ranks of a
        failed multi-part load are told (``LoadFailed``, sent on their workers, not waited for); nothing more is
        said to the lost one, and a launch whose claim is out is abandoned. A load with a copy still running that
        releasing its handle cannot stop (CUDA IPC: a kernel on the device, any part's) is the exception: its other
        reads are released (cancelled) now, and it fails, and its other P ranks are told, only once those copies
        ended (the service step polls them, as for a failed part's siblings), so its blocks never leave LOADING
        under a landing copy. Runs on the service thread, which no peer's silence holds up; returns the D transfer
        ids it failed. A later :meth:`connect` to a new incarnation works as usual. Never call it from the service
        thread (an ``on_abandoned`` hook): it waits for that thread."""
        done: queue.SimpleQueue[list[str]] = queue.SimpleQueue()

        def lost(link: PeerLink) -> bool:
            return link.agent == agent and link.epoch <= epoch

        def job() -> None:  # runs at once: nothing on the service thread waits on a peer
            with self._lock:
                hit = [ld for ld in self._loads.values() if any(lost(lk) for lk, _, _ in ld.parts)]
                loads = [ld for ld in hit if ld.live]
                launching = [ld for ld in hit if not ld.live]  # a claim may be out: the launch ends here
                links = [self.links.pop(addr) for addr in [a for a, lk in self.links.items() if lost(lk)]]
                running = {ld.transfer: self._unstoppable(ld) for ld in loads}  # part -> copy still landing
                # a push: P may be alive (cut off from the control plane only) and writing until its lease ends
                now = self._now()
                writes_until = {ld.transfer: ld.writes.deadline() for ld in loads if ld.mode == "push"}
                for load in loads:
                    load.failed = True
                    load.lost.update(lk.address for lk, _, _ in load.parts if lost(lk))
                    if writes_until.get(load.transfer, -math.inf) > now:
                        load.writes_until = writes_until[load.transfer]
                    elif not running[load.transfer]:
                        self._loads.pop(load.transfer, None)
                self._settled.notify_all()
            why = f"{reason}: {agent} epoch {epoch}"
            for load in launching:  # the claimed leases of other P ranks are handed back
                self._abandon(load, why)
            for load in loads:
                keep = running[load.transfer]
                for part, handle in list(load.handles.items()):
                    if part not in keep:
                        with contextlib.suppress(TransportError):
                            load.via.get(part, self.transport).release(handle)
                        del load.handles[part]
                if keep:  # fails once its running copies ended (``_fail`` from the service step), not before
                    load.failing = load.failing or why
                    log.warning("load %s of %s failing (%s): waiting for %d copy(ies) a release cannot stop",
                                load.transfer, load.request, why, len(keep))
                    continue
                if load.writes_until > now:  # fails at its write bound (``_fail`` from the service step)
                    load.failing = load.failing or why
                    log.warning("load %s of %s failing (%s): P's write may land for %.3f s more (its lease's bound)",
                                load.transfer, load.request, why, load.writes_until - now)
                    continue
                if load.transfer in self.ledger.loads:
                    self.ledger.fail(load.transfer, why)
                for link, grant, part in load.parts:  # the other P ranks of a multi-part load release now
                    if not lost(link):
                        self._tell_failed(load, link, grant, part, why)
            for link in links:
                self._calls.drop_queued(link.address, why)  # nothing more is said to a lost peer
            for link in links:
                for data, peer in {(self.transport, link.agent), (link.data or self.transport,
                                                                   link.data_peer or link.agent)}:
                    try:
                        data.remove_peer(peer)
                    except TransportError as exc:
                        log.info("removing lost peer %s from %s: %s", agent, data.name, exc)
            for link in links:  # on the peer's worker, after the call in flight there (a close waits for it)
                self._calls.submit(link.address, link.client.close, on_reply=_ignore_reply, on_error=_ignore_error)
            log.warning("peer %s (epoch <= %d) invalidated (%s): %d load(s) failed, %d link(s) dropped",
                        agent, epoch, reason, len(loads), len(links))
            done.put([load.transfer for load in loads])

        self._jobs.put(job)
        try:
            return done.get(timeout=timeout_s)
        except queue.Empty as exc:
            raise TimeoutError(f"invalidating {agent} did not finish in {timeout_s}s") from exc
        finally:
            for sink in self.peer_lost_sinks:
                sink(agent, epoch, reason, True)

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
            transfer = refused_load_id(first.transfer if first is not None else request)
            self.ledger.start_load(request, transfer, generation=first.generation if first else 0)
            self.ledger.fail(transfer, reason)
        self.hand_back(grants, reason, consumer=consumer)

    # -- a load from its grants to its start (the engine's thread) -----------------------------------------------
    def announce(self, request: str, remote: str, addresses: Sequence[str], *, wait_s: float = 0.0) -> int:
        """The P ranks at ``addresses`` hold P's request ``remote`` for D's ``request``, whose blocks the engine
        has not reserved yet: fetch each grant now (waiting up to ``wait_s`` for P to publish it) and keep its lease
        alive, renewed from the service thread, until :meth:`load`, :meth:`skip` or :meth:`forget_grants`. A grant
        not published yet is asked for again by :meth:`load`. Returns how many grants are held."""
        held = 0
        for address in addresses:
            try:
                grant = self._held_grant(request, remote, address, wait_s)
            except SideChannelError as exc:
                log.warning("request %s: no grant from %s yet (%s); asked again when its load starts", request,
                            address, exc)
                continue
            self._held.put(request, address, grant, renew=True)
            held += 1
        self._jobs.put(_noop)  # the service thread's next step renews them
        return held

    def load(self, request: str, remote: str, addresses: Sequence[str], *, push: bool = False,
             wait_s: float = 0.0) -> str | None:
        """Load ``request`` (reserved in the ledger) from P's request ``remote`` on the P ranks at ``addresses``, in
        part order: every rank's grant first (held ones reused), so that a refusal by one reaches all of them; a
        handshake with each rank not linked yet or restarted; each grant counted for this D's TP plan
        (:class:`GrantCountError`); then :meth:`pull` or :meth:`request_push`. Anything that stops it before its
        start fails it in the ledger and hands every fetched grant back (:meth:`fail_unstarted`): returns None then
        (the ledger's failure event says why), else D's transfer id. Blocks the calling thread, bounded by the
        timeouts, never the service thread."""
        grants: list[tuple[str, GrantReply]] = []
        try:
            for address in addresses:
                grants.append((address, self._held_grant(request, remote, address, wait_s)))
            for address, grant in grants:
                link = self.links.get(address)
                if link is None or link.epoch != grant.epoch:  # first contact, or P restarted on this address
                    link = self.connect(address, push=push)
                self._check_grant_count(link, remote, grant)
            if push:
                return self.request_push(request, grants[0][1], address=grants[0][0])
            return self.pull(request, grants)
        except Exception as exc:  # every load must settle: one that cannot start fails now, in the ledger
            expected_refusal = isinstance(exc, (CompatMismatchError, SideChannelError, TransportError, ValueError))
            reason = f"{type(exc).__name__}: {exc}"
            log.error("request %s: handoff refused: %s", request, reason, exc_info=not expected_refusal)
            self.fail_unstarted(request, grants, reason, consumer=self._index_on(grants))
            return None
        finally:
            self._held.drop(request)  # the claim's heartbeat takes over (or nothing is left to renew)

    @staticmethod
    def _check_grant_count(link: PeerLink, remote: str, grant: GrantReply) -> None:
        """P's lease counts as many consumers as D ranks read that P rank: fewer would release it at the first
        one's completion while another still reads, more would pin it until expiry."""
        expected = link.plan.consumers_per_p_rank
        if grant.consumers != expected:
            raise GrantCountError(
                f"P rank at {link.address} granted {remote} for {grant.consumers} consumer(s), but this D rank's "
                f"TP plan makes {expected}: P must count the D ranks of this D's TP size")

    def skip(self, request: str, remote: str, addresses: Sequence[str], reason: str = "not needed by D", *,
             wait_s: float = 0.0) -> None:
        """D will load nothing of P's request ``remote`` into ``request`` (a full local prefix hit, or no blocks):
        the P ranks at ``addresses`` release now rather than at lease expiry. A grant that cannot be fetched is
        left to expire."""
        grants: list[tuple[str, GrantReply]] = []
        for address in addresses:
            try:
                grants.append((address, self._held_grant(request, remote, address, wait_s)))
            except SideChannelError as exc:
                log.info("could not release %s on %s: %s (its lease will expire)", remote, address, exc)
        self._held.drop(request)
        self.hand_back(grants, reason, consumer=self._index_on(grants))

    def forget_grants(self, request: str) -> None:
        """The engine dropped ``request`` before its load: its grants are no longer renewed (their leases expire)."""
        self._held.drop(request)

    def _held_grant(self, request: str, remote: str, address: str, wait_s: float) -> GrantReply:
        grant = self._held.get(request, address)
        if grant is None:
            grant = self.fetch_grant(address, remote, wait_s=wait_s)
            self._held.put(request, address, grant, renew=False)
        return grant

    def _index_on(self, grants: Sequence[tuple[str, GrantReply]]) -> int:
        """This D rank's consumer index on the leases of ``grants`` (from the handshake plan, else the grant's
        count: D ranks sharing one P rank are its consumers 0..r-1)."""
        if not grants:
            return 0
        address, grant = grants[0]
        link = self.links.get(address)
        return self._consumer_index(link) if link is not None else self.tp_rank % max(grant.consumers, 1)

    def _renew_held(self, now: float) -> None:
        """Renew the announced grants' leases that are due, on the peers' workers (never on this thread)."""
        for request, held in self._held.due(now):
            address, grant = held.address, held.grant
            self._calls.submit(
                address, functools.partial(self._unclaimed.keep_alive, address, grant, timeout_s=HELD_RENEWAL_S),
                on_reply=functools.partial(self._held_renewed, request, address),
                on_error=functools.partial(self._held_unanswered, request, address),
                key=("renew held", request, address), expires_s=grant.ttl_s / RENEWALS_PER_TTL)

    def _held_renewed(self, request: str, address: str, ack: Ack, _sent: float) -> None:
        if not ack.ok and self._held.get(request, address) is not None:
            log.warning("lease of %s is gone on %s: %s", request, address, ack.detail)
            self._held.stop_renewing(request, address)

    @staticmethod
    def _held_unanswered(request: str, address: str, exc: Exception) -> None:
        log.info("renewing the lease of %s on %s failed: %s", request, address, exc)

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

    def _start(self, request: str, grants: Sequence[tuple[str, GrantReply]] | GrantReply, address: str | None,
               mode: TransferModeName) -> str:
        if isinstance(grants, GrantReply):
            if address is None:
                raise ValueError("one grant needs its P address (address=...)")
            pairs = [(address, grants)]
        else:
            pairs = list(grants)
        parts = [(self.links[addr], grant, i) for i, (addr, grant) in enumerate(pairs)]
        if len(parts) != parts[0][0].plan.parts:
            raise ValueError(f"this D rank reads {parts[0][0].plan.parts} P rank(s); got {len(parts)} grant(s)")
        if mode == "push" and (len(parts) != 1 or parts[0][0].plan.consumers_per_p_rank != 1):
            # one PushRequest is one WRITE per (transfer, part): D ranks sharing a P rank's lease would collide
            raise ValueError("push after the prefill supports one P rank with equal layouts (a layer-wise stream "
                             "or pull crosses TP sizes)")
        transfer = load_id(request, [grant.transfer for _, grant in pairs])
        if request not in self.ledger.requests:
            raise KeyError(f"request {request!r} is not reserved in the target ledger")
        now = self._now()
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
        self._launch_step(load, lambda: self._launch(load))

    def _launch_step(self, load: _Load, step: Callable[[], None]) -> None:
        """Run a step of the launch, and settle the load whatever goes wrong: a load left in ``_loads`` unsettled
        waits forever."""
        try:
            step()
        except Exception as exc:
            log.exception("launching load %s of %s failed", load.transfer, load.request)
            reason = f"internal error: {type(exc).__name__}: {exc}"
            if load.live:
                self._fail(load, reason)
            elif load.transfer in self._loads:
                self._abandon(load, reason)

    def _launch(self, load: _Load) -> None:
        """The launch the protocol core orders (:class:`~kvlifecycle.protocol.launch.LoadLaunch`): every lease
        claimed first, then the load starts in D's ledger, then the reads are posted or the push asked for. Each
        claim's answer continues it as a later job; the service thread never waits for one."""
        if not self._open(load):  # its peer was invalidated before the launch began
            return
        req = self.ledger.requests.get(load.request)
        step = load.begin(reserved=req is not None)
        if req is None:  # the engine gave the request up (aborted) before its load began: no lease is of use
            self._abandon(load, step.reason, hand_back_all=True)
            return
        blocks = req.blocks
        for link, grant, part in load.parts:  # before any claim: a load that cannot fill every block never starts
            try:
                load.mapped[part] = self._map_blocks(blocks, np.asarray(grant.block_ids, dtype=np.int32), link)
            except BlockMappingError as exc:
                self._abandon(load, str(exc), hand_back_all=True)  # P's lease is of no use: release it now
                return
        load.blocks = blocks
        self._take(load, step)

    def _take(self, load: _Load, step: LaunchStep) -> None:
        """Do the launch's next step, as the protocol core ordered it. A claim is submitted, not waited for: its
        answer continues the launch as a later job (:meth:`_claim_answered`)."""
        if step.action == "abandon":
            self._abandon(load, step.reason)
        elif step.action == "claim":
            link, grant, part = load.parts[step.part]
            # claim first: the claim binds the lease to this agent, and its token to this load
            claim = Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick(),
                              consumer=self._consumer_index(link))
            self._call(link, claim, on_reply=functools.partial(self._claim_answered, load, part),
                       on_error=functools.partial(self._claim_unanswered, load),
                       expires_s=self.options.request_timeout_s)
        else:
            # One ledger step: start_load gates the posts at once, and its record joins the log after the launch.
            with self.ledger.step():
                self._start_and_post(load)

    def _claim_answered(self, load: _Load, part: int, beat: Claimed | Ack, sent: float) -> None:
        link, grant, _ = load.parts[part]
        token = beat.token if isinstance(beat, Claimed) else b""
        if not self._open(load):  # abandoned (or its peer invalidated) while the claim was out
            if beat.ok:  # the lease is ours now and no load will read it: P may release it at once
                self._tell_failed(load, link, grant, part, self.abandoned.get(load.request, "load abandoned"),
                                  token=token)
            return
        if beat.ok:
            load.tokens[part] = token
            host = beat.host_blocks if isinstance(beat, Claimed) else None
            if isinstance(beat, Claimed) and beat.hlc:  # served from P's host pool: our load sorts after that
                self.ledger.hlc.observe(beat.hlc)
            if host is not None and load.mode != "push":  # P staged the lease: read its slots, if they fit
                # (a push is P's to write, from wherever the lease is)
                if len(host) != len(grant.block_ids) or link.host is None:
                    why = ("P's host staging pool is unreachable" if link.host is None
                           else f"{len(host)} host slots for {len(grant.block_ids)} granted blocks")
                    self._tell_failed(load, link, grant, part, why, token=token)
                    beat = Claimed(False, why)
                else:
                    load.hosts[part] = np.asarray(host, dtype=np.int64)
        step = load.claim_answered(part, ok=beat.ok, detail=beat.detail, sent_at=sent, ttl_s=grant.ttl_s,
                                   reserved=True,  # a reservation cancelled meanwhile: start_load refuses
                                   now=self._now())
        self._launch_step(load, lambda: self._take(load, step))

    def _claim_unanswered(self, load: _Load, exc: Exception) -> None:
        if self._open(load):
            self._launch_step(load, lambda: self._take(load, load.claim_unanswered(str(exc))))

    def _start_and_post(self, load: _Load) -> None:
        blocks, mapped = load.blocks, load.mapped
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
                push = PushRequest(grant.transfer, grant.generation, self.transport.agent, self.transport.epoch,
                                   blocks.tolist(), load.request, part, load.tokens.get(part, b""),
                                   load.writes.since_claim(part, self._now()))
                self._call(link, push, on_reply=functools.partial(self._push_answered, load),
                           on_error=functools.partial(self._push_unanswered, load))
                continue
            prepared: PreparedPlan | None = link.prepared
            data = link.data or self.transport
            local, remote = mapped[part]
            host = load.hosts.get(part)
            if host is not None:  # the staged copy: the same units, in P's host slots
                prepared, data = link.host, self.transport
                remote = self._host_units(host, grant, remote, link.plan.remote_split)
            if prepared is None:
                self._fail(load, "P's host staging pool is unreachable")
                return
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
        load.last_beat = self._now()

    def _push_answered(self, load: _Load, ack: Ack, _sent: float) -> None:
        if not self._open(load) or ack.ok:
            return
        if ack.detail == RENEWAL_TOO_LATE:  # this copy came late: an earlier one may have been accepted
            self._give_up_push(load, f"push refused: {ack.detail}")
            return
        self._fail(load, f"push refused: {ack.detail}")  # refused before P accepted a write

    def _push_unanswered(self, load: _Load, exc: Exception) -> None:
        if self._open(load):  # P may have accepted it: its write may be landing
            self._settle_by(load, rules.on_push_unanswered(), f"push request failed: {exc}")

    @staticmethod
    def _host_units(host: np.ndarray, grant: GrantReply, remote: np.ndarray, split: int) -> np.ndarray:
        """``remote`` (units of P's granted blocks, ``split`` per block) as units of the host slots that hold
        them: P copied its i-th granted block into ``host[i]``."""
        position = {block: i for i, block in enumerate(grant.block_ids)}
        units = remote.astype(np.int64)
        slots = np.asarray([host[position[int(b)]] for b in (units // split).tolist()], dtype=np.int64)
        return slots * split + units % split

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
            self._tell_failed(load, link, grant, part, reason)

    def _tell_failed(self, load: _Load, link: PeerLink, grant: GrantReply, part: int, reason: str, *,
                     token: bytes | None = None,
                     on_reply: Callable[[Ack, float], None] | None = None) -> None:
        """Tell P this part's load failed or was given up (its lease may go): submitted, not waited for. A P that
        does not answer is logged and left to its lease's expiry."""
        message = LoadFailed(grant.transfer, grant.generation, reason, self.ledger.hlc.tick(),
                             load.tokens.get(part, b"") if token is None else token, self._consumer_index(link))

        def unanswered(exc: Exception) -> None:
            log.info("could not tell %s that %s failed: %s", link.address, grant.transfer, exc)

        # not sent within the lease's TTL (behind a silent peer's other calls): moot, P expired the lease itself
        self._call(link, message, timeout_s=HAND_BACK_TIMEOUT_S, on_reply=on_reply or _ignore_reply,
                   on_error=unanswered, key=("hand_back", load.transfer, part) if on_reply is not None else None,
                   expires_s=grant.ttl_s)

    def _give_up_push(self, load: _Load, reason: str) -> None:
        """D cannot tell whether P's write is landing: it hands the lease back and keeps its blocks LOADING until
        P answers — released: the load fails now; ``WRITE_IN_FLIGHT``: P cancels the write, then its ``failed``
        notification fails the load. No answer: asked again at the heartbeat rhythm (one hand-back out at a time)."""
        load.given_up = load.given_up or reason
        for link, grant, part in load.parts:
            if link.address in load.lost:  # invalidated: nothing more is said to it
                continue
            self._tell_failed(load, link, grant, part, load.given_up,
                              on_reply=functools.partial(self._handed_back, load, part))

    def _handed_back(self, load: _Load, part: int, ack: Ack, _sent: float) -> None:
        if not self._open(load) or not rules.hand_back_settles(ack.ok, ack.detail):
            return
        load.handed_back.add(part)
        if len(load.handed_back) == load.size:  # every P released (or cancelled nothing): no write can land
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
        if self._now() < load.writes_until:  # a lost P's write may still land: the blocks stay LOADING until then
            load.failing = load.failing or reason
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
        running = self._unstoppable(load, pending)
        if running:  # a release would not stop them (a read's bound, a timeout): the rest are released (cancelled)
            for part in [p for p in load.handles if p not in running]:
                with contextlib.suppress(TransportError):
                    load.via.get(part, self.transport).release(load.handles.pop(part))
            load.failing = settle
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
        for link, grant, part in load.parts:  # tell P now rather than at lease expiry (not an invalidated one)
            if link.address not in load.lost:
                self._tell_failed(load, link, grant, part, reason)

    def _unstoppable(self, load: _Load, pending: Sequence[int] | None = None) -> set[int]:
        """The parts of ``load`` (of ``pending``, else polled now) whose copy is still running and cannot be stopped
        by releasing its handle (``cancels_in_flight`` False: CUDA IPC's kernel runs to its end): their bytes may
        still land in the blocks, so the load's failure waits for them. Never blocks."""
        parts = [part for part in load.handles if not cancels_in_flight(load.via.get(part, self.transport))]
        if pending is not None:
            return {part for part in parts if part in pending}
        return {part for part in parts
                if load.via.get(part, self.transport).poll(load.handles[part]) is XferStatus.PENDING}

    # -- service thread ---------------------------------------------------------------------------------------------
    def _call(self, link: PeerLink, message: msgspec.Struct, *, on_reply: Callable[[Any, float], None],
              on_error: Callable[[Exception], None], timeout_s: float | None = None,
              key: tuple[str, str, int] | None = None, expires_s: float | None = None) -> None:
        """Send ``message`` to ``link``'s P on that peer's worker (:mod:`kvlifecycle.peer_calls`); its reply
        (with its send time) or its failure comes back as a job of this thread. The service thread never waits
        on a peer: a silent one would hold every load's read bound, and ``invalidate_peer``, behind its timeout."""
        self._calls.submit(link.address, lambda: link.client.request(message, timeout_s=timeout_s),
                           on_reply=on_reply, on_error=on_error, key=key, expires_s=expires_s)

    def _open(self, load: _Load) -> bool:
        """The load is still this Consumer's to settle (not settled, abandoned or invalidated)."""
        return self._loads.get(load.transfer) is load

    def _cancel_outlived_reads(self, now: float) -> None:
        """First in every step: a read that may outlive its lease (its bound, the RenewalClock's deadline, is
        reached) is cancelled now: its handles released and its load failed, before P may expire the lease and
        reuse the blocks. Nothing before it in a step waits, and the loop wakes by the nearest bound
        (:meth:`poll_interval`)."""
        with self._lock:
            loads = list(self._loads.values())
        for load in loads:
            duty = load.duty(now, reading=bool(load.handles), timeout_s=self.options.load_timeout_s)
            if duty.action == "cancel_reads":
                self._fail(load, duty.reason, wait_siblings=False)

    def _step(self) -> None:
        now = self._now()
        self._cancel_outlived_reads(now)
        self._renew_held(now)
        with self._lock:
            loads = list(self._loads.values())
        timeout = self.options.load_timeout_s
        for load in loads:
            duty = load.duty(now, reading=bool(load.handles), timeout_s=timeout)
            if duty.action in ("idle", "cancel_reads"):  # cancel_reads: the bound's, taken first in every step
                continue
            if duty.action != "poll":  # a part failed, or a peer restarted
                self._fail(load, duty.reason, wait_siblings=duty.wait_siblings)
                if duty.action == "fail" and load.transfer in self._loads:
                    self._heartbeat(load, now)  # the siblings' leases must outlive their reads
                continue
            for part, handle in list(load.handles.items()):
                if not self._open(load):  # failed by a sibling's digest mismatch: its handles are released
                    break
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
                try:
                    self._part_done(load, part, (data, handle))
                finally:  # a digest mismatch fails the load durably: a failed commit must not leak the handle
                    try:
                        stats = data.stats(handle)
                        if stats is not None:
                            self.ledger.observe_transfer_stats(load.transfer, stats)
                    finally:
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
            if load is not None and load.lost and 0 <= note.part < load.size and (
                    load.parts[note.part][0].address in load.lost):
                continue  # from a P declared lost: its load fails at its write bound, whatever it says now
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
        """Renew the load's leases when due: one renewal per part submitted (none while the last is still out);
        each acknowledgement moves the read's bound (:meth:`_renewed`). Never waits on P."""
        every = beat_every(min(g.ttl_s for _, g, _ in load.parts), self.options.heartbeat_every_s)
        due = load.beat(now, every)
        if due == "hand_back":  # handed back: ask again instead of renewing the lease
            self._give_up_push(load, load.given_up)
        if due != "renew":
            return
        for link, grant, part in load.parts:
            if link.address in load.lost:  # invalidated: nothing more is said to it
                continue
            beat = Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick(),
                             consumer=self._consumer_index(link), token=load.tokens.get(part, b""),
                             since_claim=load.writes.since_claim(part, now))
            # one renewal out per part (queued or in flight). One sent late, behind the peer's other calls, still
            # counts from when it left: a slow P's later loads are renewed, not starved
            self._call(link, beat, timeout_s=every, key=("beat", load.transfer, part),
                       on_reply=functools.partial(self._renewed, load, part),
                       on_error=functools.partial(self._renewal_unanswered, link))

    def _renewed(self, load: _Load, part: int, beat: Ack, sent: float) -> None:
        """P answered a renewal of ``part`` that left at ``sent``."""
        if not self._open(load) or not load.live:
            return
        if not beat.ok and beat.detail == RENEWAL_TOO_LATE:  # held back in the network: it renewed nothing
            return
        if not beat.ok:
            self._settle_by(load, rules.on_renewal_refused(load.mode, beat.detail), f"lease lost: {beat.detail}")
            return
        load.renewals.acknowledged(part, sent, load.parts[part][1].ttl_s)

    @staticmethod
    def _renewal_unanswered(link: PeerLink, exc: Exception) -> None:
        log.info("heartbeat to %s failed: %s", link.address, exc)

    def _verified(self, load: _Load, part: int, read: tuple[Transport, TransferHandle] | None) -> int | None:
        """How many units (P blocks) of what landed for ``part`` matched P's digests (its ``part_done`` records
        the number), 0 when not checked (verification off, no digests in the grant, a block-size split); None on
        a mismatch: the ledger records it and the load fails, so no block of it becomes READY_FOR_ATTENTION. Runs
        before ``part_done``, on the service thread. ``read``: the part's completed READ, still held: where its
        transport's copy digested what it wrote (:class:`~kvlifecycle.transport.LandedDigests`, whole blocks),
        those digests are compared and D's blocks are not read again."""
        link, grant, _ = load.parts[part]
        if self.options.verify is VerifyMode.NONE or self.digester is None or grant.digests is None:
            self.unverified_parts += 1
            return 0
        if grant.digests.algo != DIGEST_ALGO:  # a P of another digest (a rolling upgrade): unchecked, as one of none
            log.info("%s: P's digests are %r, this D computes %r: part %d loads unchecked", load.transfer,
                     grant.digests.algo, DIGEST_ALGO, part)
            self.unverified_parts += 1
            return 0
        mapped = load.mapped.get(part)
        if mapped is None or link.plan.local_split != 1 or link.plan.remote_split != 1:
            self.unverified_parts += 1
            return 0
        local, remote = mapped
        slice_index = self._consumer_index(link)
        try:
            expected = expected_digests(grant.digests, len(grant.block_ids), slice_index)[-remote.size:]
            view = self._planned_view(link, grant.tp_rank)
            found = self._landed(read, local.size) if view.offset == view.length == 0 else None
            if found is not None:
                self.copy_verified_parts += 1
            else:
                found = self.digester.digests(local, offset=view.offset, length=view.length)
        except DigestError as exc:
            self._fail(load, f"digests unusable: {exc}")
            return None
        bad = mismatched(expected, found)
        if bad.size == 0:
            self.verified_parts += 1
            return int(found.size)
        self.ledger.digest_mismatch(load.transfer, part, blocks=local[bad], source_blocks=remote[bad],
                                    expected=expected[bad], found=found[bad], slice_index=slice_index,
                                    quarantine_s=self.options.quarantine_s)
        self._fail(load, f"digest mismatch: {bad.size} block(s) of part {part}")
        return None

    def _planned_view(self, link: PeerLink, p_rank: int) -> BlockView:
        """Where the handshake's plan puts P rank ``p_rank``'s bytes in D's blocks, in bytes: the check reads
        there, so a read prepared into the wrong heads fails it."""
        read = next((r for r in link.plan.reads if r.p_rank == p_rank), None)
        if read is None:
            raise DigestError(f"P rank {p_rank} is not in this D rank's plan")
        unit = self.options.unit_bytes
        return scale_view(read.local_view, unit) if unit else read.local_view

    @staticmethod
    def _landed(read: tuple[Transport, TransferHandle] | None, blocks: int) -> np.ndarray | None:
        """The digests ``read``'s copy computed of the ``blocks`` whole blocks it wrote, or None (none computed,
        or not one per block: then D reads its blocks back)."""
        found = None if read is None else landed_digests(*read)
        return found if found is not None and found.shape == (blocks,) else None

    def _part_done(self, load: _Load, part: int, read: tuple[Transport, TransferHandle] | None = None) -> None:
        if part in load.done:
            return
        verified = self._verified(load, part, read)
        if verified is None or not load.part_done(part):
            return
        self.ledger.part_done(load.transfer, part, verified=verified)
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
        flight that no transport wakes this loop for, else the idle one; never past the nearest read's bound (a
        read is cancelled at its bound even while the loop idles)."""
        busy = (self._loads and not self._wakeful) or any(f() for f in self.poll_fast_while)
        wait = self.options.service_poll_s if busy else self.options.idle_poll_s
        return min(wait, max(self.read_bound() - self._now(), 0.0))

    def read_bound(self) -> float:
        """The nearest bound of a read in flight (inf: none), in this Consumer's clock: the loop wakes by it."""
        with self._lock:
            return min((load.renewals.deadline() for load in self._loads.values() if load.handles),
                       default=float("inf"))

    def step_once(self) -> None:
        """One turn of the service loop without waiting (the simulator's scheduler turns it): every queued job,
        then a step and the commit."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job()
        self._step()
        self.ledger.commit()

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def wait_idle(self, timeout_s: float = 30.0) -> bool:
        """Block (bounded, without spinning) until no load is pending."""
        with self._settled:
            return self._settled.wait_for(lambda: not self._loads, timeout=timeout_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        self._calls.close()
        for link in self.links.values():
            link.client.close()
        self._unclaimed.close()
        self.ledger.commit()

