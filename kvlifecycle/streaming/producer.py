"""P's side of a layer-wise stream: D's reservation arrives before P computes, and each layer leaves as computed.

Flow: D reserves its blocks and sends a :class:`~kvlifecycle.control.StreamRequest` keyed by P's request id.
When P's engine starts the prefill it calls :meth:`StreamProducer.begin`: with the reservation there, the request
streams. Without it the prefill goes on (P's forward never waits for D) and the reservation may still come until
the prefill ends: it then starts the stream with every layer computed so far posted at once (P holds those blocks
until its writes settled, as for any stream), so nobody has to wait for D's reservation before submitting the
prefill. When the prefill ends (:meth:`StreamProducer.prefill_ended`) without one, the request takes the
post-prefill path (pull or push after a grant), the fallback is counted and a reservation arriving later is
declined. After each layer the engine calls :meth:`StreamProducer.layer_done` with the request's blocks whose
tokens are complete for that layer; the call only queues (the forward thread does no transfer work), and the
service thread posts one WRITE of the blocks that layer has not sent yet (a block is never sent twice), its
notification telling D which positions and layer landed. Where the layer's work is still running when the
call returns (a GPU's compute stream), the engine hands a :data:`LayerReady` with it: the service thread waits on
that, bounded, before the post. A readiness that also carries its device event (:class:`DeviceLayerReady`) is not
waited on where the transport orders on the device (:class:`~kvlifecycle.transport.DeviceOrderedPost`): the post
goes out at once, its copy enqueued behind the event.

Ends: a failed post or write, P's abort (:meth:`cancel`) or D's (``StreamCancel``) stop the stream: no new layer
is posted from the moment the stop is known (a cancel stops the stream on the thread that receives it, not behind
the layer posts already queued: those are dropped), and D is told (a ``failed`` note) only once every write in
flight settled, so D never frees a block under a landing write; P's abort of a reservation whose prefill has not
begun tells D at once (nothing was written). :meth:`StreamProducer.status` is what an engine that reports each
request's transfer itself reads (SGLang's sender: reserved → ``WaitingForInput``, complete → ``Success``).
:meth:`release` runs the engine's own release of P's blocks (free or abort in P's ledger) only when no write of the
request is in flight. The request's write window
bounds the stream: P's deadline is its receipt of the request + ``write_window_s``; a prefill begun after it takes
the post-prefill path, no layer is posted at or after it, and the writes still in flight then are cancelled, so D,
whose timeout outlasts the window (:mod:`kvlifecycle.protocol.bounds`), never frees a block a write of P may still
land in. P's ledger records each
settled write (``TransferObserved``), which is what the timeline draws as the per-layer posts.

Several D ranks (D TP > P TP): each D rank's reservation of one request is its own stream (keyed by request and D
agent), posting with its D's push plan (its head slice of P's blocks); the engine-facing calls act on every stream
of the request, and :meth:`StreamProducer.reservations` says how many D ranks reserved.

Paths: each stream posts, polls, releases, cancels and notifies on its D's push path
(:class:`~kvlifecycle.path_selection.PushPath`, picked by the producer's path selector at D's handshake): CUDA IPC
for a D on the same node with VRAM on both sides, else the producer's transport (NIXL). A device-ordered post
(``post_after``) is asked of the stream's own transport.

Liveness: D's :class:`~kvlifecycle.streaming.wire.StreamHeartbeat` names the streams D holds open; a stream whose D
was not heard for ``peer_timeout_s`` (D died, or is cut off) stops exactly as D's cancel stops it (no new post, the
writes in flight are cancelled as at the window's end, then the ``failed`` note), instead of posting on until its
write window ends; a reservation held unbegun is dropped the same way (D frees its blocks after its own timeout).

One concept, longer than most: P's side of a stream (reservations, layer posts, window, settling, stops and
liveness), which shares one lock and one table of streams; the wire, the plans and the bounds live beside it.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamQuery, StreamRequest
from kvlifecycle.digest import DigestError, batch_digest, should_digest
from kvlifecycle.path_selection import PushPath
from kvlifecycle.protocol.bounds import WriteWindow
from kvlifecycle.sidechannel import Ack
from kvlifecycle.streaming.wire import (
    NOTE_FAILED,
    NOTE_LAYERS,
    LayerBatch,
    StreamHeartbeat,
    StreamOptions,
    encode_batch,
    layer_regions,
)
from kvlifecycle.transport import (
    DeviceOrderedPost,
    Notification,
    TransferHandle,
    TransportError,
    XferOp,
    XferStatus,
    cancels_in_flight,
    orders_on_device,
)

log = logging.getLogger("kvlifecycle.streaming")


LayerReady = Callable[[float], bool]
"""Waits up to the given seconds for a layer's KV to be written (e.g. an event after the layer on a GPU's compute
stream); True once it is. Called on the service thread, never the forward's; a False stops the stream as failed."""


@runtime_checkable
class DeviceLayerReady(Protocol):
    """A :data:`LayerReady` that also carries the device event it waits on (opaque here: a CUDA event, say). A
    transport that orders on the device gets ``device_event`` with the post instead of the host waiting."""

    device_event: object

    def __call__(self, timeout_s: float, /) -> bool: ...


# The shortest slice of a host wait for a layer: a window whose writes its transport cannot cancel (they stay in
# flight past it) makes the wait go on in slices this long, not spin.
WINDOW_CHECK_S = 0.001


def _noop() -> None:
    pass


_Key = tuple[str, str]  # (P's request, D agent): one stream per D rank of a request (D TP > P TP: several)
_Held = tuple[StreamRequest, PushPath, float]  # a reservation not begun: D's ask, its push path, when it came


@dataclass(frozen=True, slots=True)
class StreamStatus:
    """What P knows of a request's stream (:meth:`StreamProducer.status`), for an engine that reports each request's
    transfer itself (SGLang's sender polls).

    ``state``: ``none`` (no reservation and no stream), ``reserved`` (D's reservation waits for the prefill),
    ``streaming`` (posts to come or in flight), ``stopping`` (stopped, writes still in flight), ``stopped`` (stopped
    and settled: D was told, or D stopped it), ``complete`` (every reserved block posted and landed)."""

    state: str
    reason: str = ""  # why it stopped
    reserved: int = 0  # D's blocks
    posted: int = 0  # of them posted (in every layer)
    in_flight: int = 0  # writes not settled yet


@dataclass(slots=True)
class _Write:
    handle: TransferHandle
    layer: int
    blocks: int
    cancel_asked: bool = False  # a stop asked to cancel it, and its transport cannot (it is waited for instead)


@dataclass(slots=True)
class _Waiting:
    """A request whose prefill began before D's reservation arrived: the blocks each layer completed so far."""

    since: float
    computed: list[tuple[np.ndarray, LayerReady | None] | None]  # per layer: its blocks and their readiness


@dataclass(slots=True)
class _Stream:
    request: str
    ask: StreamRequest
    path: PushPath  # the transport every write of this stream goes through (and its plan, D's name on it)
    dst: np.ndarray  # D's block ids, token order
    sent: np.ndarray  # per layer: how many of the request's blocks were posted
    window: WriteWindow  # no layer posted at or after its deadline; the writes in flight then are cancelled
    writes: list[_Write] = field(default_factory=list)
    stopping: str = ""  # why no further layer is posted ("" : streaming); set under ``posting``
    posting: threading.RLock = field(default_factory=threading.RLock)  # a post and a stop never interleave
    told: bool = False  # D was told the stream ended without completing
    released: list[Callable[[], None]] = field(default_factory=list)  # the engine's releases, run once settled
    release_asked: bool = False
    heard: float = math.inf  # when D last named this stream (its request, or a heartbeat); inf: not watched


class StreamProducer:
    """Streams the layers of the requests whose D reservation arrived before their prefill began.

    Beside a :class:`~kvlifecycle.handoff.Producer`: serves its stream messages on the producer's side channel and
    writes through each D's push path (the producer's transport, or its fast path), to the D agents that
    handshook with push metadata."""

    def __init__(self, producer: Any, *, layers: int, options: StreamOptions | None = None) -> None:
        self._init_state(producer, layers=layers, options=options)
        # A transport that says when a transfer settles wakes this thread: no tight polling beside P's forward,
        # which shares its cores with it. A fast path without listeners (CUDA IPC) completes, and sends its
        # writes' notifications, only when polled: the tight rhythm then
        fast = getattr(producer, "fast_transport", None)
        transports = [self.transport] if fast is None else [self.transport, fast]
        self._wakeful = all(hasattr(t, "add_completion_listener") for t in transports)
        for transport in transports:
            add_listener = getattr(transport, "add_completion_listener", None)
            if add_listener is not None:
                add_listener(lambda _handle: self._jobs.put(_noop))
        producer.server.add_handlers({StreamRequest: self._on_stream_request, StreamCancel: self._on_stream_cancel,
                                      StreamQuery: self._on_stream_query, StreamHeartbeat: self._on_heartbeat})
        self._thread = threading.Thread(target=self._serve, name=f"stream-{self.transport.agent}", daemon=True)
        self._thread.start()

    def _init_state(self, producer: Any, *, layers: int, options: StreamOptions | None) -> None:
        """Everything but the thread and the side-channel handlers (a deterministic driver stops here)."""
        self.producer, self.ledger, self.transport = producer, producer.ledger, producer.transport
        self.layers = layers
        self.options = options or StreamOptions()
        self._regions = layer_regions(layers, self.options.regions_per_layer)
        # a layer's device event rides with its post where the stream's transport orders on the device (False:
        # every readiness is waited on the host, as for NIXL; a measurement's baseline)
        self._order_on_device = True
        self._now: Callable[[], float] = time.monotonic  # the clock of every reservation, window and sweep
        self._reservations: dict[str, dict[str, _Held]] = {}  # request -> D agent -> its reservation, unbegun
        self._reservation_heard: dict[_Key, float] = {}  # when D last named its held reservation
        # prefills under way: the layers computed so far, on which a reservation arriving meanwhile catches up
        self._waiting: dict[str, _Waiting] = {}
        self._plain: dict[str, float] = {}  # prefills ended without a reservation: a late one is declined
        self._cancelled: dict[str, tuple[str, float]] = {}  # reservations D cancelled unbegun: (why, when)
        self._voided: dict[tuple[str, bytes], float] = {}  # (request, token) D gave up on: its reservation is declined
        self._streams: dict[_Key, _Stream] = {}
        self._by_request: dict[str, dict[str, _Stream]] = {}  # the same streams by request: layer_done's lookup
        self.counts = {"streamed": 0, "joined_late": 0, "fallback": 0, "declined": 0, "layers_posted": 0,
                       "writes_failed": 0, "cancelled_by_d": 0, "window_cancelled": 0, "peer_timed_out": 0,
                       "peer_cancelled": 0, "heartbeats": 0, "waited_uncancellable": 0}
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stop = threading.Event()

    # -- engine-facing (any thread; nothing here waits on the network) -----------------------------------------
    def begin(self, request: str) -> bool:
        """P's prefill of ``request`` starts: True if it streams now (a D reservation is here, its window open: every
        D rank's reservation held starts its stream). False: it does not stream yet; a reservation arriving before
        :meth:`prefill_ended` still starts a stream (as does another D rank's, arriving after the first began)."""
        now = self._now()
        with self._lock:
            started = 0
            for agent, (ask, path, at) in self._reservations.pop(request, {}).items():
                heard = self._reservation_heard.pop((request, agent), now)
                window = WriteWindow.received(at, ask.write_window_s)
                if window.closed(now):  # its window ended meanwhile
                    continue
                self._start(request, ask, path, window).heard = heard
                started += 1
            if request not in self._plain:
                self._waiting.setdefault(request, _Waiting(now, [None] * self.layers))
            return started > 0

    def prefill_ended(self, request: str, *, aborted: bool = False) -> bool:
        """P's prefill of ``request`` ended: True if it streams (release it with :meth:`release`). False: no
        reservation came in time; the post-prefill path serves it (counted as a fallback unless ``aborted``) and a
        reservation arriving later is declined."""
        with self._lock:
            self._waiting.pop(request, None)
            if self._of(request):
                return True
            if not aborted:
                self.counts["fallback"] += 1
            self._plain[request] = self._now()
            return False

    def _start(self, request: str, ask: StreamRequest, path: PushPath, window: WriteWindow) -> _Stream:
        """(Under ``_lock``.) The stream of ``request`` into D's reservation ``ask``."""
        stream = _Stream(request, ask, path, np.asarray(ask.blocks, dtype=np.int32),
                         np.zeros(self.layers, dtype=np.int64), window, heard=self._now())
        self._add(stream)
        self.counts["streamed"] += 1
        return stream

    def _add(self, stream: _Stream) -> None:
        """(Under ``_lock``.)"""
        self._streams[(stream.request, stream.ask.agent)] = stream
        self._by_request.setdefault(stream.request, {})[stream.ask.agent] = stream

    def _remove(self, stream: _Stream) -> None:
        """(Under ``_lock``.)"""
        self._streams.pop((stream.request, stream.ask.agent), None)
        of_request = self._by_request.get(stream.request)
        if of_request is not None:
            of_request.pop(stream.ask.agent, None)
            if not of_request:
                del self._by_request[stream.request]

    def _of(self, request: str) -> list[_Stream]:
        """(Under ``_lock``.) The streams of ``request``, one per D rank."""
        of_request = self._by_request.get(request)
        return list(of_request.values()) if of_request else []

    def streaming(self, request: str) -> bool:
        with self._lock:
            return bool(self._of(request))

    def reservations(self, request: str) -> int:
        """How many D ranks' reservations for ``request`` are held or streaming: an engine expecting several (D TP >
        P TP) can wait for all of them before it prefills."""
        with self._lock:
            return len(self._reservations.get(request, {})) + sum(1 for s in self._of(request) if not s.stopping)

    def reserving_agents(self, request: str) -> tuple[str, ...]:
        """The D agents whose reservations for ``request`` are held or streaming (those :meth:`reservations`
        counts): an engine reads each one's TP size off the handshake (:meth:`Producer.peer_tp_size`)."""
        with self._lock:
            held = list(self._reservations.get(request, {}))
            return tuple(held + [s.ask.agent for s in self._of(request) if not s.stopping])

    def layer_done(self, request: str, layer: int, blocks: Sequence[int] | np.ndarray,
                   ready: LayerReady | None = None) -> None:
        """Layer ``layer`` of ``request`` is computed for ``blocks``: P's block ids of the request in token order,
        those whose tokens are all computed for this layer (with chunked prefill, a growing prefix; at the last
        chunk, every block). Queues the post of the blocks this layer has not sent (kept for a late reservation
        while the request does not stream yet); returns at once. ``ready``: the layer's work may still be running;
        the post waits for it (``None``: the KV is written already)."""
        ids = np.array(blocks, dtype=np.int32)  # a copy: the engine may reuse its list
        with self._lock:  # against a reservation joining meanwhile: it catches up on this layer, or its post is here
            waiting = self._waiting.get(request)
            if waiting is not None and 0 <= layer < self.layers:
                waiting.computed[layer] = (ids, ready)
            for stream in self._of(request):
                self._jobs.put(functools.partial(self._post_layer, stream, int(layer), ids, ready))

    def cancel(self, request: str, reason: str = "aborted on P") -> None:
        """Post no further layer of ``request``; D is told once the writes in flight settled. A reservation whose
        prefill has not begun ends too, D told at once (no byte was written): it does not wait for its timeout."""
        with self._lock:
            streams = self._of(request)
            for agent, (ask, path, at) in self._reservations.pop(request, {}).items():
                # a stream stopped before its first layer: settling it sends D the failed note
                self._reservation_heard.pop((request, agent), None)
                stream = _Stream(request, ask, path, np.asarray(ask.blocks, dtype=np.int32),
                                 np.zeros(self.layers, dtype=np.int64), WriteWindow.received(at, ask.write_window_s))
                self._add(stream)
                streams.append(stream)
        for stream in streams:
            self._stop_posting(stream, reason)
            self._jobs.put(functools.partial(self._settle, stream))

    def status(self, request: str) -> StreamStatus:
        """Where ``request``'s stream stands (any thread; a snapshot). Streamed to several D ranks: ``stopping`` or
        ``stopped`` if any of them is (its reason), ``complete`` once all are; counts summed (``in_flight``) or the
        least of them (``posted``)."""
        with self._lock:
            held = list(self._reservations.get(request, {}).values())
            streams = self._of(request)
            cancelled = self._cancelled.get(request)
        if not streams:
            if held:
                return StreamStatus("reserved", reserved=max(len(ask.blocks) for ask, _, _ in held))
            return StreamStatus("stopped", cancelled[0]) if cancelled is not None else StreamStatus("none")
        each = [self._status_of(stream) for stream in streams]
        if len(each) == 1 and not held:
            return each[0]
        reserved, posted = max(e.reserved for e in each), min(e.posted for e in each)
        in_flight = sum(e.in_flight for e in each)
        for state in ("stopping", "stopped"):
            worst = [e for e in each if e.state == state]
            if worst:
                return StreamStatus(state, worst[0].reason, reserved, posted, in_flight)
        state = "complete" if not held and all(e.state == "complete" for e in each) else "streaming"
        return StreamStatus(state, "", reserved, posted, in_flight)

    @staticmethod
    def _status_of(stream: _Stream) -> StreamStatus:
        in_flight, size = len(stream.writes), int(stream.dst.size)
        posted = int(stream.sent.min()) if stream.sent.size else 0
        if stream.stopping:
            return StreamStatus("stopping" if in_flight else "stopped", stream.stopping, size, posted, in_flight)
        state = "complete" if not in_flight and posted >= size else "streaming"
        return StreamStatus(state, "", size, posted, in_flight)

    def release(self, request: str, then: Callable[[], None]) -> None:
        """The engine is done with ``request`` on P: ``then`` (its release of the blocks in P's ledger) runs once
        no write of the request's streams (one per D rank) is in flight, on the service thread (at once for a
        request that did not stream). A stream released before every layer of every reserved block was posted is
        ended as failed for its D."""
        with self._lock:
            self._plain.pop(request, None)
            for agent in self._reservations.pop(request, {}):
                self._reservation_heard.pop((request, agent), None)
            self._waiting.pop(request, None)
            self._cancelled.pop(request, None)
            streams = self._of(request)
        if not streams:
            then()
            return
        unsettled = [len(streams)]

        def one_settled() -> None:  # the service thread runs every settle: no race on the count
            unsettled[0] -= 1
            if not unsettled[0]:
                then()

        def job() -> None:
            for stream in streams:
                stream.released.append(one_settled)
                stream.release_asked = True
                short = np.flatnonzero(stream.sent < stream.dst.size).tolist()
                if not stream.stopping and short:
                    self._halt(stream, f"prefill ended with layers {short} short of D's {stream.dst.size} blocks")
                else:
                    self._settle(stream)

        self._jobs.put(job)

    def pending(self) -> int:
        """Streams not yet settled and released."""
        return len(self._streams)

    # -- side channel (short) ----------------------------------------------------------------------------------
    def _on_stream_request(self, msg: StreamRequest, _peer: bytes) -> Ack:
        path: PushPath | None = self.producer.push_path(msg.agent, msg.epoch)
        if path is None:
            return self._declined(f"push unavailable: {self.producer.push_refusal(msg.agent, msg.epoch)}")
        regions = path.plan.num_regions
        if msg.layers != self.layers or regions != self.layers * self.options.regions_per_layer:
            return self._declined(f"layers: D streams {msg.layers}, P has {self.layers} over {regions} "
                                  f"regions ({self.options.regions_per_layer} per layer)")
        if len(msg.token) != TOKEN_BYTES:
            return self._declined(f"token must be {TOKEN_BYTES} bytes")
        key, now = (msg.request, msg.agent), self._now()
        with self._lock:
            under_way = self._streams.get(key)
            if under_way is not None:
                if under_way.ask.transfer == msg.transfer:
                    return Ack(True, "duplicate: this stream is already under way")
                return self._declined("another stream of this request into this D is under way")
            held = self._reservations.get(msg.request, {}).get(msg.agent)
            if held is not None:
                return Ack(held[0].transfer == msg.transfer, "duplicate reservation")
            if (msg.request, msg.token) in self._voided:
                return self._declined("cancelled by D (or D timed out) before it arrived: the post-prefill path "
                                      "serves it")
            if msg.request in self._plain:
                return self._declined("prefill began without this reservation: the post-prefill path serves it")
            waiting = self._waiting.get(msg.request)
            if waiting is None:
                if self._of(msg.request):  # the prefill ended, streaming into other D ranks
                    return self._declined("prefill ended before this reservation: the post-prefill path serves it")
                self._reservations.setdefault(msg.request, {})[msg.agent] = (msg, path, now)  # the window starts
                self._reservation_heard[key] = now
                return Ack(True)
            # the prefill is under way: catch up on its layers, within the window that starts now
            stream = self._start(msg.request, msg, path, WriteWindow.received(now, msg.write_window_s))
            self.counts["joined_late"] += 1
            for layer, computed in enumerate(waiting.computed):
                if computed is not None:  # queued under the lock: before any later post of the same layer
                    self._jobs.put(functools.partial(self._post_layer, stream, layer, *computed))
        return Ack(True)

    def _on_stream_query(self, msg: StreamQuery, _peer: bytes) -> Ack:
        with self._lock:
            return Ack(bool(self._reservations.get(msg.request)) or bool(self._of(msg.request)))

    def _on_heartbeat(self, msg: StreamHeartbeat, _peer: bytes) -> Ack:
        """D ``msg.agent`` holds the streams named: each is heard now. The answer tells D that this P is alive."""
        now, named = self._now(), set(msg.tokens)
        with self._lock:
            for stream in self._streams.values():
                if stream.ask.agent == msg.agent and stream.ask.epoch == msg.epoch and stream.ask.token in named:
                    stream.heard = now
            for request, held in self._reservations.items():
                ask = held[msg.agent][0] if msg.agent in held else None
                if ask is not None and ask.epoch == msg.epoch and ask.token in named:
                    self._reservation_heard[(request, msg.agent)] = now
        self.counts["heartbeats"] += 1
        return Ack(True, str(self.transport.epoch))

    def _unheard(self) -> int:
        """Stop the streams whose D was not heard for ``peer_timeout_s``, as D's cancel would. Returns how many."""
        now, limit = self._now(), self.options.peer_timeout_s
        with self._lock:
            late = [s for s in self._streams.values() if not s.stopping and now - s.heard > limit]
            # a held reservation of a silent D goes as D's cancel of it goes: D may free those blocks soon
            for key in [k for k, heard in self._reservation_heard.items() if now - heard > limit]:
                del self._reservation_heard[key]
                ask = self._drop_reservation(*key)
                if ask is not None:  # the same ask, if it comes again, is declined
                    self._voided[(ask.request, ask.token)] = now
                    self._cancelled[ask.request] = (f"peer timeout: D {ask.agent} not heard for {limit:g} s", now)
                    self.counts["peer_timed_out"] += 1
        for stream in late:
            self.counts["peer_timed_out"] += 1
            self._stop_posting(stream, f"peer timeout: D {stream.ask.agent} not heard for {limit:g} s")
            # cut off rather than dead, D frees the blocks soon after its own peer timeout: the writes in flight
            # are cancelled as at the window's end (moving no byte after STREAM_SETTLE_S), then settle
            with stream.posting:
                self._cancel_in_flight(stream, "peer_cancelled")
            self._settle(stream)
        return len(late)

    def _drop_reservation(self, request: str, agent: str) -> StreamRequest | None:
        """(Under ``_lock``.) Take D ``agent``'s held reservation of ``request`` out; its ask, if there was one."""
        held = self._reservations.get(request, {})
        entry = held.pop(agent, None)
        if not held:
            self._reservations.pop(request, None)
        return entry[0] if entry is not None else None

    def _declined(self, why: str) -> Ack:
        self.counts["declined"] += 1
        return Ack(False, why)

    def _on_stream_cancel(self, msg: StreamCancel, _peer: bytes) -> Ack:
        """``settled``: nothing was or will be written for this stream (D may free at once); ``settling``: a
        ``failed`` note follows once the writes in flight settled."""
        now = self._now()
        with self._lock:
            for agent, (ask, _, _) in list(self._reservations.get(msg.request, {}).items()):
                if ask.transfer == msg.transfer and ask.token == msg.token:
                    self._drop_reservation(msg.request, agent)
                    self._reservation_heard.pop((msg.request, agent), None)
                    self._voided[(msg.request, msg.token)] = now  # the same ask, delayed, is declined
                    self._cancelled[msg.request] = (f"cancelled by D: {msg.reason}", now)
                    return Ack(True, "settled")
            streams = [s for s in self._of(msg.request) if s.ask.transfer == msg.transfer]
            stream = next((s for s in streams if s.ask.token == msg.token), None)
            if stream is None:  # an ask delayed past this cancel must not start a stream D freed
                self._voided[(msg.request, msg.token)] = now
        if not streams:
            return Ack(True, "settled")
        if stream is None:
            return Ack(False, "stream token: not this stream's")
        self.counts["cancelled_by_d"] += 1
        self._stop_posting(stream, f"cancelled by D: {msg.reason}")
        self._jobs.put(lambda: self._settle(stream))
        return Ack(True, "settling")

    # -- service thread ----------------------------------------------------------------------------------------
    def _post_layer(self, stream: _Stream, layer: int, src: np.ndarray, ready: LayerReady | None = None) -> None:
        if stream.stopping:
            return  # no new layer once a stream stops
        if stream.window.closed(self._now()):
            self._halt(stream, f"write window of {stream.ask.write_window_s:g} s ended before layer {layer}")
            return
        if not 0 <= layer < self.layers:
            self._halt(stream, f"layer {layer} not in [0, {self.layers})")
            return
        # a post before the layer's KV is written would carry stale bytes to D: order the copy after the layer's
        # event on the device where the transport can, else wait on the host, at most as long as D does (outside
        # the posting lock: a cancel never waits for a layer's compute)
        ordered = (self._order_on_device and isinstance(ready, DeviceLayerReady)
                   and orders_on_device(stream.path.transport))
        after = ready.device_event if ordered else None  # type: ignore[union-attr]  # a DeviceLayerReady
        if ready is not None and after is None:
            wait_s = min(self.options.stream_timeout_s, stream.window.left(self._now()))
            try:
                written = self._wait_for_layer(ready, wait_s)
            except Exception as exc:  # the engine's callable (a device error, say): this stream fails, not the thread
                self._halt(stream, f"waiting for layer {layer} failed: {exc!r}")
                return
            if not written:
                self._halt(stream, f"layer {layer} not computed within {wait_s:g} s")
                return
            if stream.window.closed(self._now()):  # the wait took the rest of the window
                self._halt(stream, f"write window of {stream.ask.write_window_s:g} s ended before layer {layer}")
                return
        with stream.posting:
            if not stream.stopping:
                self._post_layer_unguarded(stream, layer, src, after)

    def _wait_for_layer(self, ready: LayerReady, wait_s: float) -> bool:
        """Wait on the host, at most ``wait_s``, for a layer's KV; meanwhile every other stream's window still closes
        on time (its writes in flight cancelled at its end): one stream's wait for its layer must not keep another's
        writes past its window. Waits in slices that end at the nearest window deadline of writes in flight."""
        end = self._now() + wait_s
        while True:
            now = self._now()
            due = [s.window.deadline for s in list(self._streams.values()) if s.writes]
            if ready(max(min([end - now, *(d - now for d in due)]), WINDOW_CHECK_S)):
                return True
            if self._now() >= end:
                return False
            self._close_due_windows()

    def _close_due_windows(self) -> None:
        now = self._now()
        for stream in list(self._streams.values()):
            if stream.writes and stream.window.closed(now):
                self._close_window(stream)

    def _post_layer_unguarded(self, stream: _Stream, layer: int, src: np.ndarray, after: object | None) -> None:
        lo, hi = int(stream.sent[layer]), int(src.size)
        if hi <= lo:
            return
        if hi > stream.dst.size:
            self._halt(stream, f"P holds {hi} blocks, D reserved {stream.dst.size}")
            return
        ask, via, plan = stream.ask, stream.path.transport, stream.path.plan
        digest = self._batch_digest(stream, layer, src[lo:hi]) if after is None else None
        note = Notification(ask.transfer, ask.transfer, 0, via.epoch, NOTE_LAYERS, ask.part,
                            encode_batch(ask.token, LayerBatch(layer, 1, lo, hi, digest)), hlc=self.ledger.hlc.tick())
        try:
            if after is not None:
                ordered = cast(DeviceOrderedPost, via)  # ``after`` is set only where the transport orders so
                handle = ordered.post_after(after, XferOp.WRITE, plan, src[lo:hi], stream.dst[lo:hi],
                                            regions=self._regions[layer], notification=note, transfer=ask.transfer)
            else:
                handle = via.post(XferOp.WRITE, plan, src[lo:hi], stream.dst[lo:hi], regions=self._regions[layer],
                                  notification=note, transfer=ask.transfer)
        except (TransportError, ValueError) as exc:
            self._halt(stream, f"post of layer {layer} failed: {exc}")
            return
        stream.sent[layer] = hi
        stream.writes.append(_Write(handle, layer, hi - lo))
        self.counts["layers_posted"] += 1

    def _batch_digest(self, stream: _Stream, layer: int, blocks: np.ndarray) -> int | None:
        """The layer batch's digest when verification chooses the stream (the Producer's ``verify`` and digester):
        over the layer's regions of the blocks, as the write's plan cuts them. Only for bytes final on the host
        (not a write ordered after a device event, whose layer may still be computing) and whole blocks (not
        sub-blocks of a block-size split): else None, and D loads the batch unchecked."""
        digester, view = self.producer.digester, stream.path.plan.local_view
        if digester is None or view.split != 1 or not should_digest(self.producer.options.verify,
                                                                    stream.ask.transfer):
            return None
        try:
            return batch_digest(digester.digests(blocks, offset=view.offset, length=view.length,
                                                 only=self._regions[layer].tolist()))
        except (DigestError, IndexError) as exc:  # blocks or regions the digester cannot read: the batch goes unchecked
            log.warning("stream %s: layer %d not digested: %s", stream.ask.transfer, layer, exc)
            return None

    def _halt(self, stream: _Stream, reason: str) -> None:
        self._stop_posting(stream, reason)
        self._settle(stream)

    @staticmethod
    def _stop_posting(stream: _Stream, reason: str) -> None:
        """No layer of ``stream`` is posted after this returns (any thread; it waits for at most the post under
        way, which does not wait on the network). The first reason stays."""
        with stream.posting:
            if not stream.stopping:
                log.info("stream %s of %s stops: %s", stream.ask.transfer, stream.request, reason)
                stream.stopping = reason

    def _poll(self) -> None:
        self._close_due_windows()
        for stream in list(self._streams.values()):
            still, via = [], stream.path.transport
            for write in stream.writes:
                status = via.poll(write.handle)
                if status is XferStatus.PENDING:
                    still.append(write)
                    continue
                stats = via.stats(write.handle)
                if stats is not None:
                    self.ledger.observe_transfer_stats(stream.ask.transfer, stats, ok=status is XferStatus.DONE)
                if status is XferStatus.FAILED:
                    self.counts["writes_failed"] += 1
                    self._stop_posting(stream, f"write of layer {write.layer} failed: "
                                               f"{via.error(write.handle)}")
                via.release(write.handle)
            stream.writes = still
            self._settle(stream)

    def _close_window(self, stream: _Stream) -> None:
        """The window ended with writes in flight: cancel them (a released pending handle moves no further byte;
        a copy its transport cannot cancel is waited for, a device copy's milliseconds), so every write of the
        stream settled before D's timeout may free the blocks."""
        stream.stopping = stream.stopping or f"write window of {stream.ask.write_window_s:g} s ended in flight"
        self._cancel_in_flight(stream, "window_cancelled")

    def _cancel_in_flight(self, stream: _Stream, counter: str) -> None:
        still, via = [], stream.path.transport
        cancels = cancels_in_flight(via)
        for write in stream.writes:
            if via.poll(write.handle) is not XferStatus.PENDING:
                still.append(write)  # settled: the poll that follows records it
            elif cancels:
                via.release(write.handle)
                self.counts[counter] += 1
            else:  # a copy that runs to its end (CUDA IPC): D hears of the stop only once it ended
                if not write.cancel_asked:
                    write.cancel_asked = True
                    self.counts["waited_uncancellable"] += 1
                still.append(write)
        stream.writes = still

    def _settle(self, stream: _Stream) -> None:
        """Once nothing of ``stream`` is in flight: tell D of a stop, and run the engine's releases."""
        if stream.writes:
            return
        if stream.stopping and not stream.told:
            stream.told = True
            ask, via = stream.ask, stream.path.transport
            note = Notification(ask.transfer, ask.transfer, 0, via.epoch, NOTE_FAILED, ask.part,
                                ask.token + stream.stopping.encode()[:512], hlc=self.ledger.hlc.tick())
            try:  # on the stream's path, after its writes' notes: D drains both of its transports
                via.send_notification(stream.path.peer, note)
            except TransportError as exc:  # D's stream then times out
                log.warning("could not tell %s that stream %s stopped: %s", stream.path.peer, ask.transfer, exc)
        if stream.release_asked:
            with self._lock:
                self._remove(stream)
            for then in stream.released:
                try:
                    then()
                except Exception:
                    log.exception("release of %s after its stream failed", stream.request)
            stream.released.clear()

    def _sweep(self) -> None:
        now = self._now()
        with self._lock:
            stale = [(r, a) for r, held in self._reservations.items() for a, (ask, _, at) in held.items()
                     if now - at > min(self.options.reservation_ttl_s, ask.write_window_s)]
            for request, agent in stale:
                self._drop_reservation(request, agent)
            for key in [k for k in self._reservation_heard if k[1] not in self._reservations.get(k[0], {})]:
                del self._reservation_heard[key]  # its reservation began, was cancelled or released
            for void in [k for k, at in self._voided.items() if now - at > self.options.reservation_ttl_s]:
                del self._voided[void]
            for request in [r for r, at in self._plain.items() if now - at > self.options.reservation_ttl_s]:
                del self._plain[request]
            for request in [r for r, (_, at) in self._cancelled.items() if now - at > self.options.reservation_ttl_s]:
                del self._cancelled[request]
            for request in [r for r, w in self._waiting.items() if now - w.since > self.options.reservation_ttl_s]:
                del self._waiting[request]  # a prefill whose end the engine never reported
        if stale:
            log.info("dropped %d stream reservation(s) no prefill began in %.0fs", len(stale),
                     self.options.reservation_ttl_s)

    def _serve(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            busy = not self._wakeful and any(s.writes for s in list(self._streams.values()))
            try:
                job = self._jobs.get(timeout=self.options.service_poll_s if busy else self.options.idle_poll_s)
                job()
                while True:  # a forward pass queues one job per layer: take all that are there
                    self._jobs.get_nowait()()
            except queue.Empty:
                pass
            except Exception:
                log.exception("stream job failed")
            try:
                self._unheard()
                self._poll()
                if time.monotonic() - last_sweep > 1.0:
                    self._sweep()
                    last_sweep = time.monotonic()
            except Exception:
                log.exception("stream service step failed")

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
