"""The handoff's plumbing as the simulation drives it, around the protocol core both it and the threaded runtime
call (:mod:`kvlifecycle.protocol`).

P: :class:`ProducerCore` is plumbing only: every decision (a renewal, a hand-back, a push's admission, whether a
write may be posted or must be cancelled, what a settled write or a consumer's notification does, the sweep) is
:class:`~kvlifecycle.protocol.producer.ProducerProtocol`'s, the class the threaded ``Producer`` calls. D:
:class:`ConsumerCore` takes the decisions of :mod:`kvlifecycle.protocol.consumer` and bounds reads with
:class:`~kvlifecycle.protocol.bounds.RenewalClock`, as the ``Consumer`` does, and its loads are the ``Consumer``'s
:class:`~kvlifecycle.protocol.load.LoadProgress` (each part counted once, the last settles the load; a failure
waits, ``failing``, for sibling reads in flight), and their launch and service duties are
:class:`~kvlifecycle.protocol.launch.LoadLaunch`'s (every lease claimed first, then ``start_load`` and the posts in
one ledger step; what a claim's answer means; which leases an abandon hands back; what a service step owes a load;
when a heartbeat is due). What differs is the plumbing: a side-channel request is a message and a later reply
(or a timeout) instead of a blocking call, and the service "thread" is a step the scheduler runs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle.handshake import EpochTracker
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol.consumer import (
    OnRefusal,
    hand_back_settles,
    on_load_timeout,
    on_push_unanswered,
    on_renewal_refused,
)
from kvlifecycle.protocol.launch import LaunchStep, LoadLaunch, beat_every
from kvlifecycle.protocol.producer import ProducerProtocol
from kvlifecycle.sim.messages import (
    Call,
    GetMeta,
    GrantInfo,
    Heartbeat,
    LoadFailed,
    NoteMsg,
    PushRequest,
    Reply,
)
from kvlifecycle.sim.transport import SimTransport
from kvlifecycle.transport import (
    BlockView,
    Notification,
    PreparedPlan,
    TransferHandle,
    TransportError,
    XferOp,
    XferStatus,
)

Send = Callable[[str, object], None]  # (destination node, payload)


def rank_view(rank: int, ranks: int, block_bytes: int) -> BlockView:
    """The slice of every block a P rank of a ``ranks``-wide TP group holds (its heads), as D sees it."""
    if ranks == 1:
        return BlockView()
    width = block_bytes // ranks
    return BlockView(rank * width, width)


# --- P ------------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Push:
    handle: TransferHandle
    transfer: str
    generation: int
    peer: str
    note: Notification


class ProducerCore:
    """P's plumbing around :class:`~kvlifecycle.protocol.producer.ProducerProtocol` (the decisions the threaded
    ``Producer`` makes too): side-channel calls as messages, the service thread as a scheduler step."""

    def __init__(self, ledger: SourceLedger, transport: SimTransport, send: Send) -> None:
        self.ledger, self.transport, self.send = ledger, transport, send
        self.protocol = ProducerProtocol(ledger)
        self.grants: dict[str, GrantInfo] = {}
        self.epochs = EpochTracker()
        self._push_plans: dict[tuple[str, int], PreparedPlan] = {}
        self._pushes: list[_Push] = []
        self._jobs: list[Callable[[], None]] = []
        self.pushes_accepted: Counter[str] = Counter()  # transfer -> WRITEs queued for it (bookkeeping for checks)

    def publish(self, grant: GrantInfo) -> None:
        self.grants[grant.request] = grant

    def on_call(self, src: str, call: Call) -> None:
        body = call.body
        if isinstance(body, GetMeta):
            reply = self._on_get_meta(body)
        elif isinstance(body, Heartbeat):
            if body.hlc:
                self.ledger.hlc.observe(body.hlc)
            answer = self.protocol.renew(body.transfer, body.generation, body.agent)
            reply = Reply(call.call, answer.ok, answer.detail)
        elif isinstance(body, LoadFailed):
            if body.hlc:
                self.ledger.hlc.observe(body.hlc)
            answer = self.protocol.hand_back(body.transfer, body.generation, body.reason)
            reply = Reply(call.call, answer.ok, answer.detail)
        elif isinstance(body, PushRequest):
            reply = self._on_push(call.call, body)
        else:  # pragma: no cover - the world sends nothing else
            raise TypeError(f"unexpected call {body!r}")
        self.send(src, Reply(call.call, reply.ok, reply.detail, reply.meta))

    def _on_get_meta(self, msg: GetMeta) -> Reply:
        change = self.epochs.observe(msg.agent, msg.epoch)
        if change.kind == "stale":
            return Reply(0, False, f"stale_epoch: {msg.agent}: epoch {msg.epoch} < known {change.previous}")
        if change.kind in ("new", "restarted"):
            self.ledger.peer_restarted(msg.agent, msg.epoch)
        if msg.meta is not None:
            peer = self.transport.add_peer(msg.meta)
            self._push_plans[(peer, msg.meta.epoch)] = self.transport.prepare(peer)
        return Reply(0, True, meta=self.transport.local_metadata())

    def _on_push(self, call: int, msg: PushRequest) -> Reply:
        plan = self._push_plans.get((msg.agent, msg.epoch))
        admission = self.protocol.admit_push(msg.transfer, msg.generation, msg.part,
                                             unavailable=None if plan is not None else "handshake first")
        if not admission.write:
            return Reply(call, admission.answer.ok, admission.answer.detail)
        assert plan is not None and admission.source is not None
        dst, src = np.asarray(msg.blocks, dtype=np.int32), admission.source
        note = Notification(msg.target_request, msg.transfer, msg.generation, self.transport.epoch, "done", msg.part,
                            hlc=self.ledger.hlc.tick())
        self._jobs.append(lambda: self._start_push(plan, src, dst, msg, note))
        self.protocol.accept_write(msg.transfer, msg.generation, msg.part)
        self.pushes_accepted[msg.transfer] += 1
        return Reply(call, True)

    def _start_push(self, plan: PreparedPlan, src: np.ndarray, dst: np.ndarray, msg: PushRequest,
                    note: Notification) -> None:
        why = self.protocol.stop_write(msg.transfer, msg.generation)
        if why:
            self.protocol.write_settled(msg.transfer, msg.generation, msg.part, None)
            self._push_failed(msg.transfer, msg.generation, plan.peer, note, f"write not posted: {why}")
            return
        try:
            handle = self.transport.post(XferOp.WRITE, plan, src, dst, notification=note, transfer=msg.transfer)
        except (TransportError, ValueError) as exc:
            self.protocol.write_settled(msg.transfer, msg.generation, msg.part, None)
            self._push_failed(msg.transfer, msg.generation, plan.peer, note, f"post failed: {exc}")
            return
        self._pushes.append(_Push(handle, msg.transfer, msg.generation, plan.peer, note))

    def _push_failed(self, transfer: str, generation: int, peer: str, note: Notification, reason: str) -> None:
        failed = Notification(note.request, note.transfer, note.generation, note.epoch, "failed", note.part,
                              reason.encode()[:512], self.ledger.hlc.tick())
        try:
            self.transport.send_notification(peer, failed)
        except TransportError:
            self.ledger.fail(transfer, generation, reason)

    def _poll_pushes(self) -> None:
        still = []
        for push in self._pushes:
            status = self.transport.poll(push.handle)
            if status is XferStatus.PENDING:
                why = self.protocol.stop_write(push.transfer, push.generation)
                if not why:
                    still.append(push)
                    continue
                self.transport.release(push.handle)  # cancels it: no byte moves after
                self.protocol.write_settled(push.transfer, push.generation, push.note.part, None)
                self._push_failed(push.transfer, push.generation, push.peer, push.note, f"write cancelled: {why}")
                continue
            self.protocol.write_settled(push.transfer, push.generation, push.note.part, status)
            if status is not XferStatus.DONE:
                err = self.transport.error(push.handle)
                self._push_failed(push.transfer, push.generation, push.peer, push.note, f"write failed: {err}")
            self.transport.release(push.handle)
        self._pushes = still

    def run_jobs(self) -> None:
        jobs, self._jobs = self._jobs, []
        for job in jobs:
            job()

    def service(self) -> None:
        self.run_jobs()
        if self._pushes:
            self._poll_pushes()
        for _sender, note in self.transport.notifications():
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            self.protocol.on_notification(note.kind, note.transfer, note.generation, note.part,
                                          note.payload.decode(errors="replace"))
        self.protocol.sweep()
        self.ledger.commit()

    def busy(self) -> bool:
        return bool(self._pushes or self._jobs)


# --- D ------------------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Link:
    agent: str
    epoch: int
    plan: PreparedPlan | None = None
    connecting: int = 0  # the call id of a handshake in flight


@dataclass(slots=True)
class Part:
    link_agent: str
    grant: GrantInfo
    index: int


@dataclass(slots=True)
class Load(LoadLaunch):  # its launch, progress and duties are the protocol core's, as the Consumer's loads are
    request: str
    transfer: str
    mode: str
    parts: list[Part]
    handles: dict[int, TransferHandle] = field(default_factory=dict)
    launched: bool = False
    handing_back: bool = False  # a hand-back call is in flight


@dataclass(slots=True)
class _Pending:
    kind: str  # meta | claim | beat | push | handback | giveup
    deadline: float
    transfer: str = ""
    part: int = 0
    agent: str = ""
    sent: float = 0.0


class ConsumerCore:
    """D's handshakes, loads, heartbeats and service step (``Consumer``), over one ledger incarnation."""

    def __init__(self, ledger: TargetLedger, transport: SimTransport, send: Send, *, block_bytes: int,
                 request_timeout_s: float, load_timeout_s: float) -> None:
        self.ledger, self.transport, self.send = ledger, transport, send
        self.block_bytes = block_bytes
        self.request_timeout_s, self.load_timeout_s = request_timeout_s, load_timeout_s
        self.links: dict[str, Link] = {}
        self.epochs = EpochTracker()
        self.loads: dict[str, Load] = {}
        self._by_p_transfer: dict[str, str] = {}
        self.abandoned: dict[str, str] = {}
        self._calls: dict[int, _Pending] = {}
        self._next_call = 0
        self._views: dict[str, tuple[int, int]] = {}  # agent -> (rank, ranks)
        self.note_sinks: list[Callable[[str, Notification], None]] = []  # the notes no load names (a stream's)

    def now(self) -> float:
        return self.ledger.clock.now()

    def _call(self, dst: str, body: object, pending: _Pending) -> None:
        self._next_call += 1
        self._calls[self._next_call] = pending
        pending.agent, pending.sent = dst, self.now()
        self.send(dst, Call(self._next_call, body))

    # -- handshake --------------------------------------------------------------------------------------------------
    def connect(self, agent: str, rank: int, ranks: int, push: bool) -> None:
        self._views[agent] = (rank, ranks)
        link = self.links.setdefault(agent, Link(agent, 0))
        if link.connecting:
            return
        meta = self.transport.local_metadata() if push else None
        self._call(agent, GetMeta(self.transport.agent, self.transport.epoch, meta),
                   _Pending("meta", self.now() + self.request_timeout_s))
        link.connecting = self._next_call

    def _on_meta(self, agent: str, reply: Reply) -> None:
        link = self.links[agent]
        link.connecting = 0
        if not reply.ok or reply.meta is None:
            return
        meta = reply.meta
        change = self.epochs.observe(agent, meta.epoch)
        if change.kind == "stale":
            return
        if change.kind == "restarted":
            for load in self.loads.values():
                if any(p.link_agent == agent and p.grant.agent_epoch < meta.epoch for p in load.parts):
                    load.failed = True
        self.ledger.peer_restarted(meta.agent, meta.epoch)
        peer = self.transport.add_peer(meta)
        rank, ranks = self._views.get(agent, (0, 1))
        view = rank_view(rank, ranks, self.block_bytes)
        link.epoch, link.plan = meta.epoch, self.transport.prepare(peer, local_view=view, remote_view=view)
        self._launch_waiting()

    def ready_for(self, grant: GrantInfo) -> bool:
        link = self.links.get(grant.agent)
        return link is not None and link.plan is not None and link.epoch >= grant.agent_epoch

    # -- loads ------------------------------------------------------------------------------------------------------
    def start(self, request: str, grants: list[GrantInfo], mode: str) -> str:
        """``pull`` / ``request_push``: the load waits for its links, then claims, starts and posts."""
        parts = [Part(g.agent, g, i) for i, g in enumerate(grants)]
        transfer = grants[0].transfer if len(grants) == 1 else f"{request}<-" + "+".join(g.transfer for g in grants)
        if request not in self.ledger.requests:
            raise KeyError(f"request {request!r} is not reserved in the target ledger")
        load = Load(request, transfer, mode, parts, started=self.now(), last_beat=self.now(), size=len(parts))
        self.loads[transfer] = load
        for p in parts:
            self._by_p_transfer[p.grant.transfer] = transfer
        for g in grants:
            if not self.ready_for(g):
                self.connect(g.agent, g.rank, g.ranks, push=mode == "push")
        self._launch_waiting()
        return transfer

    def _launch_waiting(self) -> None:
        for load in list(self.loads.values()):
            if not load.launched and all(self.ready_for(p.grant) for p in load.parts):
                load.launched = True
                self._launch(load)

    def _launch(self, load: Load) -> None:
        self._take(load, load.begin(reserved=load.request in self.ledger.requests))

    def _take(self, load: Load, step: LaunchStep) -> None:
        """Do the launch's next step, as the protocol core ordered it."""
        if step.action == "abandon":
            self._abandon(load, step.reason)
        elif step.action == "claim":
            part = load.parts[step.part]
            self._call(part.link_agent, Heartbeat(part.grant.transfer, part.grant.generation, self.transport.agent,
                                                  self.ledger.hlc.tick()),
                       _Pending("claim", self.now() + self.request_timeout_s, load.transfer, part.index))
        else:
            with self.ledger.step():
                self._start_and_post(load, self.ledger.requests[load.request].blocks)

    def _on_claim(self, load: Load, reply: Reply | None, pending: _Pending) -> None:
        if reply is None:
            self._take(load, load.claim_unanswered("timed out"))
            return
        # a reservation cancelled while claiming (policy fail dropped it) abandons the load
        self._take(load, load.claim_answered(pending.part, ok=reply.ok, detail=reply.detail, sent_at=pending.sent,
                                             ttl_s=load.parts[pending.part].grant.ttl_s,
                                             reserved=load.request in self.ledger.requests))

    def _start_and_post(self, load: Load, blocks: np.ndarray) -> None:
        first = load.parts[0]
        try:
            self.ledger.start_load(load.request, load.transfer, parts=len(load.parts),
                                   generation=first.grant.generation, peer=first.link_agent,
                                   peer_epoch=first.grant.agent_epoch, mode=load.mode)
        except Exception as exc:  # stale peer epoch, or the request left RESERVED: refused and recorded
            self._abandon(load, f"start_load refused: {exc}")
            return
        load.live = True
        for part in load.parts:
            grant = part.grant
            if load.mode == "push":
                self._call(part.link_agent, PushRequest(grant.transfer, grant.generation, self.transport.agent,
                                                        self.transport.epoch, tuple(blocks.tolist()), load.request,
                                                        part.index),
                           _Pending("push", self.now() + self.request_timeout_s, load.transfer, part.index))
                continue
            link = self.links[part.link_agent]
            note = Notification(grant.request, grant.transfer, grant.generation, self.transport.epoch, "done", 0,
                                hlc=self.ledger.hlc.tick())
            try:
                assert link.plan is not None
                load.handles[part.index] = self.transport.post(
                    XferOp.READ, link.plan, blocks, np.asarray(grant.block_ids, dtype=np.int32), notification=note,
                    transfer=grant.transfer)
            except (TransportError, ValueError) as exc:
                self._fail(load, f"post failed: {exc}")
                return
        load.last_beat = self.now()

    def _abandon(self, load: Load, reason: str) -> None:
        load.failed = True
        self.loads.pop(load.transfer, None)
        for p in load.parts:
            self._by_p_transfer.pop(p.grant.transfer, None)
        self.abandoned[load.request] = reason
        if self.ledger.failure_policy == "fail" and load.request in self.ledger.requests:
            self.ledger.cancel(load.request)
        for i in load.hand_back_parts():
            p = load.parts[i]
            self._call(p.link_agent, LoadFailed(p.grant.transfer, p.grant.generation, reason, self.ledger.hlc.tick()),
                       _Pending("handback", self.now() + self.request_timeout_s))

    def _fail(self, load: Load, reason: str, *, wait_siblings: bool = True) -> None:
        """As the Consumer's: while a sibling part's read is in flight the load is ``failing`` (its blocks stay
        LOADING); then the handles are released, the ledger fails the load and every P is told."""
        if load.failed and load.transfer not in self.loads:
            return
        pending = [h for h in load.handles.values() if self.transport.poll(h) is XferStatus.PENDING]
        settle = load.failure(reason, reads_in_flight=len(pending), wait_siblings=wait_siblings)
        if settle is None:
            return
        reason = settle
        load.failed = True
        self.loads.pop(load.transfer, None)
        for handle in load.handles.values():
            with contextlib.suppress(TransportError):
                self.transport.release(handle)
        load.handles.clear()
        if load.transfer in self.ledger.loads:
            self.ledger.fail(load.transfer, reason)
        for p in load.parts:
            self._call(p.link_agent, LoadFailed(p.grant.transfer, p.grant.generation, reason, self.ledger.hlc.tick()),
                       _Pending("handback", self.now() + self.request_timeout_s))

    def _give_up_push(self, load: Load, reason: str) -> None:
        """D cannot tell whether P's write is landing: it hands the lease back and keeps its blocks LOADING until
        P answers (released: fail now; :data:`WRITE_IN_FLIGHT`: P cancels the write and notifies the failure)."""
        load.given_up = load.given_up or reason
        if load.handing_back:
            return
        load.handing_back = True
        for p in load.parts:
            self._call(p.link_agent, LoadFailed(p.grant.transfer, p.grant.generation, load.given_up,
                                                self.ledger.hlc.tick()),
                       _Pending("giveup", self.now() + p.grant.ttl_s, load.transfer, p.index))  # asked again after

    def deadlines(self) -> None:
        """The service thread's deadline check, run when time reaches it: a read that may outlive its lease is
        cancelled and its load failed (P may reuse the blocks it reads)."""
        now = self.now()
        for load in list(self.loads.values()):
            duty = load.duty(now, reading=bool(load.handles), timeout_s=self.load_timeout_s)
            if duty.action == "cancel_reads":
                self._fail(load, duty.reason, wait_siblings=False)
                self.ledger.commit()  # a service step: its records are durable before the next step runs

    def _part_done(self, load: Load, part: int) -> None:
        if not load.part_done(part):
            return
        self.ledger.part_done(load.transfer, part)
        if load.complete:
            self.loads.pop(load.transfer, None)
            for p in load.parts:
                self._by_p_transfer.pop(p.grant.transfer, None)

    # -- replies and notifications ----------------------------------------------------------------------------------
    def on_reply(self, src: str, reply: Reply) -> None:
        pending = self._calls.pop(reply.call, None)
        if pending is None or pending.agent != src:
            return  # a duplicate, or the reply to a call that already timed out
        # the blocking client gave up at its deadline: a reply after it is a timeout (a late reply is dropped)
        self._settle(pending, reply if self.now() < pending.deadline else None)

    def _settle(self, pending: _Pending, reply: Reply | None) -> None:
        if pending.kind == "meta":
            link = self.links.get(pending.agent)
            if link is not None:
                link.connecting = 0
                if reply is not None:
                    self._on_meta(pending.agent, reply)
                elif any(not load.launched and any(p.link_agent == pending.agent for p in load.parts)
                         for load in self.loads.values()):
                    rank, ranks = self._views.get(pending.agent, (0, 1))
                    self.connect(pending.agent, rank, ranks, push=True)  # the engine connects again
            return
        load = self.loads.get(pending.transfer)
        if load is None:
            return
        if pending.kind == "claim":
            self._on_claim(load, reply, pending)
        elif pending.kind == "push" and reply is not None and not reply.ok:
            self._fail(load, f"push refused: {reply.detail}")  # refused before P accepted a write
        elif pending.kind == "push" and reply is None:
            self._settle_by(load, on_push_unanswered(), "push request failed: timed out")
        elif pending.kind == "giveup":
            load.handing_back = False
            if reply is not None and hand_back_settles(reply.ok, reply.detail):
                self._fail(load, load.given_up)
        elif pending.kind == "beat" and reply is not None and reply.ok:
            load.renewals.acknowledged(pending.part, pending.sent, load.parts[pending.part].grant.ttl_s)
        elif pending.kind == "beat" and reply is not None and load.live:
            self._settle_by(load, on_renewal_refused(load.mode, reply.detail), f"lease lost: {reply.detail}")

    def _settle_by(self, load: Load, how: OnRefusal, reason: str) -> None:
        if how == "give_up":
            self._give_up_push(load, reason)
            return
        if how == "drain_then_fail":  # P's notification of the write may be waiting in the inbox already
            self._drain_notes()
        if load.transfer in self.loads:
            self._fail(load, reason)

    def on_note(self, note: Notification) -> None:
        self.transport.inbox.append(("", note))

    def service(self) -> None:
        now = self.now()
        for call_id, pending in list(self._calls.items()):
            if pending.deadline <= now:
                del self._calls[call_id]
                self._settle(pending, None)
        for load in list(self.loads.values()):
            duty = load.duty(now, reading=bool(load.handles), timeout_s=self.load_timeout_s)
            if duty.action == "idle":
                if not load.launched and now - load.started > self.load_timeout_s:
                    self._abandon(load, "no handshake with the producer before the load timeout")
                continue
            if duty.action != "poll":  # a read outlived its lease, a part failed, or a peer restarted
                self._fail(load, duty.reason, wait_siblings=duty.wait_siblings)
                if duty.action == "fail" and load.transfer in self.loads:
                    self._heartbeat(load, now)  # the siblings' leases must outlive their reads
                continue
            for part, handle in list(load.handles.items()):
                status = self.transport.poll(handle)
                if status is XferStatus.PENDING:
                    continue
                if status is XferStatus.FAILED:
                    self._fail(load, f"read failed: {self.transport.error(handle)}")
                    break
                del load.handles[part]
                self._part_done(load, part)
                self.transport.release(handle)
            if load.transfer not in self.loads:
                continue
            if load.after_poll(now, self.load_timeout_s) == "timeout":
                self._settle_by(load, on_load_timeout(load.mode), f"load timed out after {self.load_timeout_s}s")
            elif load.live:
                self._heartbeat(load, now)
        self._drain_notes()
        self.ledger.commit()

    def _drain_notes(self) -> None:
        for _sender, note in self.transport.notifications():
            if note.hlc:
                self.ledger.hlc.observe(note.hlc)
            transfer = self._by_p_transfer.get(note.transfer)
            load = self.loads.get(transfer) if transfer else None
            if load is None:
                for sink in self.note_sinks:
                    sink(_sender, note)
                continue
            if note.kind == "done":
                self._part_done(load, note.part)
            elif note.kind == "failed":
                self._fail(load, f"producer: {note.payload.decode(errors='replace')}")

    def _heartbeat(self, load: Load, now: float) -> None:
        every = beat_every(min(p.grant.ttl_s for p in load.parts))
        due = load.beat(now, every)
        if due == "hand_back":  # handed back: ask again instead of renewing the lease
            self._give_up_push(load, load.given_up)
        if due != "renew":
            return
        for p in load.parts:
            self._call(p.link_agent, Heartbeat(p.grant.transfer, p.grant.generation, self.transport.agent,
                                               self.ledger.hlc.tick()),
                       _Pending("beat", now + every, load.transfer, p.index))

    def busy(self) -> bool:
        return bool(self.loads or self._calls)


def deliver(core: Any, src: str, payload: object) -> None:
    """Hand one delivered message to the core it is for."""
    if isinstance(payload, Call):
        core.on_call(src, payload)
    elif isinstance(payload, Reply):
        core.on_reply(src, payload)
    elif isinstance(payload, NoteMsg):
        core.transport.inbox.append((src, payload.note))
    else:  # pragma: no cover
        raise TypeError(f"unexpected message {payload!r}")
