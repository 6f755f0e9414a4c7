"""The prefill half of the kvlifecycle SGLang backend: :class:`PrefillKVManager`, chosen by
:class:`~kvlifecycle.adapters.sglang.conn.KVLifecycleKVManager` for ``DisaggregationMode.PREFILL``.

* A :class:`~kvlifecycle.ledger.SourceLedger` over the prefill KV pages. Each chunk a sender sends is
  ``allocate``/``prefill_done``/``grant``-ed (a lease whose transfer id D chose) before a byte moves, and released
  through the ledger's one release path: ``completed`` when the write landed, otherwise ``failed`` / ``cancelled`` /
  ``expired`` / ``peer_restarted``. The sender's ``KVPoll`` is read off the ledger (lease live → Transferring,
  released completed → Success, released otherwise → Failed). A failed room is not reported Failed while one of its
  writes is still in flight, so the engine never frees pages a write still reads.
* Liveness: P heartbeats every decode it knows; D's heartbeat lists the rooms it waits on and renews P's leases. A
  decode silent for ``KVL_SGLANG_PEER_TIMEOUT_S`` fails its rooms; a room no decode claims within
  ``KVL_SGLANG_CLAIM_TIMEOUT_S`` fails; a room not served within ``KVL_SGLANG_SERVE_TIMEOUT_S`` of its bootstrap
  fails (and D hears it); P drops rooms its engine never made a sender for.
* A registration P refuses (e.g. a page size mismatch) is said to D (``Refused``), not only logged here.
* Aborts: an ABORT (or a ``GiveUp``) from D marks the room failed, cancels its lease, and is acknowledged once every
  write P posted for the room has settled. A P-side abort or failure reaches D at once (SGLang #36033, #28651).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Any

import numpy as np
from kvlifecycle.adapters.sglang import wire
from kvlifecycle.adapters.sglang.conn import KVLifecycleKVManager, logger
from kvlifecycle.adapters.sglang.plane import PlaneError, Regions
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs

from kvlifecycle.ledger import LedgerError, SourceLedger
from kvlifecycle.machines import SourceState


@dataclasses.dataclass(slots=True)
class _Dst:
    meta: wire.RoomMeta
    endpoint: str
    port: int
    consumer: int


@dataclasses.dataclass(slots=True)
class _PRoom:
    room: int
    created: float
    claimed_at: float | None = None
    bootstrapped_at: float | None = None  # when the last decode's metadata arrived: the serve bound starts here
    claimers: set[str] = dataclasses.field(default_factory=set)  # decode agents that claimed the room
    dsts: dict[str, _Dst] = dataclasses.field(default_factory=dict)
    required: int = 1
    chunks: list[tuple[str, str, int]] = dataclasses.field(default_factory=list)  # (ledger request, transfer, gen)
    completed: set[str] = dataclasses.field(default_factory=set)
    last_sent: bool = False
    inflight: int = 0
    failure: str | None = None
    acks: dict[tuple[str, int], int | None] = dataclasses.field(default_factory=dict)
    success_sent: bool = False
    failure_sent: bool = False

    @property
    def bootstrapped(self) -> bool:
        return len(self.dsts) >= self.required and self.required > 0


@dataclasses.dataclass(slots=True)
class _Chunk:
    room: int
    request: str
    transfer: str
    generation: int
    src_pages: np.ndarray
    index_slice: slice
    is_last: bool
    aux_index: int | None


@dataclasses.dataclass(slots=True)
class _DPeer:
    """A decode agent as P knows it."""

    agent: str
    epoch: int
    endpoint: str
    port: int
    nixl_name: str
    last_seen: float


class PrefillKVManager(KVLifecycleKVManager):
    """The manager of a prefill scheduler rank: rooms, leases and writes towards decodes (module docstring)."""

    ledger: SourceLedger

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.rooms: dict[int, _PRoom] = {}
        self.d_peers: dict[str, _DPeer] = {}
        self._queue: deque[_Chunk] = deque()
        self._queue_cv = threading.Condition()
        self._room_of_transfer: dict[str, int] = {}
        self.refused_decodes: dict[str, tuple[str, int, str]] = {}  # agent -> (endpoint, port, why refused)
        self._threads = [
            threading.Thread(target=self._recv_loop, args=(self._p_handle,), name="kvl-p-recv", daemon=True),
            threading.Thread(target=self._p_worker, name="kvl-p-worker", daemon=True),
            threading.Thread(target=self._p_housekeeping, name="kvl-p-hb", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- bootstrap registration (P) --------------------------------------------------------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        payload = {**payload, "kvl_agent": self.kvl_agent, "kvl_epoch": self.kvl_epoch}
        super()._register_topology_row(url, payload)

    def close(self) -> None:
        self._stop.set()
        with self._queue_cv:
            self._queue_cv.notify_all()  # the worker waits on it
        super().close()

    def _room(self, room: int) -> _PRoom:
        r = self.rooms.get(room)
        if r is None:
            r = self.rooms[room] = _PRoom(room, time.monotonic())
        return r

    def _p_handle(self, frames: list[bytes]) -> None:
        if frames and frames[0] == ABORT_TAG:
            note = AbortNotification.from_zmq(frames)
            if note is not None:
                self._p_abort_from_decode(note)
            return
        msg = wire.decode(frames)
        now = time.monotonic()
        if isinstance(msg, wire.Register):
            self._p_register(msg)
        elif isinstance(msg, wire.RoomMeta):
            self._p_room_meta(msg)
        elif isinstance(msg, wire.Claim):
            with self._lock:
                r = self._room(msg.room)
                r.claimed_at = now
                r.claimers.add(msg.agent)
            self._p_answer_refused(msg.agent, msg.room)
        elif isinstance(msg, wire.Heartbeat):
            self._p_heartbeat(msg, now)
        elif isinstance(msg, wire.GiveUp):
            self._p_give_up_from_decode(msg)
        else:
            raise wire.MalformedMessage(f"{type(msg).__name__} is not a D → P message")

    def _p_register(self, msg: wire.Register) -> None:
        if msg.page_size != self.kv_args.page_size:
            self._p_refuse(msg, f"page size {msg.page_size} != prefill page size {self.kv_args.page_size}")
            return
        kv = Regions(tuple(msg.kv_ptrs), tuple(msg.kv_item_lens), tuple([msg.kv_num_pages] * len(msg.kv_ptrs)))
        aux = Regions(tuple(msg.aux_ptrs), tuple(msg.aux_item_lens), tuple(msg.aux_rows))
        with self._lock:
            old = self.d_peers.get(msg.agent)
            if old is not None and old.epoch == msg.epoch:
                old.last_seen = time.monotonic()
                return
            try:
                name = self.plane.add_peer(msg.nixl_metadata, kv, aux)
            except PlaneError as exc:
                refusal: str | None = f"its KV layout cannot be mapped: {exc}"
            else:
                refusal = None
                self.refused_decodes.pop(msg.agent, None)
                self.d_peers[msg.agent] = _DPeer(msg.agent, msg.epoch, msg.endpoint, msg.port, name,
                                                 time.monotonic())
                self.check_peer_aux_buffer_count(msg.agent, len(msg.aux_ptrs))
        if refusal is not None:
            self._p_refuse(msg, refusal)
            return
        self.ledger.peer_restarted(msg.agent, msg.epoch)

    def _p_refuse(self, msg: wire.Register, reason: str) -> None:
        """Refuse a decode's registration and say so to it (not only in P's log): D fails the rooms it waits on
        here with this reason at once, instead of learning of it from a heartbeat window."""
        logger.error("kvlifecycle: registration of decode %s refused: %s", msg.agent, reason)
        with self._lock:
            self.refused_decodes[msg.agent] = (msg.endpoint, msg.port, reason)
            waiting = [r for r in self.rooms.values() if msg.agent in r.claimers and r.failure is None]
            for r in waiting:
                r.failure = f"registration of decode {msg.agent} refused: {reason}"
                self._fail_room_locked(r)
        self._send(msg.endpoint, msg.port, wire.encode(wire.Refused(
            msg.agent, msg.epoch, self.kvl_agent, self.kvl_epoch, self._prefill_unique_rank(), reason)))

    def _p_answer_refused(self, agent: str, room: int) -> None:
        """A refused decode claimed or published a room: answer it Failed with the refusal's reason."""
        with self._lock:
            refused = self.refused_decodes.get(agent)
        if refused is None:
            return
        endpoint, port, reason = refused
        msg = wire.Status(room, int(KVPoll.Failed), self._prefill_unique_rank(), self.kvl_agent, self.kvl_epoch,
                          "", f"prefill refused this decode's registration: {reason}", self.ledger.hlc.tick())
        self._send(endpoint, port, wire.encode(msg))

    def _p_room_meta(self, msg: wire.RoomMeta) -> None:
        with self._lock:
            peer = self.d_peers.get(msg.agent)
            r = self._room(msg.room)
            if peer is None or peer.epoch != msg.epoch:
                refused = self.refused_decodes.get(msg.agent)
                why = f"registration of decode {msg.agent} refused: {refused[2]}" if refused else \
                    f"metadata from unregistered decode {msg.agent} (epoch {msg.epoch})"
                r.failure = r.failure or why
                self._fail_room_locked(r)
                registered, refused_here = False, refused is not None
            else:
                registered, refused_here = True, False
                r.claimed_at = time.monotonic()
                r.claimers.add(msg.agent)
                r.required = msg.required_dst_info_num
                r.dsts[msg.agent] = _Dst(msg, peer.endpoint, peer.port, consumer=len(r.dsts))
                if r.bootstrapped and r.bootstrapped_at is None:
                    r.bootstrapped_at = r.claimed_at
        if refused_here:
            self._p_answer_refused(msg.agent, msg.room)
        if not registered:
            return
        with self._lock:
            self.req_to_decode_prefix_len[msg.room] = msg.decode_prefix_len
            if r.bootstrapped and r.failure is None and msg.room in self.request_status:
                self.update_status(msg.room, KVPoll.WaitingForInput)

    def _p_heartbeat(self, msg: wire.Heartbeat, now: float) -> None:
        renew: list[tuple[str, int]] = []
        with self._lock:
            peer = self.d_peers.get(msg.agent)
            if peer is None:
                return
            if peer.epoch != msg.epoch:
                return  # a restarted decode re-registers first; its old rooms die with the old epoch
            peer.last_seen = now
            for room in msg.rooms:
                r = self.rooms.get(room)
                if r is None:
                    continue
                r.claimed_at = now
                renew.extend((t, g) for _, t, g in r.chunks if t not in r.completed)
        for transfer, generation in renew:
            self.ledger.heartbeat(transfer, generation)

    def _p_abort_from_decode(self, note: AbortNotification) -> None:
        with self._lock:
            r = self._room(note.room)
            if r.failure is None and not r.success_sent:
                r.failure = "aborted by decode (ABORT notification)"
                self.record_failure(note.room, r.failure)
                self.update_status(note.room, KVPoll.Failed)
            if note.decode_ip is not None and note.decode_port is not None:
                r.acks[(note.decode_ip, note.decode_port)] = note.generation
            inflight = r.inflight
        self._p_cancel_leases(note.room)
        self._drain_released()
        if inflight == 0:
            self._p_send_acks(note.room)

    def _p_give_up_from_decode(self, msg: wire.GiveUp) -> None:
        """D stopped waiting for a room (it was not served within D's bound): fail it as for an ABORT, and ack
        once none of our writes towards D's pages is in flight."""
        with self._lock:
            r = self._room(msg.room)
            if r.failure is None and not r.success_sent:
                r.failure = f"decode {msg.agent} gave up on the room: {msg.reason}"
                self._fail_room_locked(r)
            r.acks[(msg.endpoint, msg.port)] = None
            inflight = r.inflight
        self._p_cancel_leases(msg.room)
        self._drain_released()
        if inflight == 0:
            self._p_send_acks(msg.room)

    def _p_cancel_leases(self, room: int) -> None:
        with self._lock:
            r = self.rooms.get(room)
            chunks = list(r.chunks) if r else []
        for request, transfer, _gen in chunks:
            if transfer in self.ledger.leases:
                self.ledger.cancel(request)

    def _p_send_acks(self, room: int) -> None:
        with self._lock:
            r = self.rooms.get(room)
            if r is None or r.inflight:
                return
            targets, r.acks = dict(r.acks), {}
        for (ip, port), generation in targets.items():
            ack = wire.AbortAck(room, self._prefill_unique_rank(), self.kvl_agent, self.kvl_epoch,
                                -1 if generation is None else generation, self.ledger.hlc.tick())
            self._send(ip, port, wire.encode(ack))

    def _fail_room_locked(self, r: _PRoom) -> None:
        """Record the failure now; tell D as soon as no write of the room is in flight (D then frees its pages)."""
        reason = r.failure or "KV transfer failed"
        self.record_failure(r.room, reason)
        if r.room in self.request_status:
            self.update_status(r.room, KVPoll.Failed)
        if r.inflight == 0 and not r.failure_sent:
            r.failure_sent = True
            self._notify_decodes(r, KVPoll.Failed, reason)

    def _notify_decodes(self, r: _PRoom, status: int, reason: str = "", transfer: str = "") -> None:
        for dst in r.dsts.values():
            if dst.meta.is_dummy and status == KVPoll.Success:
                continue
            msg = wire.Status(r.room, int(status), self._prefill_unique_rank(), self.kvl_agent, self.kvl_epoch,
                              transfer or dst.meta.transfer, reason, self.ledger.hlc.tick())
            self._send(dst.endpoint, dst.port, wire.encode(msg))

    def _drain_released(self) -> None:
        """Leases that ended decide their rooms: the ledger, not the transport, is the authority. Called outside
        the ledger's lock (lock order: manager, then ledger; never the other way round)."""
        released = self.ledger.take_released()
        if not released:
            return
        with self._lock:
            for rel in released:
                room = self._room_of_transfer.get(rel.transfer)
                r = self.rooms.get(room) if room is not None else None
                if r is None:
                    continue
                if rel.reason == "completed":
                    r.completed.add(rel.transfer)
                elif r.failure is None:
                    r.failure = f"lease {rel.transfer} released: {rel.reason}"
                    self._fail_room_locked(r)

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
        """Scheduler thread: put the chunk's pages under a lease, then hand the write to the worker thread."""
        with self._lock:
            r = self.rooms.get(bootstrap_room)
            if r is None or r.failure is not None or not r.dsts:
                return
            k = len(r.chunks)
            base = next(iter(r.dsts.values())).meta.transfer
            transfer = base if (k == 0 and is_last_chunk) else f"{base}#{k}"
            request = f"{bootstrap_room}#{k}"
            consumers = sum(1 for d in r.dsts.values() if not d.meta.is_dummy) or 1
        pages = np.asarray(kv_indices, dtype=np.int32)
        try:
            self._ledger_take(request, pages)
            self.ledger.prefill_done(request)
            self._room_of_transfer[transfer] = bootstrap_room
            grant = self.ledger.grant(request, consumers=consumers, transfer=transfer,
                                      peer=next(iter(r.dsts)))
        except (LedgerError, ValueError) as exc:
            with self._lock:
                r.failure = f"ledger refused the chunk's pages: {exc}"
                self._fail_room_locked(r)
            return
        with self._lock:
            r.chunks.append((request, transfer, grant.generation))
            r.inflight += 1
            r.last_sent = r.last_sent or is_last_chunk
        self.update_status(bootstrap_room, KVPoll.Transferring)
        with self._queue_cv:
            self._queue.append(_Chunk(bootstrap_room, request, transfer, grant.generation, pages, index_slice,
                                      is_last_chunk, aux_index))
            self._queue_cv.notify()

    def _ledger_take(self, request: str, pages: np.ndarray) -> None:
        """allocate the pages the ledger sees free (or cached); share the ones another live room holds."""
        ledger = self.ledger
        states = ledger.block_states(pages)
        fresh = (states == SourceState.FREE) | (states == SourceState.PREFIX_CACHED)
        if fresh.all():
            ledger.allocate(request, pages)
        elif not fresh.any():
            ledger.share(request, pages)
        else:
            raise LedgerError(f"{int((~fresh).sum())} of the chunk's {pages.size} pages are held by another live "
                              "room and the rest are free: mixed prefix sharing inside one chunk is not supported")

    def _p_worker(self) -> None:
        while not self._stop.is_set():
            with self._queue_cv:
                while not self._queue and not self._stop.is_set():
                    self._queue_cv.wait(0.5)
                if self._stop.is_set():
                    return
                chunk = self._queue.popleft()
            self._p_write(chunk)

    def _p_write(self, chunk: _Chunk) -> None:
        with self._lock:
            r = self.rooms.get(chunk.room)
            dsts = list(r.dsts.values()) if r is not None else []
            peers = {a: self.d_peers.get(a) for a in (r.dsts if r else {})}
            failed = r is None or r.failure is not None
        error: str | None = None
        if not failed:
            for dst in dsts:
                if dst.meta.is_dummy:
                    continue
                peer = peers.get(dst.meta.agent)
                if peer is None or peer.epoch != dst.meta.epoch:
                    error = f"decode {dst.meta.agent} restarted or unregistered before the write"
                    break
                # claim the lease before the write reads the pages: a cancel racing it defers until it settled
                if not self.ledger.heartbeat(chunk.transfer, chunk.generation):
                    error = f"lease {chunk.transfer} no longer live before the write (expired or cancelled)"
                    break
                dst_pages = np.frombuffer(dst.meta.dst_pages, dtype=np.int32)[chunk.index_slice]
                if dst_pages.size < chunk.src_pages.size:
                    error = f"decode reserved {dst_pages.size} pages for a {chunk.src_pages.size}-page chunk"
                    break
                try:
                    nbytes, descs, t_post, t_xfer = self.plane.write(
                        peer.nixl_name, chunk.src_pages, dst_pages[: chunk.src_pages.size],
                        chunk.aux_index if chunk.is_last else None,
                        dst.meta.dst_aux_index if chunk.is_last else None,
                        timeout_s=self.settings.write_timeout_s,
                    )
                except PlaneError as exc:
                    error = str(exc)
                    self.ledger.observe_transfer(chunk.transfer, t_post_s=0.0, t_xfer_s=0.0, nbytes=0, descriptors=0,
                                                 backend=self.plane.backend_name, ok=False)
                    break
                self.ledger.observe_transfer(chunk.transfer, t_post_s=t_post, t_xfer_s=t_xfer, nbytes=nbytes,
                                             descriptors=descs, backend=self.plane.backend_name, ok=True)
                self.ledger.consumer_done(chunk.transfer, chunk.generation, consumer=dst.consumer)
        # every write of this chunk has settled here: release what is still live, then report
        if error is not None:
            with self._lock:
                if r is not None and r.failure is None:
                    r.failure = error
            self.ledger.fail(chunk.transfer, chunk.generation, error)
        elif failed and chunk.transfer in self.ledger.leases:
            self.ledger.cancel(chunk.request)
        self._drain_released()
        with self._lock:
            if r is None:
                return
            r.inflight -= 1
            if r.failure is not None:
                self._fail_room_locked(r)
            elif chunk.is_last and r.last_sent and all(t in r.completed for _, t, _ in r.chunks):
                r.success_sent = True
                self.update_status(chunk.room, KVPoll.Success)
                self._notify_decodes(r, KVPoll.Success)
            inflight = r.inflight
        if inflight == 0:
            self._p_send_acks(chunk.room)

    def _p_housekeeping(self) -> None:
        """Heartbeats to decodes, lease sweep, unclaimed rooms and silent decodes."""
        while not self._stop.wait(self.settings.heartbeat_s):
            now = time.monotonic()
            with self._lock:
                peers = list(self.d_peers.values())
            hb = wire.Heartbeat(self.kvl_agent, self.kvl_epoch, "prefill", self.local_ip, self.rank_port,
                                self._prefill_unique_rank(), hlc=self.ledger.hlc.tick())
            frames = wire.encode(hb)
            for peer in peers:
                self._send(peer.endpoint, peer.port, frames)
            self.ledger.sweep()
            self._drain_released()  # expired leases fail their rooms
            with self._lock:
                for r in list(self.rooms.values()):
                    if r.failure is not None or r.success_sent:
                        continue
                    silent = [a for a in r.dsts if (p := self.d_peers.get(a)) is None
                              or now - p.last_seen > self.settings.peer_timeout_s]
                    if silent:
                        r.failure = f"decode {silent[0]} silent for more than {self.settings.peer_timeout_s:g} s"
                    elif not r.bootstrapped and r.room in self.request_status:
                        since = r.claimed_at if r.claimed_at is not None else r.created
                        if now - since > self.settings.claim_timeout_s:
                            r.failure = (f"bootstrap timeout: no decode claimed room {r.room} within "
                                         f"{self.settings.claim_timeout_s:g} s")
                    elif r.room not in self.request_status and now - r.created > self.settings.claim_timeout_s:
                        # a decode claimed a room this prefill's engine never made a sender for
                        r.failure = (f"prefill has no request for room {r.room} "
                                     f"{self.settings.claim_timeout_s:g} s after a decode claimed it")
                        self._p_tell_claimers_locked(r)
                    elif (not r.chunks and r.bootstrapped_at is not None
                          and now - r.bootstrapped_at > self.settings.serve_timeout_s):
                        r.failure = (f"prefill did not serve room {r.room} within "
                                     f"{self.settings.serve_timeout_s:g} s of its bootstrap")
                    if r.failure is not None:
                        self._fail_room_locked(r)
                    if r.failure is not None and r.inflight == 0:
                        self._p_cancel_leases_locked(r)
                        if r.room not in self.request_status:
                            del self.rooms[r.room]  # no sender will ever clear it
            if self.ledger.log is not None:
                self.ledger.commit()

    def _p_tell_claimers_locked(self, r: _PRoom) -> None:
        """Failed to the decodes that only claimed the room (those that published metadata hear it from
        :meth:`_notify_decodes`)."""
        for agent in r.claimers - set(r.dsts):
            peer = self.d_peers.get(agent)
            if peer is None:
                continue
            msg = wire.Status(r.room, int(KVPoll.Failed), self._prefill_unique_rank(), self.kvl_agent,
                              self.kvl_epoch, "", r.failure or "", self.ledger.hlc.tick())
            self._send(peer.endpoint, peer.port, wire.encode(msg))

    def _p_cancel_leases_locked(self, r: _PRoom) -> None:
        for request, transfer, _ in r.chunks:
            if transfer in self.ledger.leases:
                self.ledger.cancel(request)

    def p_room_status(self, room: int) -> KVPoll:
        """The sender's KVPoll, read off the ledger and the room record."""
        self._drain_released()
        with self._lock:
            r = self.rooms.get(room)
            if r is None:
                return KVPoll.Failed
            if r.failure is not None:
                # never Failed while a write still reads the pages the engine would free on Failed
                return KVPoll.Transferring if r.inflight else KVPoll.Failed
            if r.success_sent:
                return KVPoll.Success
            if r.chunks:
                return KVPoll.Transferring
            if r.bootstrapped:
                return KVPoll.WaitingForInput
            return KVPoll.Bootstrapping

    def p_release_room(self, room: int) -> None:
        """sender.clear(): the engine frees (or caches) the pages; the ledger follows."""
        with self._lock:
            r = self.rooms.pop(room, None)
        if r is None:
            return
        for request, transfer, _ in r.chunks:
            try:
                if transfer in self.ledger.leases:
                    self.ledger.cancel(request)
                if request in self.ledger.requests and not self.ledger.requests[request].leases:
                    self.ledger.free(request, cache=True)
            except LedgerError as exc:
                logger.warning("kvlifecycle: releasing room %s: %s", room, exc)
            self._room_of_transfer.pop(transfer, None)
        if self.ledger.log is not None:
            self.ledger.commit()
