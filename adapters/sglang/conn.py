"""SGLang ``--disaggregation-transfer-backend kvlifecycle``: KV manager, sender, receiver, bootstrap server.

Built on SGLang's ``Common*`` classes (as its NIXL backend is), so the scheduler finds every attribute it reads
(``conclude_state``, ``abort_notified``, ``kv_mgr``, ``prefill_info_table`` ...). What differs is who decides:

* P side: a :class:`~kvlifecycle.ledger.SourceLedger` over the prefill KV pages. Each chunk a sender sends is
  ``allocate``/``prefill_done``/``grant``-ed (a lease whose transfer id D chose) before a byte moves, and released
  through the ledger's one release path: ``completed`` when the write landed, otherwise ``failed`` / ``cancelled`` /
  ``expired`` / ``peer_restarted``. The sender's ``KVPoll`` is read off the ledger (lease live → Transferring,
  released completed → Success, released otherwise → Failed). A failed room is not reported Failed while one of its
  writes is still in flight, so the engine never frees pages a write still reads.
* D side: a :class:`~kvlifecycle.ledger.TargetLedger` over the decode pages: ``reserve`` + ``start_load`` when the
  receiver publishes its pages, ``part_done`` per prefill rank on P's Success, ``fail`` on P's Failed, on an abort
  ack, on P's epoch change or on P's silence. The receiver's ``KVPoll`` is Success only once the ledger made the
  pages READY_FOR_ATTENTION.
* Liveness: both sides heartbeat each other every ``KVL_SGLANG_HEARTBEAT_S`` (D's heartbeat lists the rooms it waits
  on, renewing P's leases); a peer silent for ``KVL_SGLANG_PEER_TIMEOUT_S`` fails its rooms, instead of SGLang's
  fixed 300 s bootstrap/waiting timeouts. A room no decode claims within ``KVL_SGLANG_CLAIM_TIMEOUT_S`` fails.
* Every room ends within a stated bound, with a reason that names the cause on both sides: a decode room whose
  prefill never appears fails ``KVL_SGLANG_CLAIM_TIMEOUT_S`` after the receiver was made; a room a live prefill
  does not serve within ``KVL_SGLANG_SERVE_TIMEOUT_S`` of its bootstrap fails on P (which tells D), and D gives up
  on it after the same bound (P acknowledges once its writes settled; an unacknowledged give-up fails the room
  ``KVL_SGLANG_PEER_TIMEOUT_S`` later); a prefill that refuses D's registration (e.g. a page size mismatch) says
  so to D, which fails the rooms waiting on it at once; P drops rooms its engine never made a sender for.
* Epochs: every manager has an agent epoch (µs wall clock at start), published through the bootstrap server. D
  polls it; a prefill that came back with a new epoch fails the rooms of its old incarnation at once and D
  re-registers with the new one (SGLang #10365).
* Aborts: an ABORT from D marks the room failed on P, cancels its lease, and is acknowledged once every write P
  posted for the room has settled (``is_abort_release_safe``). A P-side abort or failure reaches D at once
  (SGLang #36033, #28651).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from collections import defaultdict, deque
from typing import Any

import numpy as np
import requests
import zmq
from aiohttp import web
from kvlifecycle.adapters.sglang import wire
from kvlifecycle.adapters.sglang.plane import NixlPlane, PlaneError, Regions
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_ACK_TAG,
    ABORT_TAG,
    AbortNotification,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from kvlifecycle import envvars
from kvlifecycle.ledger import LedgerError, SourceLedger, TargetLedger, open_ledger
from kvlifecycle.machines import SourceState, TargetState

logger = logging.getLogger(__name__)

BACKEND_NAME = "kvlifecycle"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Timeouts of the backend; every one is a lease or a heartbeat window, none a fixed 300 s wait."""

    heartbeat_s: float = 1.0
    peer_timeout_s: float = 10.0  # a peer silent this long is dead: its rooms fail
    claim_timeout_s: float = 120.0  # a P room that no decode receiver claimed by then fails (and vice versa)
    serve_timeout_s: float = 300.0  # a bootstrapped room the prefill has not served by then fails on both sides
    lease_ttl_s: float = 30.0  # P lease on the pages of a granted chunk, renewed by D's heartbeats
    write_timeout_s: float = 60.0  # one NIXL write must settle within this
    log_dir: str = ""

    @classmethod
    def from_env(cls) -> Settings:
        """Read once, through the project's environment registry (``kvlifecycle.envvars``)."""
        return cls(
            heartbeat_s=_float(envvars.SGLANG_HEARTBEAT_S.read()),
            peer_timeout_s=_float(envvars.SGLANG_PEER_TIMEOUT_S.read()),
            claim_timeout_s=_float(envvars.SGLANG_CLAIM_TIMEOUT_S.read()),
            serve_timeout_s=_float(envvars.SGLANG_SERVE_TIMEOUT_S.read()),
            lease_ttl_s=_float(envvars.SGLANG_LEASE_TTL_S.read()),
            write_timeout_s=_float(envvars.SGLANG_WRITE_TIMEOUT_S.read()),
            log_dir=str(envvars.SGLANG_LOG_DIR.read() or ""),
        )


def _float(value: float | None) -> float:
    assert value is not None  # every SGLang timeout has a default in the registry
    return float(value)


def new_epoch() -> int:
    """An agent epoch that grows across restarts on one host (µs wall clock); low bits break ties."""
    return (time.time_ns() // 1000) << 8 | os.urandom(1)[0]


def room_transfer_id(room: int) -> str:
    """The transfer id of a room's handoff, the same on P (lease) and D (load), so merged logs line up."""
    return f"room-{room}"


# --- P side ----------------------------------------------------------------------------------------------------


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


# --- D side ----------------------------------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _PRank:
    """A prefill rank as D knows it (from the bootstrap server and its heartbeats)."""

    bootstrap_addr: str
    agent: str
    epoch: int
    ip: str
    port: int
    last_seen: float
    registered: bool = False


@dataclasses.dataclass(slots=True)
class _DRoom:
    room: int
    bootstrap_addr: str
    transfer: str = ""
    parts: int = 1
    ranks_done: set[int] = dataclasses.field(default_factory=set)
    peers: set[str] = dataclasses.field(default_factory=set)  # prefill peer ids this room waits on
    agents: set[str] = dataclasses.field(default_factory=set)  # their agent names (one incarnation each)
    loading: bool = False
    cleared: bool = False
    acks: set[int] = dataclasses.field(default_factory=set)
    created: float = dataclasses.field(default_factory=time.monotonic)
    published_at: float | None = None  # send_metadata: D's serve bound starts here
    gave_up_at: float | None = None
    give_up_reason: str = ""


class KVLifecycleKVManager(CommonKVManager):
    """One per scheduler rank. See the module docstring for what the ledgers decide."""

    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        # set before super().__init__: it registers to the bootstrap server (P), which publishes these
        self.settings = Settings.from_env()
        self.kvl_epoch = new_epoch()
        role = "prefill" if disaggregation_mode == DisaggregationMode.PREFILL else "decode"
        self.kvl_role = role
        self.kvl_agent = f"kvl-{role}-{uuid.uuid4().hex[:12]}"
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.pp_size > 1 or self.attn_cp_size > 1 or self.kv_shard_size > 1:
            raise NotImplementedError("kvlifecycle SGLang backend: PP, CP and KV sharding are not supported yet")
        if args.state_types:
            raise NotImplementedError(f"kvlifecycle SGLang backend: state pools {args.state_types} not supported yet")
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self.num_pages = min((n // i for n, i in zip(args.kv_data_lens, args.kv_item_lens, strict=True)), default=1)
        self.num_pages = max(int(self.num_pages), 1)
        self.kv_regions = Regions(tuple(args.kv_data_ptrs), tuple(args.kv_item_lens),
                                  tuple(n // i for n, i in zip(args.kv_data_lens, args.kv_item_lens, strict=True)))
        self.aux_regions = Regions(tuple(args.aux_data_ptrs), tuple(args.aux_item_lens),
                                   tuple(n // i for n, i in zip(args.aux_data_lens, args.aux_item_lens,
                                                                strict=True)))
        device = get_device().device
        if device not in ("cpu",):
            raise NotImplementedError(f"kvlifecycle SGLang backend moves DRAM KV only so far (device={device!r})")
        self.plane = NixlPlane(self.kvl_agent, self.kv_regions, self.aux_regions)
        log_dir = os.path.join(self.settings.log_dir, self.kvl_agent) if self.settings.log_dir else None
        side = "source" if role == "prefill" else "target"
        self.ledger: SourceLedger | TargetLedger = open_ledger(
            side, self.num_pages, log_dir, worker=self.kvl_agent,
            **({"default_ttl_s": self.settings.lease_ttl_s} if side == "source" else {}),
        )
        self.ledger_log_dir = log_dir
        self.malformed = 0
        if role == "prefill":
            self._init_prefill()
        else:
            self._init_decode()

    # -- bootstrap registration (P) --------------------------------------------------------------------------------
    def _register_topology_row(self, url: str, payload: dict) -> None:
        payload = {**payload, "kvl_agent": self.kvl_agent, "kvl_epoch": self.kvl_epoch}
        super()._register_topology_row(url, payload)

    # -- common helpers --------------------------------------------------------------------------------------------
    def _send(self, ip: str, port: int, frames: list[bytes]) -> bool:
        na = NetworkAddress(ip, port)
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            return True
        except Exception as exc:
            logger.debug("kvlifecycle: send to %s:%s failed: %s", ip, port, exc)
            return False

    def _recv_loop(self, handle: Any) -> None:
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            frames = self.server_socket.recv_multipart()
            try:
                handle(frames)
            except wire.MalformedMessage as exc:
                self.malformed += 1
                logger.warning("kvlifecycle: refused a malformed control message: %s", exc)
            except Exception:
                logger.exception("kvlifecycle: control message handler failed")

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def close(self) -> None:
        """Stop the backend's threads and release NIXL resources (tests, role switch)."""
        self._stop.set()
        if self.kvl_role == "prefill":
            self._queue_cv.acquire()
            self._queue_cv.notify_all()
            self._queue_cv.release()
        for t in getattr(self, "_threads", []):
            t.join(timeout=5)
        if self.ledger.log is not None:
            self.ledger.log.close()
        self.plane.close()

    def teardown(self) -> None:
        self.close()

    # ==============================================================================================================
    # P side
    # ==============================================================================================================
    def _init_prefill(self) -> None:
        self.rooms: dict[int, _PRoom] = {}
        self.d_peers: dict[str, _DPeer] = {}
        self._queue: deque[_Chunk] = deque()
        self._queue_cv = threading.Condition()
        self._room_of_transfer: dict[str, int] = {}
        self.refused_decodes: dict[str, tuple[str, int, str]] = {}  # agent -> (endpoint, port, why refused)
        assert isinstance(self.ledger, SourceLedger)
        self._threads = [
            threading.Thread(target=self._recv_loop, args=(self._p_handle,), name="kvl-p-recv", daemon=True),
            threading.Thread(target=self._p_worker, name="kvl-p-worker", daemon=True),
            threading.Thread(target=self._p_housekeeping, name="kvl-p-hb", daemon=True),
        ]
        for t in self._threads:
            t.start()

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
        assert isinstance(self.ledger, SourceLedger)
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
        assert isinstance(self.ledger, SourceLedger)
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
        assert isinstance(ledger, SourceLedger)
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
        assert isinstance(self.ledger, SourceLedger)
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
            assert isinstance(self.ledger, SourceLedger)
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
        assert isinstance(self.ledger, SourceLedger)
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
        assert isinstance(self.ledger, SourceLedger)
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

    # ==============================================================================================================
    # D side
    # ==============================================================================================================
    def _init_decode(self) -> None:
        self.d_rooms: dict[int, _DRoom] = {}
        self.p_ranks: dict[str, _PRank] = {}  # peer id ("addr#dp/cp/tp/pp") -> what D knows of that prefill rank
        self._threads = [
            threading.Thread(target=self._recv_loop, args=(self._d_handle,), name="kvl-d-recv", daemon=True),
            threading.Thread(target=self._d_housekeeping, name="kvl-d-hb", daemon=True),
            threading.Thread(target=self._d_pump, name="kvl-d-pump", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def peer_id(bootstrap_addr: str, info: dict) -> str:
        """A prefill rank's stable identity across its restarts (its epoch is what changes)."""
        return f"{bootstrap_addr}#{info.get('kvl_rank_key', '?')}"

    def register_message(self) -> wire.Register:
        return wire.Register(
            self.kvl_agent, self.kvl_epoch, self.local_ip, self.rank_port, self.plane.metadata(),
            list(self.kv_args.kv_data_ptrs), list(self.kv_args.kv_item_lens), self.num_pages,
            list(self.kv_args.aux_data_ptrs), list(self.kv_args.aux_item_lens), list(self.aux_regions.counts),
            self.kv_args.page_size,
            self.attn_tp_size, self.kv_args.engine_rank,
        )

    def build_receiver_registration_message(self) -> list[bytes]:
        return wire.encode(self.register_message())

    def _d_handle(self, frames: list[bytes]) -> None:
        if frames and frames[0] == ABORT_ACK_TAG:
            self.handle_abort_ack_message(frames)
            return
        msg = wire.decode(frames)
        if isinstance(msg, wire.Status):
            self._d_status(msg)
        elif isinstance(msg, wire.AbortAck):
            self._d_abort_ack(msg)
        elif isinstance(msg, wire.Refused):
            self._d_refused(msg)
        elif isinstance(msg, wire.Heartbeat):
            now = time.monotonic()
            with self._lock:
                for rank in self.p_ranks.values():
                    if rank.agent == msg.agent and rank.epoch == msg.epoch:
                        rank.last_seen = now
        else:
            raise wire.MalformedMessage(f"{type(msg).__name__} is not a P → D message")

    def _d_status(self, msg: wire.Status) -> None:
        self.ledger.hlc.observe(msg.hlc)
        with self._lock:
            d = self.d_rooms.get(msg.room)
            if d is None or msg.agent not in d.agents:
                return  # a late status for a settled room, or from another incarnation: never applied
        if msg.status == KVPoll.Success:
            with self._lock:
                if msg.prefill_rank in d.ranks_done or not d.loading:
                    return
                d.ranks_done.add(msg.prefill_rank)
                part = len(d.ranks_done) - 1
            if part < d.parts:
                self.ledger.part_done(d.transfer, part)
            self._d_settled(msg.room)
        elif msg.status == KVPoll.Failed:
            # P sends Failed only once none of its writes for the room is in flight
            self._d_fail(msg.room, msg.reason or self.DEFAULT_PREFILL_FAILURE_REASON)

    def _d_abort_ack(self, msg: wire.AbortAck) -> None:
        self.ledger.hlc.observe(msg.hlc)
        with self._lock:
            d = self.d_rooms.get(msg.room)
            if d is None or msg.agent not in d.agents:
                return
            d.acks.add(msg.prefill_rank)
            if msg.generation >= 0:
                self.note_abort_ack(msg.room, msg.prefill_rank, msg.generation)
            why = d.give_up_reason or "aborted by decode"
        self._d_fail(msg.room, f"{why}; prefill acknowledged that its writes settled")

    def _d_refused(self, msg: wire.Refused) -> None:
        """A prefill rank refused our registration: the rooms waiting on it fail now, with its reason."""
        if msg.agent != self.kvl_agent or msg.epoch != self.kvl_epoch:
            return  # meant for another incarnation of this decode
        with self._lock:
            gone = [(pid, r) for pid, r in self.p_ranks.items()
                    if r.agent == msg.prefill_agent and r.epoch == msg.prefill_epoch]
        for pid, rank in gone:
            self._d_peer_gone(pid, rank, f"prefill {pid} refused this decode's registration: {msg.reason}")

    def _d_fail(self, room: int, reason: str) -> None:
        """The room failed and no prefill write is in flight towards it: its load fails in the ledger."""
        assert isinstance(self.ledger, TargetLedger)
        with self._lock:
            d = self.d_rooms.get(room)
            if d is None:
                return
            if room in self.request_status:
                self.record_failure(room, reason)
                self.update_status(room, KVPoll.Failed)
            loading, d.loading = d.loading, False
        if loading and d.transfer in self.ledger.loads:
            self.ledger.fail(d.transfer, reason)
        self._d_settled(room)

    def _d_settled(self, room: int) -> None:
        """Success once the ledger made the pages READY_FOR_ATTENTION; a cleared room leaves once settled."""
        assert isinstance(self.ledger, TargetLedger)
        with self._lock:
            d = self.d_rooms.get(room)
            if d is None:
                return
            if d.loading and d.transfer not in self.ledger.loads:
                d.loading = False
                if self.ledger.requests.get(str(room)) is not None:
                    self.update_status(room, KVPoll.Success)
            if d.cleared and not d.loading:
                self.d_rooms.pop(room, None)

    def d_claim(self, receiver: KVLifecycleKVReceiver) -> None:
        """receiver.init(): tell every prefill rank of the room that a decode waits for it, learn the ranks."""
        room = receiver.bootstrap_room
        infos = receiver.bootstrap_infos or []
        assert isinstance(self.ledger, TargetLedger)
        with self._lock:
            d = self.d_rooms.setdefault(room, _DRoom(room, receiver.bootstrap_addr))
            d.agents = {i.get("kvl_agent", "") for i in infos}
            d.peers = {self.peer_id(receiver.bootstrap_addr, i) for i in infos}
        for info in infos:
            pid = self.peer_id(receiver.bootstrap_addr, info)
            epoch = int(info.get("kvl_epoch", 0))
            with self._lock:
                known = self.p_ranks.get(pid)
                if known is None or known.epoch != epoch:
                    self.p_ranks[pid] = _PRank(receiver.bootstrap_addr, info.get("kvl_agent", ""), epoch,
                                               info["rank_ip"], int(info["rank_port"]), time.monotonic())
            if known is None:
                self.ledger.peer_restarted(pid, epoch)  # first sight: records the epoch loads are checked against
            sock, lock = receiver._connect_to_bootstrap_server(info)
            try:
                with lock:
                    sock.send_multipart(wire.encode(wire.Claim(room, self.kvl_agent, self.kvl_epoch)))
            except zmq.ZMQError:
                pass  # the heartbeat window decides about a prefill we cannot reach

    def d_publish(self, receiver: KVLifecycleKVReceiver, kv_indices: np.ndarray, aux_index: int | None,
                  decode_prefix_len: int | None) -> None:
        """send_metadata: reserve the pages, start the load (push: the pages are now exposed), tell every P rank."""
        assert isinstance(self.ledger, TargetLedger)
        room = receiver.bootstrap_room
        pages = np.asarray(kv_indices, dtype=np.int32)
        transfer = room_transfer_id(room)
        infos = receiver.bootstrap_infos or []
        real = [i for i in infos if not i.get("is_dummy")] or infos
        peer = self.peer_id(receiver.bootstrap_addr, real[0]) if real else ""
        with self._lock:
            d = self.d_rooms.setdefault(room, _DRoom(room, receiver.bootstrap_addr))
            d.transfer = transfer
            d.parts = max(1, int(getattr(receiver, "required_prefill_response_num", 1) or 1))
            d.agents = {i.get("kvl_agent", "") for i in infos}
        try:
            self.ledger.reserve(str(room), pages)
            self.ledger.start_load(str(room), transfer, parts=d.parts, peer=peer, mode="push",
                                   peer_epoch=int(real[0].get("kvl_epoch", 0)) if real else 0)
        except (LedgerError, ValueError) as exc:
            if str(room) in self.ledger.requests:
                self.ledger.cancel(str(room))
            self.record_failure(room, f"decode ledger refused the pages: {exc}")
            self.update_status(room, KVPoll.Failed)
            return
        with self._lock:
            d.loading = True
            d.published_at = time.monotonic()
        for info in infos:
            meta = wire.RoomMeta(room, self.kvl_agent, self.kvl_epoch, transfer,
                                 b"" if info.get("is_dummy") else pages.tobytes(),
                                 -1 if aux_index is None else int(aux_index), receiver.required_dst_info_num,
                                 int(decode_prefix_len or 0), bool(info.get("is_dummy")))
            sock, lock = receiver._connect_to_bootstrap_server(info)
            try:
                with lock:
                    sock.send_multipart(wire.encode(meta))
            except zmq.ZMQError as exc:
                # nothing can have been written yet to pages P never heard of
                self._d_fail(room, f"send_metadata to prefill {info.get('rank_ip')}:{info.get('rank_port')} "
                                   f"failed: {exc}")
                return
        self.update_status(room, KVPoll.Transferring)

    def d_release_room(self, room: int) -> None:
        """receiver.clear(): pages READY_FOR_ATTENTION go to the engine (the ledger is done with them); a load still
        in flight is cancelled and stays LOADING until P's ack or failure settles it."""
        assert isinstance(self.ledger, TargetLedger)
        key = str(room)
        req = self.ledger.requests.get(key)
        try:
            if req is not None and req.state == TargetState.READY_FOR_ATTENTION:
                self.ledger.finish(key)
            elif req is not None and not req.cancel_pending:
                self.ledger.cancel(key)
        except LedgerError as exc:
            logger.warning("kvlifecycle: releasing room %s: %s", room, exc)
        with self._lock:
            d = self.d_rooms.get(room)
            if d is not None:
                d.cleared = True
                if not d.loading or key not in self.ledger.requests:
                    self.d_rooms.pop(room, None)
        if self.ledger.log is not None:
            self.ledger.commit()

    def _d_pump(self) -> None:
        """Drive this agent's UCX worker (no progress thread): P's first write to us needs our side of the
        wire-up. Fast while rooms are loading, slow when idle."""
        while not self._stop.is_set():
            busy = any(d.loading for d in list(self.d_rooms.values()))
            with contextlib.suppress(Exception):
                self.plane.agent.get_new_notifs()
            time.sleep(0.001 if busy else 0.02)

    def _d_housekeeping(self) -> None:
        """Heartbeats to prefill ranks (listing the rooms we wait on), their silence and their epochs."""
        while not self._stop.wait(self.settings.heartbeat_s):
            with self._lock:
                ranks = dict(self.p_ranks)
                rooms_of: dict[str, list[int]] = defaultdict(list)
                for d in self.d_rooms.values():
                    for pid in d.peers:
                        rooms_of[pid].append(d.room)
            for pid, rank in ranks.items():
                hb = wire.Heartbeat(self.kvl_agent, self.kvl_epoch, "decode", self.local_ip, self.rank_port,
                                    rooms=rooms_of.get(pid, []), hlc=self.ledger.hlc.tick())
                self._send(rank.ip, rank.port, wire.encode(hb))
            for addr in {r.bootstrap_addr for r in ranks.values()}:
                self._d_check_epochs(addr)
            now = time.monotonic()
            with self._lock:
                silent = [(pid, r) for pid, r in self.p_ranks.items()
                          if now - r.last_seen > self.settings.peer_timeout_s]
            for pid, rank in silent:
                self._d_peer_gone(pid, rank, f"prefill {pid} silent for more than "
                                             f"{self.settings.peer_timeout_s:g} s")
            self._d_give_up_unserved(time.monotonic())
            if self.ledger.log is not None:
                self.ledger.commit()

    def _d_give_up_unserved(self, now: float) -> None:
        """A live prefill that does not serve a room within the serve bound: ask it to stop (it acks once its
        writes settled; the room then fails); without an ack within the peer timeout the room fails anyway."""
        bound = self.settings.serve_timeout_s
        with self._lock:
            late = [d for d in self.d_rooms.values() if d.loading and d.published_at is not None
                    and now - d.published_at > bound]
            targets: list[tuple[_DRoom, list[_PRank]]] = []
            overdue: list[_DRoom] = []
            for d in late:
                if d.gave_up_at is None:
                    d.gave_up_at = now
                    d.give_up_reason = f"prefill did not serve room {d.room} within {bound:g} s of its metadata"
                    targets.append((d, [self.p_ranks[p] for p in d.peers if p in self.p_ranks]))
                elif now - d.gave_up_at > self.settings.peer_timeout_s:
                    overdue.append(d)
        for d, ranks in targets:
            logger.error("kvlifecycle: %s; asking %d prefill rank(s) to stop", d.give_up_reason, len(ranks))
            msg = wire.GiveUp(d.room, self.kvl_agent, self.kvl_epoch, self.local_ip, self.rank_port,
                              d.give_up_reason)
            for rank in ranks:
                self._send(rank.ip, rank.port, wire.encode(msg))
        for d in overdue:
            self._d_fail(d.room, f"{d.give_up_reason}; the prefill did not acknowledge within "
                                 f"{self.settings.peer_timeout_s:g} s")

    def _d_check_epochs(self, addr: str) -> None:
        """Ask the bootstrap server which epoch each prefill rank runs under; a changed one is a restart."""
        try:
            resp = requests.get(f"http://{addr}/kvl/epochs", timeout=(1, 2))
            ranks = resp.json().get("ranks", {}) if resp.status_code == 200 else None
        except Exception:
            ranks = None
        if not ranks:
            return
        with self._lock:
            restarted = [(pid, r, int(ranks[pid.split("#", 1)[1]]["epoch"])) for pid, r in self.p_ranks.items()
                         if r.bootstrap_addr == addr and pid.split("#", 1)[1] in ranks
                         and int(ranks[pid.split("#", 1)[1]]["epoch"]) != r.epoch]
        for pid, rank, epoch in restarted:
            self._d_peer_gone(pid, rank, f"prefill {pid} restarted: epoch {rank.epoch} -> {epoch}", new_epoch=epoch)

    def _d_peer_gone(self, pid: str, rank: _PRank, reason: str, new_epoch: int | None = None) -> None:
        """A prefill rank died or restarted: fail its rooms now, drop its cached bootstrap info and connection."""
        assert isinstance(self.ledger, TargetLedger)
        with self._lock:
            if self.p_ranks.get(pid) is rank:
                del self.p_ranks[pid]
            rooms = [d.room for d in self.d_rooms.values() if pid in d.peers]
            for key in [k for k in self.connection_pool if k.startswith(rank.bootstrap_addr)]:
                del self.connection_pool[key]
            self.prefill_info_table.pop(rank.bootstrap_addr, None)
            self.heartbeat_failures.pop(rank.bootstrap_addr, None)
        if new_epoch is not None:
            # recorded in the log; loads started under the old epoch fail inside the ledger
            self.ledger.peer_restarted(pid, new_epoch)
        CommonKVReceiver.disconnect_endpoint(NetworkAddress(rank.ip, rank.port).to_tcp())
        logger.error("kvlifecycle: %s; failing %d room(s)", reason, len(rooms))
        for room in rooms:
            # a dead (or restarted) prefill writes nothing more: the pages are settled
            self._d_fail(room, reason)

    def d_room_status(self, room: int) -> KVPoll:
        return self.request_status.get(room, KVPoll.Failed)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        with self._lock:
            d = self.d_rooms.get(bootstrap_room)
            acks = len(d.acks) if d is not None else required_acks
        return acks >= required_acks or super().is_abort_release_safe(bootstrap_room, required_acks)


class KVLifecycleKVSender(CommonKVSender):
    """P side of one room. ``poll`` is read off the source ledger (see :meth:`KVLifecycleKVManager.p_room_status`)."""

    kv_mgr: KVLifecycleKVManager

    def __init__(self, mgr: KVLifecycleKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        with mgr._lock:
            mgr._room(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        with mgr._lock:
            r = mgr.rooms.get(bootstrap_room)
            if r is not None and r.failure is not None:
                mgr.update_status(bootstrap_room, KVPoll.Failed)
            elif r is not None and r.bootstrapped:
                mgr.update_status(bootstrap_room, KVPoll.WaitingForInput)

    def poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.p_room_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
            if status == KVPoll.Success and self._transfer_start_time is not None:
                self._transfer_metric.transfer_latency_s = time.perf_counter() - self._transfer_start_time
        return status

    def poll_pp_consensus(self) -> KVPoll:
        return self.poll()

    def abort(self) -> None:
        """A P-side abort reaches D at once (SGLang's own backends let D wait out its 300 s timeout)."""
        mgr = self.kv_mgr
        with mgr._lock:
            r = mgr._room(self.bootstrap_room)
            if r.failure is None and not r.success_sent:
                r.failure = "aborted on prefill (AbortReq)"
                mgr._fail_room_locked(r)
        mgr._p_cancel_leases(self.bootstrap_room)
        super().abort()
        self.conclude_state = mgr.p_room_status(self.bootstrap_room)
        if self.conclude_state != KVPoll.Failed:
            self.conclude_state = None  # a write still in flight: Failed once it settled

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.p_release_room(self.bootstrap_room)


class KVLifecycleKVReceiver(CommonKVReceiver):
    """D side of one room. ``poll`` is Success only once the target ledger made the pages READY_FOR_ATTENTION."""

    kv_mgr: KVLifecycleKVManager

    def __init__(self, mgr: KVLifecycleKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
        # the receiver's own birth: the bound on a prefill that never appears starts here (a room record made on
        # the spot at each poll would restart it every time)
        self.kvl_created = time.monotonic()
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.required_prefill_response_num = 1
        self.required_dst_info_num = 1
        self.bootstrap_infos: list[dict] | None = None

    def init(self, prefill_dp_rank: int) -> None:
        super().init(prefill_dp_rank)
        if self.conclude_state is None and self.bootstrap_infos:
            self.kv_mgr.d_claim(self)

    def _poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        status = self.kv_mgr.d_room_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
            return status
        if status == KVPoll.Bootstrapping:
            age = time.monotonic() - self.kvl_created
            if self.bootstrap_addr not in self.kv_mgr.prefill_info_table and \
                    age > self.kv_mgr.settings.claim_timeout_s:
                reason = (f"prefill at {self.bootstrap_addr} never appeared within "
                          f"{self.kv_mgr.settings.claim_timeout_s:g} s")
                self.kv_mgr.record_failure(self.bootstrap_room, reason)
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return KVPoll.Failed
        return status

    def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=None,
                      destination=None, device_kv_indices=None) -> None:
        if self.conclude_state == KVPoll.Failed:
            return
        if self.bootstrap_infos is None:
            self.kv_mgr.record_failure(self.bootstrap_room,
                                       f"could not fetch prefill parallel info from {self.bootstrap_addr}")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        if state_indices:
            raise NotImplementedError("kvlifecycle SGLang backend: state indices are not supported yet")
        self.kv_mgr.d_publish(self, kv_indices, aux_index, decode_prefix_len)
        self.init_time = time.time()

    def _check_waiting_timeout(self) -> None:
        return None  # replaced by heartbeats and epochs (see the module docstring)

    def is_abort_release_safe(self) -> bool:
        d = self.kv_mgr.d_rooms.get(self.bootstrap_room)
        infos = self.bootstrap_infos or []
        return d is not None and len(d.acks) >= max(1, len([i for i in infos if not i.get("is_dummy")]))

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.d_release_room(self.bootstrap_room)


class KVLifecycleKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus each prefill rank's agent and epoch (``GET /kvl/epochs``; ``/route``
    answers carry them too), so a decode can tell a restarted prefill from the one it registered with."""

    def __init__(self, host: str, port: int) -> None:
        self.kvl_ranks: dict[str, dict[str, Any]] = {}
        super().__init__(host, port)

    def _setup_routes(self) -> None:
        super()._setup_routes()
        self.app.router.add_get("/kvl/epochs", self._handle_epochs)

    async def _handle_epochs(self, request: web.Request) -> web.Response:
        return web.json_response({"ranks": self.kvl_ranks}, status=200)

    async def _handle_route_put(self, request: web.Request) -> web.Response:
        data = await request.json()
        key = f"{data.get('attn_dp_rank', 0)}/{data.get('attn_cp_rank', 0)}/{data.get('attn_tp_rank', 0)}/" \
              f"{data.get('pp_rank', 0)}"
        if "kvl_agent" in data:
            known = key in self.kvl_ranks
            self.kvl_ranks[key] = {"agent": data["kvl_agent"], "epoch": int(data["kvl_epoch"]),
                                   "rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"])}
            if known:
                # a restarted rank re-registers: it replaces the old row instead of counting twice
                self._registered_count -= 1

        async def _json() -> dict:
            return data

        request.json = _json  # type: ignore[method-assign]
        return await super()._handle_route_put(request)

    async def _handle_route_get(self, request: web.Request) -> web.Response:
        resp = await super()._handle_route_get(request)
        q = request.query
        if resp.status != 200 or q.get("prefill_dp_rank") == "-1":
            return resp
        key = f"{q.get('prefill_dp_rank')}/{q.get('prefill_cp_rank')}/{q.get('target_tp_rank')}/" \
              f"{q.get('target_pp_rank')}"
        row = self.kvl_ranks.get(key)
        if row is None:
            return resp
        import json

        body = json.loads(resp.body)
        body.update(kvl_agent=row["agent"], kvl_epoch=row["epoch"], kvl_rank_key=key)
        return web.json_response(body, status=200)
