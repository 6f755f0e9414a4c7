"""D's side of a layer-wise stream: the reservation goes to P before P computes, and the blocks fill layer by layer.

:meth:`StreamConsumer.request_stream` starts the load in D's ledger first (``layers=n``: the blocks are LOADING
from the moment P may write into them), then sends the :class:`~kvlifecycle.control.StreamRequest` and waits for
P's answer (one side-channel round trip, the caller's thread). A declined stream (P's prefill began first, or push
is unavailable) goes back to RESERVED through the ledger's ``decline``: the caller takes its post-prefill path
into the same blocks. Each ``layers`` note, carrying the stream's token, is one ``layers_landed`` in the ledger,
whose last one makes the blocks READY_FOR_ATTENTION; a ``failed`` note (sent by P once its writes settled) fails
the load under the ledger's failure policy.

Several P ranks (P TP > D TP): :meth:`StreamConsumer.request_streams` asks each for its part of one load (part
``i``: its heads of every block), each part with its own token. Any part failing fails the load, the other parts are
cancelled, and the ledger fails (frees) the blocks only once every part's stream settled: no block is freed while a
sibling P rank's write may still land (vLLM #56104).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamRequest
from kvlifecycle.digest import DigestError, VerifyMode, batch_digest
from kvlifecycle.protocol.bounds import STREAM_MARGIN_FRACTION, STREAM_SETTLE_S
from kvlifecycle.sidechannel import SideChannelError, SideChannelRefused
from kvlifecycle.streaming.wire import (
    NOTE_FAILED,
    NOTE_LAYERS,
    LayerBatch,
    StreamHeartbeat,
    StreamOptions,
    decode_batch,
)
from kvlifecycle.transport import Notification
from kvlifecycle.untrusted import RateLimitedLog

log = logging.getLogger("kvlifecycle.streaming")
_ids = itertools.count(1)
DECLINES_KEPT = 1024  # the reasons of the latest declines, for an engine that reports them per request


def _noop() -> None:
    pass


@dataclass(slots=True)
class _Load:
    """D's one ledger load that one stream per part (P rank) writes into. It settles only once every part's stream
    settled: a failed part fails the load then, never before a sibling P rank's write may still land (vLLM #56104)."""

    transfer: str
    open: set[int]  # the parts whose stream has not settled
    failing: str = ""  # why the load fails once every part settled ("" : no part failed)
    outcome: str = "failed"  # the count the failure ends under


@dataclass(slots=True)
class _Stream:
    request: str
    source: str  # P's name for the request
    transfer: str
    link: Any  # the PeerLink of the P rank that writes
    token: bytes  # this part's own: a P rank's notes are taken for its part only
    blocks: np.ndarray  # D's block ids, token order
    part: int
    last_progress: float
    load: _Load
    cancel_sent: bool = False
    answered: float = math.inf  # when P last answered for this stream (its request, or a heartbeat)
    unheard: str = ""  # its P was declared lost but may still write: no heartbeat, no note taken; why

    @property
    def key(self) -> tuple[str, int]:
        return self.transfer, self.part


class StreamConsumer:
    """Asks P ranks to stream requests into this D's reservations, beside a :class:`~kvlifecycle.handoff.Consumer`
    (its ledger, transport and links; it hands this streamer the notes no load of its own names)."""

    def __init__(self, consumer: Any, *, options: StreamOptions | None = None) -> None:
        self._init_state(consumer, options=options)
        consumer.note_sinks.append(self._on_note)
        # the Consumer's invalidate_peer ends this streamer's parts from that peer too (its epochs up to the lost one)
        consumer.peer_lost_sinks.append(
            lambda agent, epoch, reason, may_write: self.peer_lost(agent, reason, before_epoch=epoch + 1,
                                                                   may_write=may_write))
        # A layer's note is on T_visible's path: the transport wakes the Consumer that dispatches notes when one
        # arrives (else found at its next idle poll, up to 5 ms later), and, while a stream is under way, polls
        # the network at its busy rhythm (``expect_activity``) rather than its idle one
        add_listener = getattr(self.transport, "add_notification_listener", None)
        if add_listener is not None:
            add_listener(lambda: consumer._jobs.put(_noop))  # a job wakes the Consumer's service thread
        fast = getattr(consumer, "fast_transport", None)
        if fast is not None:  # P's writes may come over it (its push path): its notes too
            add_fast = getattr(fast, "add_notification_listener", None)
            if add_fast is not None:
                add_fast(lambda: consumer._jobs.put(_noop))
            else:  # one that wakes nobody (CUDA IPC): the Consumer polls at its busy rhythm while streams are open
                consumer.poll_fast_while.append(lambda: bool(self._streams))
        self._expect_activity = getattr(self.transport, "expect_activity", None)
        self._thread = threading.Thread(target=self._serve, name=f"stream-{self.transport.agent}", daemon=True)
        self._thread.start()

    def _init_state(self, consumer: Any, *, options: StreamOptions | None) -> None:
        """Everything but the thread and the transport's wake-ups (a deterministic driver stops here)."""
        self.consumer, self.ledger, self.transport = consumer, consumer.ledger, consumer.transport
        self.options = options or StreamOptions()
        self._now: Callable[[], float] = time.monotonic  # the clock of the stream timeout
        self._streams: dict[tuple[str, int], _Stream] = {}  # (D transfer, part) -> the part's unsettled stream
        self._lock = threading.Lock()
        self.declines: OrderedDict[str, str] = OrderedDict()  # request -> why P declined its stream, newest last
        self.counts = {"requested": 0, "declined": 0, "completed": 0, "failed": 0, "timed_out": 0, "forged": 0,
                       "peer_lost": 0, "heartbeats_unanswered": 0,
                       # layer batches checked against P's digest before they counted, and those not checked
                       "verified_batches": 0, "unverified_batches": 0, "digest_mismatches": 0}
        self._last_beat = -math.inf
        self._log_forged = RateLimitedLog(log)
        self._jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()

    # -- engine-facing -----------------------------------------------------------------------------------------
    def request_stream(self, request: str, address: str, *, layers: int,
                       source_request: str | None = None) -> str | None:
        """Ask the P rank at ``address`` (connected with push metadata) to stream ``source_request`` (default:
        ``request``) into ``request``'s reserved blocks: :meth:`request_streams` with one P rank."""
        return self.request_streams(request, [address], layers=layers, source_request=source_request)

    def request_streams(self, request: str, addresses: Sequence[str], *, layers: int,
                        source_request: str | None = None) -> str | None:
        """Ask each P rank at ``addresses`` (connected with push metadata; the P ranks this D rank reads, in the
        order of its TP plan's reads: part ``i`` is ``addresses[i]``) to stream ``source_request`` (default:
        ``request``) into ``request``'s reserved blocks, each writing its heads. One load, ``len(addresses)``
        parts: READY_FOR_ATTENTION once every layer of every part landed. Returns the stream's transfer id, or
        ``None`` when the first P rank declined (``declines[request]`` says why; the others are not asked): the
        reservation is RESERVED again, for the post-prefill path. A later P rank declining, or any part failing,
        fails the load once every part's stream settled (the others are cancelled first)."""
        if not addresses:
            raise ValueError("a stream needs at least one P rank")
        links = [self.consumer.links.get(address) for address in addresses]
        for address, link in zip(addresses, links, strict=True):
            if link is None:
                raise ValueError(f"connect to {address} first")
        blocks = self.ledger.requests[request].blocks.copy()
        transfer = f"stream:{request}:{next(_ids)}"
        n = len(links)
        # LOADING before P may write a byte into these blocks. A load of several P ranks names none of them: a
        # restarted one's stream ends through peer_lost, and the load waits for its siblings' writes to settle
        first = links[0] if n == 1 else None
        self.ledger.start_load(request, transfer, parts=n, mode="push", layers=layers,
                               peer=first.agent if first is not None else "",
                               peer_epoch=first.epoch if first is not None else 0)
        source = source_request or request
        load = _Load(transfer, set(range(n)))
        # no timeout while a request is out (P's window may begin at any point of it): its clock starts after
        streams = [_Stream(request, source, transfer, link, secrets.token_bytes(TOKEN_BYTES), blocks, part,
                           math.inf, load) for part, link in enumerate(links)]
        with self._lock:
            for stream in streams:
                self._streams[stream.key] = stream
        self.counts["requested"] += 1
        self._keep_transport_busy()
        for part, stream in enumerate(streams):
            ask = StreamRequest(source, transfer, self.transport.agent, self.transport.epoch,
                                blocks.tolist(), layers, stream.token, self.options.write_window_s, part)
            try:
                ack = stream.link.client.request(ask)
            except SideChannelError as exc:  # P may hold it or not: ask it to stop, and settle on its answer
                stream.last_progress = self._now()  # P's window began before now, if at all: the timeout starts here
                log.warning("stream request %s to %s failed: %s", transfer, addresses[part], exc)
                self._settle_unasked(streams[part + 1:])
                self._failing(load, f"stream request failed: {exc}")
                return transfer
            if not ack.ok:
                self._declined(request, ack.detail)
                if part == 0:  # nothing asked of any P rank is held: RESERVED again
                    with self._lock:
                        for unasked in streams:
                            self._streams.pop(unasked.key, None)
                    self.ledger.decline(transfer, ack.detail)
                    return None
                self._settle_unasked(streams[part + 1:])
                self._settle(stream, f"P rank {addresses[part]} declined part {part}: {ack.detail}")
                return transfer
            stream.last_progress = stream.answered = self._now()  # P's window began before its answer
        return transfer

    def _declined(self, request: str, why: str) -> None:
        self.counts["declined"] += 1
        self.declines[request] = why
        while len(self.declines) > DECLINES_KEPT:
            self.declines.popitem(last=False)

    def _settle_unasked(self, streams: Sequence[_Stream]) -> None:
        """Parts never asked of their P rank (an earlier one declined or failed): nothing of them can land."""
        for stream in streams:
            self._settle(stream)

    def cancel(self, request: str, reason: str = "cancelled on D") -> bool:
        """Cancel ``request`` (D abort, client gone): its blocks are freed once P's writes settled."""
        ok = bool(self.ledger.cancel(request))
        for stream in self._of(request):  # every part: its blocks are freed once all of them settled
            self._jobs.put(functools.partial(self._send_cancel, stream, reason))
        return ok

    def peer_lost(self, agent: str, reason: str, *, before_epoch: int | None = None, may_write: bool = False) -> int:
        """The P agent ``agent`` is gone (its process died, or it came back under a new epoch, then only its
        streams from epochs before ``before_epoch``): none of their writes can land any more, so they end now,
        failing their loads (a load the ledger's ``peer_restarted`` doomed fails here; one it already ended is only
        forgotten) instead of waiting out the stream timeout. Returns how many.

        ``may_write``: the control plane declared it lost, which does not stop a live process cut off from it
        (its etcd lease lapsed in a partition): its streams stop being heartbeated and their notes are ignored,
        and each ends once P's peer timeout has stopped its writes (the same bound as a P that went silent) or
        the stream timed out, whichever comes first."""
        with self._lock:
            gone = [s for s in self._streams.values() if s.link.agent == agent
                    and (before_epoch is None or s.link.epoch < before_epoch)]
        for stream in gone:
            if may_write:
                stream.unheard = stream.unheard or reason
            else:
                self._settle(stream, reason)
        return len(gone)

    def expect_notes(self) -> None:
        """An engine that polls a streaming request's state (SGLang's receiver) calls this at each poll: while a
        stream is under way the transport looks for its notes now, not at its next busy poll (up to a millisecond
        later on NIXL), so a landed stream is seen at the engine's next poll. One coalesced wake of the transport's
        service thread; nothing waits."""
        if self._streams:
            self._keep_transport_busy()

    def pending(self) -> int:
        """Parts of streams not settled yet."""
        return len(self._streams)

    def streaming(self, request: str) -> bool:
        """Whether a stream into ``request``'s blocks is under way (any of its parts not settled)."""
        return bool(self._of(request))

    def _of(self, request: str) -> list[_Stream]:
        with self._lock:
            return [s for s in self._streams.values() if s.request == request]

    # -- notes (the Consumer's service thread) -----------------------------------------------------------------
    def _on_note(self, _sender: str, note: Notification) -> None:
        stream = self._streams.get((note.transfer, note.part))
        if stream is None or stream.unheard or note.kind not in (NOTE_LAYERS, NOTE_FAILED):
            return
        if not hmac.compare_digest(note.payload[:TOKEN_BYTES], stream.token):
            self.counts["forged"] += 1
            self._log_forged("dropped a %s note for stream %s without its token", note.kind, note.transfer)
            return
        if note.hlc:
            self.ledger.hlc.observe(note.hlc)
        if note.kind == NOTE_FAILED:  # sent once every write of this part settled
            self._settle(stream, f"producer: {note.payload[TOKEN_BYTES:].decode(errors='replace')}")
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
        verified = self._batch_verified(stream, batch)
        if verified is None:
            return  # a mismatch: recorded, the load fails once every part settled; these layers never count
        landed = self.ledger.layers_landed(stream.transfer, stream.part, batch.first_layer, batch.num_layers,
                                           stream.blocks[batch.lo:batch.hi], verified=verified)
        progress = self.ledger.layer_progress.get(stream.transfer)
        if landed and (progress is None or progress.complete(stream.part)):  # this part's last layer of its last block
            self._settle(stream)

    def _batch_verified(self, stream: _Stream, batch: LayerBatch) -> bool | None:
        """Check what landed for ``batch`` against P's digest when it carries one and this D verifies (the
        Consumer's ``verify`` and digester), before the layers count as landed: True when it matched; None on a
        mismatch, which the ledger records (``TgtDigestMismatch``: the batch is one unit, ``blocks`` its D blocks,
        ``source_blocks`` its first position) and which fails the load; False when unchecked (no digest, no
        digester, or a plan that splits blocks: P digests whole ones)."""
        consumer = self.consumer
        digester = getattr(consumer, "digester", None)
        options = getattr(consumer, "options", None)
        if batch.digest is None or digester is None or options is None or options.verify is VerifyMode.NONE:
            self.counts["unverified_batches"] += 1
            return False
        view = stream.link.prepared.local_view
        plan = stream.link.plan
        if view.split != 1 or plan.local_split != 1 or plan.remote_split != 1:
            self.counts["unverified_batches"] += 1
            return False
        rpl = self.options.regions_per_layer
        regions = list(range(batch.first_layer * rpl, (batch.first_layer + batch.num_layers) * rpl))
        blocks = stream.blocks[batch.lo:batch.hi]
        try:
            found = batch_digest(digester.digests(blocks, offset=view.offset, length=view.length, only=regions))
        except (DigestError, IndexError) as exc:  # a batch naming layers this D does not have
            found, why = -1, f"digests unusable: {exc}"
        else:
            why = (f"digest mismatch: layers [{batch.first_layer}, {batch.first_layer + batch.num_layers}) of "
                   f"positions [{batch.lo}, {batch.hi}), part {stream.part}")
        if found == batch.digest:
            self.counts["verified_batches"] += 1
            return True
        if found >= 0:
            self.ledger.digest_mismatch(stream.transfer, stream.part, blocks=blocks, source_blocks=[batch.lo],
                                        expected=np.array([batch.digest], dtype="<u8"),
                                        found=np.array([found], dtype="<u8"), quarantine_s=options.quarantine_s,
                                        layers=(batch.first_layer, batch.num_layers))
        self.counts["digest_mismatches"] += 1
        log.error("stream %s of %s: %s", stream.transfer, stream.request, why)
        self._failing(stream.load, why)
        return None

    def _settle(self, stream: _Stream, failure: str = "", outcome: str = "failed") -> None:
        """``stream``'s part settled: no write of its P rank can land any more (completed when ``failure`` is "").
        A failure fails the whole load, and the other parts are cancelled; once every part settled, the ledger
        fails the load (policy), or discards a cancelled one, or saw it complete. The thread that takes the stream
        out of the table settles it; a racing one does nothing."""
        load = stream.load
        with self._lock:
            if self._streams.pop(stream.key, None) is None:
                return
            load.open.discard(stream.part)
            last = not load.open
        if failure:
            self._failing(load, failure, outcome)
        if not last:
            return
        if not load.failing:
            self.counts["completed"] += 1
            return
        if load.transfer in self.ledger.loads:
            self.ledger.fail(load.transfer, load.failing)
        self.counts[load.outcome] += 1

    def _failing(self, load: _Load, reason: str, outcome: str = "failed") -> None:
        """``load`` will fail (the first reason stays): ask every part still unsettled to stop."""
        with self._lock:
            if load.failing:
                return
            load.failing, load.outcome = reason, outcome
            others = [s for s in self._streams.values() if s.load is load]
        for other in others:
            self._jobs.put(functools.partial(self._send_cancel, other, f"part failed: {reason}"))

    # -- service thread ----------------------------------------------------------------------------------------
    def _send_cancel(self, stream: _Stream, reason: str) -> None:
        if self._streams.get(stream.key) is not stream or stream.cancel_sent:
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
            self._settle(stream, f"{reason}; nothing in flight")

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
            self._settle(stream, f"stream timed out: no layer in {self.options.stream_timeout_s}s", "timed_out")
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
                if stream.answered != math.inf and not stream.unheard:  # its request was answered: P holds it
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
            self._settle(stream, stream.unheard or f"peer timeout: P {stream.link.agent} not heard for {limit:.3g} s")
        return len(silent)

    def _keep_transport_busy(self) -> None:
        if self._expect_activity is not None:
            self._expect_activity(0.25)  # renewed every service loop (50 ms) while streams are under way

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
