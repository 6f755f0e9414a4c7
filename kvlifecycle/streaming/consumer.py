"""D's side of a layer-wise stream: the reservation goes to P before P computes, and the blocks fill layer by layer.

:meth:`StreamConsumer.request_stream` starts the load in D's ledger first (``layers=n``: the blocks are LOADING
from the moment P may write into them), then sends the :class:`~kvlifecycle.control.StreamRequest` and waits for
P's answer (one side-channel round trip, the caller's thread). A declined stream (P's prefill began first, or push
is unavailable) goes back to RESERVED through the ledger's ``decline``: the caller takes its post-prefill path
into the same blocks. Each ``layers`` note, carrying the stream's token, is one ``layers_landed`` in the ledger,
whose last one makes the blocks READY_FOR_ATTENTION; a ``failed`` note (sent by P once its writes settled) fails
the load under the ledger's failure policy.

Cancel: the ledger's cancel leaves the LOADING blocks pending, P is asked to stop, and the blocks are freed when
the stream settles (P's ``failed`` note, or P's answer that nothing was ever written). P lost: a stream that makes
no progress for ``stream_timeout_s`` fails. The request carries ``write_window_s``, the bound on P's writes: the
timeout's clock starts once P answered (after P's receipt, where its window starts) or the request failed, and the
options refuse a timeout that does not outlast the window (:mod:`kvlifecycle.protocol.bounds`), so a timed-out
stream's blocks are freed only after every write of P settled or was cancelled.

Liveness: every ``heartbeat_interval_s`` the service thread sends each P that writes one of this D's streams one
:class:`~kvlifecycle.streaming.wire.StreamHeartbeat` naming them (its wait bounded by the interval), which keeps
them alive on P; the streams of a P that answered none for ``peer_timeout_s`` end as :meth:`peer_lost` ends them,
well before the stream timeout.
"""

from __future__ import annotations

import functools
import hmac
import itertools
import logging
import math
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamRequest
from kvlifecycle.protocol.bounds import STREAM_MARGIN_FRACTION, STREAM_SETTLE_S
from kvlifecycle.sidechannel import SideChannelError, SideChannelRefused
from kvlifecycle.streaming.wire import NOTE_FAILED, NOTE_LAYERS, StreamHeartbeat, StreamOptions, decode_batch
from kvlifecycle.transport import Notification
from kvlifecycle.untrusted import RateLimitedLog

log = logging.getLogger("kvlifecycle.streaming")
_ids = itertools.count(1)
DECLINES_KEPT = 1024  # the reasons of the latest declines, for an engine that reports them per request


def _noop() -> None:
    pass


@dataclass(slots=True)
class _Stream:
    request: str
    source: str  # P's name for the request
    transfer: str
    link: Any  # the PeerLink of the P rank that writes
    token: bytes
    blocks: np.ndarray  # D's block ids, token order
    part: int
    last_progress: float
    cancel_sent: bool = False
    answered: float = math.inf  # when P last answered for this stream (its request, or a heartbeat)


class StreamConsumer:
    """Asks P ranks to stream requests into this D's reservations, beside a :class:`~kvlifecycle.handoff.Consumer`
    (its ledger, transport and links; it hands this streamer the notes no load of its own names)."""

    def __init__(self, consumer: Any, *, options: StreamOptions | None = None) -> None:
        self._init_state(consumer, options=options)
        consumer.note_sinks.append(self._on_note)
        # A layer's note is on T_visible's path: the transport wakes the Consumer that dispatches notes when one
        # arrives (else found at its next idle poll, up to 5 ms later), and, while a stream is under way, polls
        # the network at its busy rhythm (``expect_activity``) rather than its idle one
        add_listener = getattr(self.transport, "add_notification_listener", None)
        if add_listener is not None:
            add_listener(lambda: consumer._jobs.put(_noop))  # a job wakes the Consumer's service thread
        self._expect_activity = getattr(self.transport, "expect_activity", None)
        self._thread = threading.Thread(target=self._serve, name=f"stream-{self.transport.agent}", daemon=True)
        self._thread.start()

    def _init_state(self, consumer: Any, *, options: StreamOptions | None) -> None:
        """Everything but the thread and the transport's wake-ups (a deterministic driver stops here)."""
        self.consumer, self.ledger, self.transport = consumer, consumer.ledger, consumer.transport
        self.options = options or StreamOptions()
        self._now: Callable[[], float] = time.monotonic  # the clock of the stream timeout
        self._streams: dict[str, _Stream] = {}  # D transfer -> stream
        self._lock = threading.Lock()
        self.declines: OrderedDict[str, str] = OrderedDict()  # request -> why P declined its stream, newest last
        self.counts = {"requested": 0, "declined": 0, "completed": 0, "failed": 0, "timed_out": 0, "forged": 0,
                       "peer_lost": 0, "heartbeats_unanswered": 0}
        self._last_beat = -math.inf
        self._log_forged = RateLimitedLog(log)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()

    # -- engine-facing -----------------------------------------------------------------------------------------
    def request_stream(self, request: str, address: str, *, layers: int, source_request: str | None = None,
                       part: int = 0) -> str | None:
        """Ask the P rank at ``address`` (connected with push metadata) to stream ``source_request`` (default:
        ``request``) into ``request``'s reserved blocks. Returns the stream's transfer id, or ``None`` when P
        declined (``declines[request]`` says why): the reservation is RESERVED again, for the post-prefill path."""
        link = self.consumer.links.get(address)
        if link is None:
            raise ValueError(f"connect to {address} first")
        blocks = self.ledger.requests[request].blocks.copy()
        transfer = f"stream:{request}:{next(_ids)}"
        token = secrets.token_bytes(TOKEN_BYTES)
        # LOADING before P may write a byte into these blocks
        self.ledger.start_load(request, transfer, parts=1, mode="push", layers=layers, peer=link.agent,
                               peer_epoch=link.epoch)
        source = source_request or request
        # no timeout while the request is out (P's window may begin at any point of it): its clock starts after
        stream = _Stream(request, source, transfer, link, token, blocks, part, math.inf)
        with self._lock:
            self._streams[transfer] = stream
        self.counts["requested"] += 1
        self._keep_transport_busy()
        ask = StreamRequest(source, transfer, self.transport.agent, self.transport.epoch,
                            blocks.tolist(), layers, token, self.options.write_window_s, part)
        try:
            ack = link.client.request(ask)
        except SideChannelError as exc:  # P may hold it or not: ask it to stop, and settle on its answer
            stream.last_progress = self._now()  # P's window began before now, if at all: the timeout starts here
            log.warning("stream request %s to %s failed: %s", transfer, address, exc)
            why = f"stream request failed: {exc}"
            self._jobs.put(lambda: self._send_cancel(stream, why))
            return transfer
        if not ack.ok:
            with self._lock:
                self._streams.pop(transfer, None)
            self.ledger.decline(transfer, ack.detail)
            self.counts["declined"] += 1
            self.declines[request] = ack.detail
            while len(self.declines) > DECLINES_KEPT:
                self.declines.popitem(last=False)
            return None
        stream.last_progress = stream.answered = self._now()  # P's window began before its answer: the timeout starts
        return transfer

    def cancel(self, request: str, reason: str = "cancelled on D") -> bool:
        """Cancel ``request`` (D abort, client gone): its blocks are freed once P's writes settled."""
        ok = bool(self.ledger.cancel(request))
        for stream in self._of(request):
            self._jobs.put(functools.partial(self._send_cancel, stream, reason))
        return ok

    def peer_lost(self, agent: str, reason: str, *, before_epoch: int | None = None) -> int:
        """The P agent ``agent`` is gone (its process died, or it came back under a new epoch, then only its
        streams from epochs before ``before_epoch``): none of their writes can land any more, so they end now,
        failing their loads (one the ledger already ended, e.g. through ``peer_restarted``, is only forgotten)
        instead of waiting out the stream timeout. Returns how many."""
        with self._lock:
            gone = [s for s in self._streams.values() if s.link.agent == agent
                    and (before_epoch is None or s.link.epoch < before_epoch)]
        for stream in gone:
            self._end(stream, "failed", reason)
        return len(gone)

    def pending(self) -> int:
        return len(self._streams)

    def streaming(self, request: str) -> bool:
        """Whether a stream into ``request``'s blocks is under way."""
        return bool(self._of(request))

    def _of(self, request: str) -> list[_Stream]:
        with self._lock:
            return [s for s in self._streams.values() if s.request == request]

    # -- notes (the Consumer's service thread) -----------------------------------------------------------------
    def _on_note(self, _sender: str, note: Notification) -> None:
        stream = self._streams.get(note.transfer)
        if stream is None or note.kind not in (NOTE_LAYERS, NOTE_FAILED):
            return
        if not hmac.compare_digest(note.payload[:TOKEN_BYTES], stream.token):
            self.counts["forged"] += 1
            self._log_forged("dropped a %s note for stream %s without its token", note.kind, note.transfer)
            return
        if note.hlc:
            self.ledger.hlc.observe(note.hlc)
        if note.kind == NOTE_FAILED:
            self._end(stream, "failed", f"producer: {note.payload[TOKEN_BYTES:].decode(errors='replace')}")
            return
        try:
            _, batch = decode_batch(note.payload)
        except ValueError as exc:
            self.counts["forged"] += 1
            self._log_forged("dropped a malformed layer note for %s: %s", note.transfer, exc)
            return
        if not 0 <= batch.lo < batch.hi <= stream.blocks.size:
            self._log_forged("layer note for %s names positions [%d, %d) of %d", note.transfer, batch.lo, batch.hi,
                             stream.blocks.size)
            return
        stream.last_progress = stream.answered = self._now()  # a landed layer: P is alive too
        self.ledger.layers_landed(stream.transfer, stream.part, batch.first_layer, batch.num_layers,
                                  stream.blocks[batch.lo:batch.hi])
        if stream.transfer not in self.ledger.loads and self._forget(stream):  # the last layer of the last block
            self.counts["completed"] += 1

    def _end(self, stream: _Stream, outcome: str, reason: str) -> None:
        """Settle a stream that did not complete: the ledger fails the load (policy) or discards a cancelled one.
        The thread that takes the stream out of the table settles it; a racing one does nothing."""
        if not self._forget(stream):
            return
        if stream.transfer in self.ledger.loads:
            self.ledger.fail(stream.transfer, reason)
        self.counts[outcome] += 1

    def _forget(self, stream: _Stream) -> bool:
        with self._lock:
            return self._streams.pop(stream.transfer, None) is not None

    # -- service thread ----------------------------------------------------------------------------------------
    def _send_cancel(self, stream: _Stream, reason: str) -> None:
        if stream.transfer not in self._streams or stream.cancel_sent:
            return
        stream.cancel_sent = True
        try:
            ack = stream.link.client.request(
                StreamCancel(stream.source, stream.transfer, stream.token, reason),
                timeout_s=self.options.stream_timeout_s)
        except SideChannelError as exc:  # P unreachable: the stream times out
            log.info("stream cancel %s not delivered: %s", stream.transfer, exc)
            return
        if ack.ok and ack.detail == "settled":  # nothing was or will be written
            self._end(stream, "failed", f"{reason}; nothing in flight")

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                self._jobs.get(timeout=0.05)()
            except queue.Empty:
                pass
            except Exception:
                log.exception("stream job failed")
            if self._streams:
                self._keep_transport_busy()
            self._time_out()
            self._beat()

    def _time_out(self) -> int:
        """Fail the streams with no layer for ``stream_timeout_s`` (P lost): P's window, shorter, ended before, so
        none of its writes is in flight. Returns how many."""
        now = self._now()
        with self._lock:
            late = [s for s in self._streams.values() if now - s.last_progress > self.options.stream_timeout_s]
        for stream in late:
            log.warning("stream %s of %s: no layer in %.1fs (P lost?)", stream.transfer, stream.request,
                        self.options.stream_timeout_s)
            self._end(stream, "timed_out", f"stream timed out: no layer in {self.options.stream_timeout_s}s")
        return len(late)

    def _beat(self) -> int:
        """Every ``heartbeat_interval_s``: one heartbeat to each P with open streams of this D, then end the streams
        of a P not heard for ``peer_timeout_s`` (with the margin below). Returns how many ended."""
        now = self._now()
        if now - self._last_beat < self.options.heartbeat_interval_s:
            return 0
        self._last_beat = now
        by_link: dict[int, list[_Stream]] = {}
        with self._lock:
            for stream in self._streams.values():
                if stream.answered != math.inf:  # its request was answered: P holds it
                    by_link.setdefault(id(stream.link), []).append(stream)
        for streams in by_link.values():
            link = streams[0].link
            beat = StreamHeartbeat(self.transport.agent, self.transport.epoch, [s.token for s in streams])
            try:
                link.client.request(beat, timeout_s=self.options.heartbeat_interval_s)
            except SideChannelRefused as exc:  # an answer all the same: P is there, of a version without heartbeats
                if exc.code != "unknown_kind":
                    self.counts["heartbeats_unanswered"] += 1
                    log.info("stream heartbeat to %s refused: %s", link.agent, exc)
                    continue
            except SideChannelError as exc:
                self.counts["heartbeats_unanswered"] += 1
                log.info("stream heartbeat to %s failed: %s", link.agent, exc)
                continue
            answered = self._now()  # after P heard it: P's own peer timeout for these streams ends first
            for stream in streams:
                stream.answered = answered
        # P stops a stream it has not heard for peer_timeout_s and cancels its writes in flight: D frees the blocks
        # only past that, with the window's margin for drift and its settle bound (kvlifecycle.protocol.bounds)
        now = self._now()
        limit = self.options.peer_timeout_s / (1.0 - STREAM_MARGIN_FRACTION) + STREAM_SETTLE_S
        with self._lock:
            silent = [s for s in self._streams.values() if now - s.answered > limit]
        for stream in silent:
            log.warning("stream %s of %s: P %s not heard for %.2fs", stream.transfer, stream.request,
                        stream.link.agent, limit)
            self.counts["peer_lost"] += 1
            self._end(stream, "failed", f"peer timeout: P {stream.link.agent} not heard for {limit:.3g} s")
        return len(silent)

    def _keep_transport_busy(self) -> None:
        if self._expect_activity is not None:
            self._expect_activity(0.25)  # renewed every service loop (50 ms) while streams are under way

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
