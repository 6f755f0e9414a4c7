"""The prefill half of the kvlifecycle SGLang backend: :class:`PrefillKVManager`, chosen by
:class:`~kvlifecycle.adapters.sglang.manager.KVLifecycleKVManager` for ``DisaggregationMode.PREFILL``.

* The handoff's P side: a :class:`~kvlifecycle.handoff.Producer` (side channel: handshake, compatibility record,
  epochs; D's push metadata becomes the push plan) and a :class:`~kvlifecycle.streaming.StreamProducer` of one
  "layer" over every region. A room is the stream of request ``str(room)``: D's reservation arriving is SGLang's
  ``WaitingForInput``; each chunk a sender sends is ``allocate``-d and ``prefill_done`` in the
  :class:`~kvlifecycle.ledger.SourceLedger` and handed to the stream, which posts only the pages not sent yet (the
  last chunk with the aux row, in the same post); the room is Success once every reserved block landed.
* Ends: P's abort, a chunk the stream refuses and the bounds below cancel the stream (D hears it at once when no
  byte was written, else once the writes in flight settled); D's cancel (its abort, or its serve bound) reads as a
  stopped stream with D's reason. A failed room is not reported Failed while a write of it is in flight, so the
  engine never frees pages a write still reads; the pages are freed in the ledger once the stream settled.
* Bounds: a room D did not reserve for within ``KVL_SGLANG_CLAIM_TIMEOUT_S`` of its sender fails (bootstrap
  timeout); a reserved room not served within ``KVL_SGLANG_SERVE_TIMEOUT_S`` fails, and D hears why.
* SGLang's ``ABORT`` frame from a decode fails the room on P (D's own cancel settles its pages).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import numpy as np
from kvlifecycle.adapters.sglang.manager import KVLifecycleKVManager, attention_tp, compat_of, logger, unit_bytes_of
from kvlifecycle.transports.select import SameNodeSelector
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import AbortNotification
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import get_local_ip_auto

from kvlifecycle.handoff import HandoffOptions, Producer
from kvlifecycle.ledger import LedgerError, SourceLedger
from kvlifecycle.streaming import StreamProducer


@dataclasses.dataclass(slots=True)
class _PRoom:
    room: int
    created: float
    reserved_at: float | None = None  # when P first saw D's reservation: the serve bound starts here
    chunks: list[str] = dataclasses.field(default_factory=list)  # ledger requests, one per chunk
    pages: list[np.ndarray] = dataclasses.field(default_factory=list)  # each chunk's pages, in token order
    last_sent: bool = False
    failure: str | None = None

    @property
    def key(self) -> str:
        return str(self.room)  # the stream's request on both sides

    @property
    def pages_sent(self) -> int:
        return sum(p.size for p in self.pages)


class PrefillKVManager(KVLifecycleKVManager, role=DisaggregationMode.PREFILL):
    """The manager of a prefill scheduler rank: rooms as streams into decodes' reservations (module docstring)."""

    ledger: SourceLedger

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.rooms: dict[int, _PRoom] = {}
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._start_threads(
            threading.Thread(target=self._serve_rank_socket, args=(self._p_abort_from_decode,), name="kvl-p-rank",
                             daemon=True),
            threading.Thread(target=self._p_housekeeping, name="kvl-p-bounds", daemon=True),
        )

    def _start_handoff(self, args: KVArgs, server_args: ServerArgs) -> None:
        self.kvl_tp_size, tp_rank = attention_tp()
        compat = compat_of(args, server_args, self.kvl_tp_size, replicated=self.kvl_kv_replicated)
        unit = unit_bytes_of(args, self.kvl_tp_size)
        # P picks each decode rank's write path at its handshake: CUDA IPC on one node with VRAM on both sides
        self.producer = Producer(self.ledger, self.plane.transport, compat, tp_rank=tp_rank,
                                 options=HandoffOptions(host=get_local_ip_auto(), probe=False, unit_bytes=unit,
                                                        verify=self.kvl_verify),
                                 fast_transport=self.plane.fast_transport, path_selector=SameNodeSelector(),
                                 digester=self.kvl_digester)
        self.streamer = StreamProducer(self.producer, layers=1, options=self.stream_options)

    def expected_reservations(self, key: str) -> int:
        """How many decode ranks reserve room ``key`` from this rank: SGLang's ``required_dst_info_num`` (decode
        attention TP / prefill attention TP when the decode's is larger, else 1), from the TP size each reserving
        decode declared in its handshake (what SGLang's decode tells its prefill in each rank's metadata)."""
        agents = self.streamer.reserving_agents(key)
        d_tp = max((self.producer.peer_tp_size(agent) or 1 for agent in agents), default=1)
        return max(1, d_tp // self.kvl_tp_size)

    def _close_handoff(self) -> None:
        self.streamer.close()
        self.producer.close()

    # -- bootstrap registration (P) --------------------------------------------------------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        payload = {**payload, "kvl_agent": self.kvl_agent, "kvl_epoch": self.kvl_epoch,
                   "kvl_side": self.producer.address, "kvl_heads": self.producer.compat.num_kv_heads}
        super()._register_topology_row(url, payload)

    @property
    def side_channel_refused(self) -> int:
        """Messages the side channel refused (malformed, oversized, unknown ...): counted there, by code."""
        return self.producer.server.bad_messages

    # -- rooms -------------------------------------------------------------------------------------------------------
    def p_open_room(self, room: int) -> None:
        with self._lock:
            self.rooms.setdefault(room, _PRoom(room, time.monotonic()))  # an ABORT may have made it first

    def p_fail_room(self, room: int, reason: str) -> None:
        """Fail ``room`` (the first reason stays) and end its stream: D is told at once if nothing was written,
        else once the writes in flight settled; a reservation arriving later is declined."""
        with self._lock:
            r = self.rooms.setdefault(room, _PRoom(room, time.monotonic()))
            if r.failure is not None:
                return
            r.failure = reason
        self.record_failure(room, reason)
        self.streamer.cancel(r.key, reason)
        self.streamer.prefill_ended(r.key, aborted=True)

    def _p_abort_from_decode(self, note: AbortNotification) -> None:
        self.p_fail_room(note.room, "aborted by decode (ABORT notification)")

    def p_room_status(self, room: int) -> KVPoll:
        """The sender's KVPoll, read off the room's stream."""
        with self._lock:
            r = self.rooms.get(room)
        if r is None:
            return KVPoll.Failed
        status = self.streamer.status(r.key)
        if status.state == "stopped" and r.failure is None:  # D stopped it (its abort, or its serve bound)
            self.p_fail_room(room, status.reason)
        if r.failure is not None:
            # never Failed while a write still reads the pages the engine would free on Failed
            return KVPoll.Transferring if status.in_flight else KVPoll.Failed
        if status.state == "complete" and r.last_sent:
            return KVPoll.Success
        if r.chunks:
            return KVPoll.Transferring
        if status.state == "reserved":
            with self._lock:
                r.reserved_at = r.reserved_at or time.monotonic()
            # the prefill starts only once every decode rank reserved (SGLang waits for all its ranks' metadata)
            if self.streamer.reservations(r.key) >= self.expected_reservations(r.key):
                return KVPoll.WaitingForInput
        return KVPoll.Bootstrapping

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: np.ndarray,
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: list | None = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        """Scheduler thread: the chunk's pages go to the ledger and to the stream, which posts those not sent yet
        (returns at once: the stream's thread posts)."""
        with self._lock:
            r = self.rooms.get(bootstrap_room)
            if r is None or r.failure is not None:
                return
            first, at = not r.chunks, r.pages_sent
        if first and not self.streamer.begin(r.key):
            self.p_fail_room(bootstrap_room, f"no reservation from a decode for room {bootstrap_room} when its "
                                             "prefill began")
            return
        if index_slice.start != at:
            self.p_fail_room(bootstrap_room, f"chunk at page {index_slice.start}, {at} pages sent before it")
            return
        pages = np.asarray(kv_indices, dtype=np.int32)
        request = f"{bootstrap_room}#{len(r.chunks)}"
        try:
            self.ledger.hold(request, pages)  # pages another live room holds are shared, the rest allocated
            self.ledger.prefill_done(request)
        except (LedgerError, ValueError) as exc:
            self.p_fail_room(bootstrap_room, f"ledger refused the chunk's pages: {exc}")
            return
        with self._lock:
            r.chunks.append(request)
            r.pages.append(pages)
            blocks = np.concatenate(r.pages)
            r.last_sent = is_last_chunk
        if is_last_chunk:
            aux_start = self.plane.aux_start
            if aux_index is not None and aux_start is not None:
                blocks = np.append(blocks, np.int32(aux_start + int(aux_index)))  # the aux row, in the same post
            reserved = self.streamer.status(r.key).reserved
            if blocks.size != reserved:
                self.p_fail_room(bootstrap_room, f"prefill holds {blocks.size} blocks (pages and aux row), the "
                                                 f"decode reserved {reserved}")
                return
        self.streamer.layer_done(r.key, 0, blocks)
        if is_last_chunk:
            self.streamer.prefill_ended(r.key)
        self.update_status(bootstrap_room, KVPoll.Transferring)

    def _p_housekeeping(self) -> None:
        """The bounds of rooms that wait: no reservation (bootstrap timeout), and reserved but not served."""
        claim, serve = self.settings.claim_timeout_s, self.settings.serve_timeout_s
        while not self._stop.wait(self.settings.heartbeat_s):
            now = time.monotonic()
            with self._lock:
                waiting = [r for r in self.rooms.values() if r.failure is None and not r.chunks]
            for r in waiting:
                state = self.streamer.status(r.key).state
                if state == "reserved":
                    r.reserved_at = r.reserved_at or now
                    if now - r.reserved_at > serve:
                        self.p_fail_room(r.room, f"prefill did not serve room {r.room} within {serve:g} s of its "
                                                 "bootstrap")
                elif state == "none" and r.room in self.request_status and now - r.created > claim:
                    self.p_fail_room(r.room, f"bootstrap timeout: no decode reserved room {r.room} within "
                                             f"{claim:g} s")

    def p_release_room(self, room: int) -> None:
        """sender.clear(): once the room's stream settled, the engine frees (or caches) the pages; the ledger
        follows."""
        with self._lock:
            r = self.rooms.pop(room, None)
        if r is None:
            return

        def free() -> None:
            for request in r.chunks:
                try:
                    self.ledger.free_held(request, cache=True)
                except LedgerError as exc:
                    logger.warning("kvlifecycle: releasing room %s: %s", room, exc)

        self.streamer.release(r.key, free)
