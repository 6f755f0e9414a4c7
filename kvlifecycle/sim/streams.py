"""Layer-wise streaming in the simulation, over the real stream code: :class:`SimStreamProducer` and
:class:`SimStreamConsumer` *are* :class:`~kvlifecycle.streaming.StreamProducer` and
:class:`~kvlifecycle.streaming.StreamConsumer` (every decision: a reservation taken or declined, which blocks a
layer posts, a block never sent twice, no layer posted once the stream stops, D told of a stop only once every write
settled, the engine's release deferred until then; D's ledger load started before P may write, one
``layers_landed`` per note, ``decline``, cancel), built without their service threads: the scheduler runs their
queued jobs and polls in its steps, and their side-channel calls go through :class:`SimClient`.

What the simulation supplies itself: both sides' clocks (each node's drifting simulated clock: P's write window,
D's stream timeout), the moments the service threads check them (:meth:`SimStreamProducer.deadlines` as time
reaches P's windows, :meth:`SimStreamConsumer.time_out` in D's service step) and the RPC's losses. D times out any
stream, P's held or not: the write window (``kvlifecycle.protocol.bounds``) is what keeps a write out of freed blocks.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import kvlifecycle.streaming.consumer as stream_consumer
from kvlifecycle.control import StreamCancel, StreamRequest
from kvlifecycle.path_selection import PushPath
from kvlifecycle.sidechannel import Ack, SideChannelError
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.streaming.wire import StreamHeartbeat

# RPC losses a step may ask for: "" none, "request" (P never saw it), "reply" (P handled it, D heard nothing)
Loss = Literal["", "request", "reply"]


class SimClient:
    """A blocking side-channel client in the simulation: the call is handled at once by the P it names (the
    caller's thread blocks; nothing else moves meanwhile), unless the link is partitioned or the step lost it."""

    def __init__(self, serve: Callable[[object], Ack], reachable: Callable[[], bool], loss: Callable[[], Loss]):
        self._serve, self._reachable, self._loss = serve, reachable, loss

    def request(self, msg: object, timeout_s: float | None = None) -> Ack:
        loss = self._loss()
        if not self._reachable() or loss == "request":
            raise SideChannelError("no answer (partitioned or lost)")
        ack = self._serve(msg)
        if loss == "reply":
            raise SideChannelError("no answer (reply lost)")
        return ack


class _Producer:
    """What a StreamProducer asks of its Producer: the push paths of the D agents that handshook (the core's one
    transport)."""

    def __init__(self, core: Any) -> None:
        self.ledger, self.transport, self._push_plans = core.ledger, core.transport, core._push_plans

    def push_path(self, agent: str, epoch: int) -> PushPath | None:
        plan = self._push_plans.get((agent, epoch))
        return None if plan is None else PushPath(self.transport, plan.peer, plan)

    def push_refusal(self, agent: str, epoch: int) -> str:
        return "handshake with push metadata first"


class SimStreamProducer(StreamProducer):
    """P's real stream logic, its service thread replaced by :meth:`step`."""

    def __init__(self, core: Any, *, layers: int, options: StreamOptions) -> None:  # no super(): no thread
        self._init_state(_Producer(core), layers=layers, options=options)
        self._now = core.ledger.clock.now  # P's drifting clock
        self._wakeful = True

    def serve(self, msg: object) -> Ack:
        """P's side channel for the stream messages."""
        if isinstance(msg, StreamRequest):
            return self._on_stream_request(msg, b"")
        if isinstance(msg, StreamCancel):
            return self._on_stream_cancel(msg, b"")
        if isinstance(msg, StreamHeartbeat):
            return self._on_heartbeat(msg, b"")
        raise TypeError(f"unexpected stream message {msg!r}")  # pragma: no cover

    def step(self) -> int:
        """One turn of the service thread: the queued jobs (posts, halts, releases), the streams of a D not heard
        for the peer timeout stopped, then a poll of the writes. Returns how many were stopped so."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job()
        unheard = self._unheard()
        self._poll()
        return unheard

    def deadlines(self) -> int:
        """The service thread's poll as time reaches a write window's end (it polls every ms): the writes still in
        flight then are cancelled. Returns how many were."""
        before = self.counts["window_cancelled"]
        if any(s.writes and s.window.closed(self._now()) for s in self._streams.values()):
            self._poll()
        return self.counts["window_cancelled"] - before

    def busy(self) -> bool:
        return bool(self._streams) or not self._jobs.empty()

    def held(self, request: str, agent: str) -> str:
        """The transfer of the stream (or the reservation) of ``request`` into D ``agent`` this P still holds
        ("" : none)."""
        stream = self._streams.get((request, agent))
        if stream is not None:
            return stream.ask.transfer
        reservation = self._reservations.get(request, {}).get(agent)
        return reservation[0].transfer if reservation is not None else ""


@dataclass(frozen=True, slots=True)
class StreamLink:
    """A Consumer's link as a StreamConsumer reads it."""

    agent: str
    epoch: int
    client: SimClient


class _Links:
    """The Consumer's ``links`` as a StreamConsumer reads them (address -> link, or None)."""

    def __init__(self, link_of: Callable[[str], StreamLink | None]) -> None:
        self._link_of = link_of

    def get(self, address: str) -> StreamLink | None:
        return self._link_of(address)


class _ConsumerCore:
    """What a StreamConsumer asks of its Consumer: the links to P, its ledger and its transport."""

    def __init__(self, core: Any, link_of: Callable[[str], StreamLink | None]) -> None:
        self.links, self.ledger, self.transport = _Links(link_of), core.ledger, core.transport


class SimStreamConsumer(StreamConsumer):
    """D's real stream logic, its service thread replaced by :meth:`step` and its clock by the simulation's."""

    def __init__(self, core: Any, link_of: Callable[[str], StreamLink | None], *,
                 options: StreamOptions) -> None:  # no super(): no thread
        self._init_state(_ConsumerCore(core, link_of), options=options)
        self._now = core.now
        self._expect_activity = None  # no transport polling rhythm to hint at
        core.note_sinks.append(self._on_note)

    def step(self) -> int:
        """The queued jobs, then the heartbeat to each P (due every interval of D's clock). Returns how many streams
        ended because their P answered none for the peer timeout."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            job()
        return self._beat()

    def time_out(self, held: Callable[[Any], bool]) -> tuple[int, int]:
        """The service thread's timeout (the real one): a stream with no layer for ``stream_timeout_s`` fails.
        Returns how many timed out, and how many of those P still ``held``."""
        now = self._now()
        late = [s for s in self._streams.values() if now - s.last_progress > self.options.stream_timeout_s]
        still = sum(1 for s in late if held(s))
        return self._time_out(), still

    def busy(self) -> bool:
        return bool(self._streams) or not self._jobs.empty()


def reset_stream_ids() -> None:
    """Stream transfer ids count from 1 in every simulated run (the same seed, the same ids)."""
    stream_consumer._ids = itertools.count(1)
