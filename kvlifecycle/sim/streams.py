"""Layer-wise streaming in the simulation, over the real stream code: :class:`SimStreamProducer` and
:class:`SimStreamConsumer` *are* :class:`~kvlifecycle.streaming.StreamProducer` and
:class:`~kvlifecycle.streaming.StreamConsumer` (every decision: a reservation taken or declined, which blocks a
layer posts, a block never sent twice, no layer posted once the stream stops, D told of a stop only once every write
settled, the engine's release deferred until then; D's ledger load started before P may write, one
``layers_landed`` per note, ``decline``, cancel), built on the simulation's real Producer and Consumer without
their service threads: the scheduler runs their queued jobs and polls in its steps, and their side-channel calls go
through the simulated side channel (:mod:`kvlifecycle.sim.peers`).

What the simulation supplies itself: both sides' clocks (each node's drifting simulated clock: P's write window,
D's stream timeout), the moments the service threads check them (:meth:`SimStreamProducer.deadlines` as time
reaches P's windows, :meth:`SimStreamConsumer.time_out` in D's service step) and the RPC's losses. D times out any
stream, P's held or not: the write window (``kvlifecycle.protocol.bounds``) is what keeps a write out of freed blocks.
"""

from __future__ import annotations

import itertools
import queue
from collections.abc import Callable
from typing import Any, Literal

import kvlifecycle.streaming.consumer as stream_consumer
from kvlifecycle.control import StreamCancel, StreamQuery, StreamRequest
from kvlifecycle.handoff import Consumer, Producer
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.streaming.wire import StreamHeartbeat

# RPC losses a step may ask for: "" none, "request" (P never saw it), "reply" (P handled it, D heard nothing)
Loss = Literal["", "request", "reply"]


class SimStreamProducer(StreamProducer):
    """P's real stream logic, its service thread replaced by :meth:`step`."""

    def __init__(self, producer: Producer, *, layers: int, options: StreamOptions) -> None:  # no super(): no thread
        self._init_state(producer, layers=layers, options=options)
        self._now = producer.ledger.clock.now  # P's drifting clock
        self._wakeful = True
        producer.server.add_handlers({StreamRequest: self._on_stream_request, StreamCancel: self._on_stream_cancel,
                                      StreamQuery: self._on_stream_query, StreamHeartbeat: self._on_heartbeat})

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

    def deadlines(self) -> tuple[int, int]:
        """The service thread's poll as time reaches a write window's end or a D's peer timeout (it polls every
        ms): the writes still in flight then are cancelled. Returns how many windows closed on writes, and how many
        streams of a silent D stopped."""
        before = self.counts["window_cancelled"]
        unheard = self._unheard()
        if any(s.writes and s.window.closed(self._now()) for s in self._streams.values()):
            self._poll()
        return self.counts["window_cancelled"] - before, unheard

    def next_deadline(self) -> float:
        """The earliest write window's end or peer timeout to come (inf: none), in P's clock: the scheduler runs
        :meth:`deadlines` there before time moves past it."""
        limit = self.options.peer_timeout_s
        ends = [s.window.deadline for s in self._streams.values() if s.writes]
        ends += [s.heard + limit for s in self._streams.values() if not s.stopping]
        ends += [heard + limit for heard in self._reservation_heard.values()]
        now = self._now()
        return min((end for end in ends if end > now), default=float("inf"))

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


class SimStreamConsumer(StreamConsumer):
    """D's real stream logic, its service thread replaced by :meth:`step` and its clock by the simulation's."""

    def __init__(self, consumer: Consumer, *, options: StreamOptions) -> None:  # no super(): no thread
        self._init_state(consumer, options=options)
        self._now = consumer._now
        self._expect_activity = None  # no transport polling rhythm to hint at
        consumer.note_sinks.append(self._on_note)
        consumer.peer_lost_sinks.append(
            lambda agent, epoch, reason, may_write: self.peer_lost(agent, reason, before_epoch=epoch + 1,
                                                                   may_write=may_write))

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

    def next_beat(self) -> float:
        """When the service thread's next heartbeat to the P ranks of its streams is due (inf: no stream), in D's
        clock: the scheduler turns D's loop there before time moves past it."""
        if not self._streams:
            return float("inf")
        return self._last_beat + self.options.heartbeat_interval_s

    def busy(self) -> bool:
        return bool(self._streams) or not self._jobs.empty()


def reset_stream_ids() -> None:
    """Stream transfer ids count from 1 in every simulated run (the same seed, the same ids)."""
    stream_consumer._ids = itertools.count(1)
