"""The decode half of the kvlifecycle SGLang backend: :class:`DecodeKVManager`, chosen by
:class:`~kvlifecycle.adapters.sglang.conn.KVLifecycleKVManager` for ``DisaggregationMode.DECODE``.

* A :class:`~kvlifecycle.ledger.TargetLedger` over the decode pages: ``reserve`` + ``start_load`` when the receiver
  publishes its pages, ``part_done`` per prefill rank on P's Success, ``fail`` on P's Failed, on an abort ack, on
  P's epoch change, on P's refusal of our registration or on P's silence. The receiver's ``KVPoll`` is Success only
  once the ledger made the pages READY_FOR_ATTENTION.
* Liveness: D heartbeats every prefill rank it knows, listing the rooms it waits on there; a rank silent for
  ``KVL_SGLANG_PEER_TIMEOUT_S`` fails its rooms. A room a live prefill does not serve within
  ``KVL_SGLANG_SERVE_TIMEOUT_S`` of its metadata is given up (``GiveUp``; P acknowledges once its writes settled;
  without an ack the room fails ``KVL_SGLANG_PEER_TIMEOUT_S`` later).
* Epochs: D polls each bootstrap server's ``/kvl/epochs``; a prefill that came back with a new epoch fails the
  rooms of its old incarnation at once and D re-registers with the new one (SGLang #10365).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np
import requests
import zmq
from kvlifecycle.adapters.sglang import wire
from kvlifecycle.adapters.sglang.conn import KVLifecycleKVManager, logger, room_transfer_id
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_ACK_TAG, CommonKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from kvlifecycle.ledger import LedgerError, TargetLedger
from kvlifecycle.machines import TargetState

if TYPE_CHECKING:
    from kvlifecycle.adapters.sglang.conn import KVLifecycleKVReceiver


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


class DecodeKVManager(KVLifecycleKVManager):
    """The manager of a decode scheduler rank: loads into reserved pages, prefill ranks and their epochs."""

    ledger: TargetLedger

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
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
