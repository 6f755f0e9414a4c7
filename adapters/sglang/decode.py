"""The decode half of the kvlifecycle SGLang backend: :class:`DecodeKVManager`, chosen by
:class:`~kvlifecycle.adapters.sglang.manager.KVLifecycleKVManager` for ``DisaggregationMode.DECODE``.

* The handoff's D side: a :class:`~kvlifecycle.handoff.Consumer` (the handshake with each prefill rank's side
  channel, its compatibility record and agent epoch, push metadata both ways) and a
  :class:`~kvlifecycle.streaming.StreamConsumer`. ``receiver.init`` handshakes with the room's prefill rank (once
  per rank and epoch; a refusal fails the room with P's reason); ``send_metadata`` reserves the room's pages and
  aux row in the :class:`~kvlifecycle.ledger.TargetLedger` and sends the reservation to P before P prefills. The
  receiver's ``KVPoll`` is Success only once the ledger made the blocks READY_FOR_ATTENTION; a load the ledger
  failed (P's stop with its reason, the stream's timeout, a restart) fails the room with the ledger's reason.
* Aborts: D's abort cancels the stream; the pages are safe to reuse (``is_abort_release_safe``) once P settled it.
* Epochs and liveness: D reads each prefill's agent epochs off its bootstrap server (``/kvl/epochs``) every
  ``KVL_SGLANG_HEARTBEAT_S``; a rank under a new epoch fails its old incarnation's loads in the ledger
  (``peer_restarted``) and its streams end at once (SGLang #10365); a bootstrap server silent for
  ``KVL_SGLANG_PEER_TIMEOUT_S`` fails the rooms waiting on its ranks, and its ranks are invalidated in the Consumer
  (``invalidate_peer``: their loads and streams end, their links go). The streams heartbeat each prefill rank at
  the same rhythm (``StreamOptions``): a rank that stops answering ends D's streams, a decode P stops hearing P's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np
import requests
from kvlifecycle.adapters.sglang.manager import KVLifecycleKVManager, attention_tp, compat_of, logger, unit_bytes_of
from kvlifecycle.transports.select import SameNodeSelector
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from kvlifecycle.events import TgtLoadFailed
from kvlifecycle.handoff import Consumer, HandoffOptions, SideChannelError
from kvlifecycle.handshake import CompatMismatchError
from kvlifecycle.ledger import LedgerError, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.streaming import StreamConsumer
from kvlifecycle.transport import TransportError

if TYPE_CHECKING:
    from kvlifecycle.adapters.sglang.conn import KVLifecycleKVReceiver

_REFUSED = "refused this decode's registration"


@dataclasses.dataclass(slots=True)
class _PRank:
    """A prefill rank as D knows it (from the bootstrap server and the handshake)."""

    bootstrap_addr: str
    agent: str
    epoch: int
    side: str  # its side channel
    rank_ip: str  # its SGLang rank socket (SGLang's ABORT frames go there)
    rank_port: int
    last_seen: float
    refusal: str = ""  # why its handshake refused this decode ("" : it accepted)


@dataclasses.dataclass(slots=True)
class _DRoom:
    room: int
    bootstrap_addr: str
    peers: list[str]  # the prefill ranks' peer ids, in P TP rank order: part i of the room's load is peers[i]
    transfer: str = ""  # the stream's transfer id once reserved
    loading: bool = False
    reason: str = ""  # why it failed, first cause


def _p_tp_rank(info: dict) -> int:
    """A bootstrap info's prefill attention TP rank (its row key ``dp/cp/tp/pp``; 0 where it names none)."""
    parts = str(info.get("kvl_rank_key", "")).split("/")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else 0


class DecodeKVManager(KVLifecycleKVManager, role=DisaggregationMode.DECODE):
    """The manager of a decode scheduler rank: reservations streamed into by prefill ranks, and their epochs."""

    ledger: TargetLedger

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.d_rooms: dict[int, _DRoom] = {}
        self.p_ranks: dict[str, _PRank] = {}  # peer id ("addr#dp/cp/tp/pp") -> what D knows of that prefill rank
        self._load_failures: dict[str, str] = {}  # transfer -> the ledger's reason
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self._start_threads(threading.Thread(target=self._d_housekeeping, name="kvl-d-epochs", daemon=True))

    def _start_handoff(self, args: KVArgs, server_args: ServerArgs) -> None:
        self.ledger.listeners.append(self._on_ledger_event)
        self.kvl_tp_size, tp_rank = attention_tp()
        compat = compat_of(args, server_args, self.kvl_tp_size, replicated=self.kvl_kv_replicated)
        self.kvl_unit_bytes = unit_bytes_of(args, self.kvl_tp_size)
        self._heads_known = bool(getattr(args, "total_kv_head_num", 0) or getattr(args, "kv_head_num", 0))
        # the fast path's metadata goes to each prefill rank with the handshake (P's selector picks its writes')
        self.consumer = Consumer(self.ledger, self.plane.transport, compat, tp_rank=tp_rank,
                                 options=HandoffOptions(probe=False, unit_bytes=self.kvl_unit_bytes,
                                                        verify=self.kvl_verify),
                                 fast_transport=self.plane.fast_transport, path_selector=SameNodeSelector(),
                                 digester=self.kvl_digester)
        self.streams = StreamConsumer(self.consumer, options=self.stream_options)

    def _close_handoff(self) -> None:
        self.streams.close()
        self.consumer.close()

    def _on_ledger_event(self, event: Any) -> None:
        if isinstance(event, TgtLoadFailed):
            self._load_failures[event.transfer] = event.reason

    @staticmethod
    def peer_id(bootstrap_addr: str, info: dict) -> str:
        """A prefill rank's stable identity across its restarts (its epoch is what changes)."""
        return f"{bootstrap_addr}#{info.get('kvl_rank_key', '?')}"

    # -- receiver-facing -------------------------------------------------------------------------------------------
    def d_connect(self, receiver: KVLifecycleKVReceiver) -> None:
        """receiver.init(): handshake with every prefill rank the room reads (SGLang's non-dummy bootstrap infos:
        its ``target_tp_ranks``, one rank under equal TP or D TP > P TP, P TP / D TP ranks under P TP > D TP), each
        once per rank and epoch; the first refusal fails the room with P's reason."""
        room = receiver.bootstrap_room
        infos = sorted((i for i in receiver.bootstrap_infos or [] if not i.get("is_dummy")), key=_p_tp_rank)
        pids = [self.peer_id(receiver.bootstrap_addr, info) for info in infos]
        with self._lock:
            self.d_rooms[room] = _DRoom(room, receiver.bootstrap_addr, pids)
        p_tp = getattr(getattr(receiver, "prefill_info", None), "attn_tp_size", self.kvl_tp_size)
        if self.kvl_kv_replicated and p_tp != self.kvl_tp_size:  # the handshake would refuse it too, by field
            self._d_fail(room, f"prefill attention TP {p_tp}, decode {self.kvl_tp_size}: an MLA backend's KV is "
                               "replicated on every TP rank; moving it between different TP sizes is unsupported")
            return
        if not infos:
            self._d_fail(room, f"no prefill rank to read room {room} from at {receiver.bootstrap_addr}")
            return
        if not self._heads_known:
            self._d_learn_heads(infos[0])
        if p_tp != self.kvl_tp_size and not self.kvl_unit_bytes:
            self._d_fail(room, f"prefill attention TP {p_tp}, decode {self.kvl_tp_size}: this decode's KV rows "
                               f"{sorted(set(self.kv_args.kv_item_lens))} do not split into heads × page size")
            return
        for pid, info in zip(pids, infos, strict=True):
            with self._lock:
                rank = self.p_ranks.get(pid)
            if rank is None or rank.epoch != int(info.get("kvl_epoch", 0)):
                rank = self._d_handshake(receiver.bootstrap_addr, pid, info)
            if rank.refusal:
                self._d_fail(room, rank.refusal)
                return

    def _d_learn_heads(self, info: dict) -> None:
        """SGLang's decode makes its manager before it sets any KV head count on the KVArgs (0.5.23 sets them for
        its staging path only, ``disaggregation/decode.py:766-788``): the model's count comes from the prefill's
        bootstrap row then, before the first handshake compares it."""
        heads = info.get("kvl_heads")
        if not isinstance(heads, int) or heads < 1 or heads % self.kvl_tp_size:
            return  # the handshake compares what this decode has, and says what differs
        with self._lock:
            self.kv_args.total_kv_head_num = heads
            self.kv_args.kv_head_num = heads // self.kvl_tp_size
            self.consumer.compat = compat_of(self.kv_args, self.server_args, self.kvl_tp_size,
                                          replicated=self.kvl_kv_replicated)
            self.kvl_unit_bytes = unit_bytes_of(self.kv_args, self.kvl_tp_size)
            self.consumer.options = attrs.evolve(self.consumer.options, unit_bytes=self.kvl_unit_bytes)
            self._heads_known = True

    def _d_handshake(self, addr: str, pid: str, info: dict) -> _PRank:
        side, epoch = str(info.get("kvl_side", "")), int(info.get("kvl_epoch", 0))
        rank = _PRank(addr, str(info.get("kvl_agent", "")), epoch, side, str(info.get("rank_ip", "")),
                      int(info.get("rank_port", 0) or 0), time.monotonic())
        try:
            if not side:
                raise SideChannelError("its bootstrap row names no side channel")
            link = self.consumer.connect(side, push=True)
            rank.agent, rank.epoch = link.agent, link.epoch
        except (CompatMismatchError, TransportError) as exc:
            rank.refusal = f"prefill {pid} {_REFUSED}: KV layout mismatch: {exc}"
        except SideChannelError as exc:
            rank.refusal = f"prefill {pid} {_REFUSED}: {exc}"
        if rank.refusal:
            logger.error("kvlifecycle: %s", rank.refusal)
        with self._lock:
            self.p_ranks[pid] = rank
        return rank

    def d_reserve(self, receiver: KVLifecycleKVReceiver, kv_indices: np.ndarray, aux_index: int | None) -> None:
        """send_metadata: reserve the pages and the aux row, and send the reservation to P before it prefills."""
        room = receiver.bootstrap_room
        with self._lock:
            d = self.d_rooms.get(room)
            ranks = [self.p_ranks.get(pid) for pid in d.peers] if d is not None else []
        refusal = next((r.refusal for r in ranks if r is not None and r.refusal), "")
        if d is None or d.reason or not ranks or None in ranks or refusal:
            self._d_fail(room, (d.reason if d else "") or refusal or f"no handshake with the prefill of room {room}")
            return
        sides = [r.side for r in ranks if r is not None]
        blocks = np.asarray(kv_indices, dtype=np.int32)
        aux_start = self.plane.aux_start
        if aux_index is not None and aux_start is not None:
            blocks = np.append(blocks, np.int32(aux_start + int(aux_index)))  # the aux row: the last block
        key = str(room)
        try:
            self.ledger.reserve(key, blocks)
        except (LedgerError, ValueError) as exc:
            self._d_fail(room, f"decode ledger refused the pages: {exc}")
            return
        try:
            transfer = self.streams.request_streams(key, sides, layers=1)  # one part per prefill rank
        except (LedgerError, ValueError) as exc:
            self.ledger.cancel(key)
            self._d_fail(room, f"stream request refused: {exc}")
            return
        if transfer is None:  # declined: nothing can have been written
            why = self.streams.declines.get(key, "declined")
            self.ledger.cancel(key)
            if why.startswith("push unavailable"):
                why = f"prefill {d.peers[0]} {_REFUSED}: KV layout mismatch: {why}"
            self._d_fail(room, f"prefill declined the room: {why}")
            return
        with self._lock:
            d.transfer, d.loading = transfer, True
        self.update_status(room, KVPoll.Transferring)

    def d_room_status(self, room: int) -> KVPoll:
        with self._lock:
            d = self.d_rooms.get(room)
        if d is not None and d.loading and d.transfer in self.ledger.loads:
            self.streams.expect_notes()  # the scheduler's poll: the stream's landing note is looked for now
        elif d is not None and d.loading:  # the load ended
            d.loading = False
            req = self.ledger.requests.get(str(room))
            if req is not None and req.state == TargetState.READY_FOR_ATTENTION:
                self.update_status(room, KVPoll.Success)
            else:
                self._d_fail(room, self._load_failures.pop(d.transfer, "KV load failed"))
        return self.request_status.get(room, KVPoll.Failed)

    def _d_fail(self, room: int, reason: str) -> None:
        """The room failed (the first reason stays): SGLang reads the reason; the ledger is settled elsewhere."""
        with self._lock:
            d = self.d_rooms.get(room)
            if d is not None:
                if d.reason:
                    return
                d.reason = reason
        self.record_failure(room, reason)
        self.update_status(room, KVPoll.Failed)

    def d_cancel(self, room: int, reason: str) -> None:
        """D's abort: cancel the stream (P stops; the pages are freed once its writes settled), or drop a
        reservation no stream was asked for."""
        self._d_fail(room, reason)
        key = str(room)
        if self.streams.streaming(key):
            self.streams.cancel(key, reason)
            return
        req = self.ledger.requests.get(key)
        if req is not None and req.state == TargetState.RESERVED:
            self.ledger.cancel(key)

    def d_settled(self, room: int) -> bool:
        """No write of P can land in the room's pages any more (its stream ended, or none was asked for)."""
        return not self.streams.streaming(str(room))

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        return self.d_settled(bootstrap_room)

    def d_release_room(self, room: int) -> None:
        """receiver.clear(): pages READY_FOR_ATTENTION go to the engine (the ledger is done with them); a stream still
        under way is cancelled and its pages stay LOADING until P settled it."""
        key = str(room)
        req = self.ledger.requests.get(key)
        try:
            if req is not None and req.state == TargetState.READY_FOR_ATTENTION:
                self.ledger.finish(key)
            elif self.streams.streaming(key):
                self.streams.cancel(key, "receiver cleared")
            elif req is not None and not req.cancel_pending:
                self.ledger.cancel(key)
        except LedgerError as exc:
            logger.warning("kvlifecycle: releasing room %s: %s", room, exc)
        with self._lock:
            d = self.d_rooms.pop(room, None)
        if d is not None:
            self._load_failures.pop(d.transfer, None)

    # -- epochs and liveness ---------------------------------------------------------------------------------------
    def _d_housekeeping(self) -> None:
        while not self._stop.wait(self.settings.heartbeat_s):
            with self._lock:
                addrs = {r.bootstrap_addr for r in self.p_ranks.values()}
            for addr in addrs:
                self._d_check_epochs(addr)
            now = time.monotonic()
            with self._lock:
                silent = [(pid, r) for pid, r in self.p_ranks.items()
                          if now - r.last_seen > self.settings.peer_timeout_s]
            for pid, rank in silent:
                self._d_peer_gone(pid, rank, f"prefill {pid} silent for more than {self.settings.peer_timeout_s:g} s")

    def _d_check_epochs(self, addr: str) -> None:
        """Ask the bootstrap server which epoch each prefill rank runs under; a changed one is a restart."""
        try:
            resp = requests.get(f"http://{addr}/kvl/epochs", timeout=(1, 2))
            ranks = resp.json().get("ranks", {}) if resp.status_code == 200 else None
        except Exception:
            ranks = None
        if not isinstance(ranks, dict):
            return
        now = time.monotonic()
        restarted: list[tuple[str, _PRank, int]] = []
        with self._lock:
            for pid, rank in self.p_ranks.items():
                row = ranks.get(pid.split("#", 1)[1]) if rank.bootstrap_addr == addr else None
                if not isinstance(row, dict):
                    continue
                rank.last_seen = now
                epoch = int(row.get("epoch", rank.epoch))
                if epoch != rank.epoch:
                    restarted.append((pid, rank, epoch))
        for pid, rank, epoch in restarted:
            self._d_peer_gone(pid, rank, f"prefill {pid} restarted: epoch {rank.epoch} -> {epoch}", new_epoch=epoch)

    def _d_peer_gone(self, pid: str, rank: _PRank, reason: str, new_epoch: int | None = None) -> None:
        """A prefill rank died or restarted: its streams end now (no write of it can land any more), its rooms fail,
        its cached bootstrap info and connection go."""
        with self._lock:
            if self.p_ranks.get(pid) is rank:
                del self.p_ranks[pid]
            rooms = [d.room for d in self.d_rooms.values() if pid in d.peers]  # every room this rank is part of
            for key in [k for k in self.connection_pool if k.startswith(rank.bootstrap_addr)]:
                del self.connection_pool[key]
            self.prefill_info_table.pop(rank.bootstrap_addr, None)
            self.heartbeat_failures.pop(rank.bootstrap_addr, None)
        logger.error("kvlifecycle: %s; failing %d room(s)", reason, len(rooms))
        for room in rooms:
            self._d_fail(room, reason)
        if new_epoch is not None:
            # restarted under the same agent name, on the same bootstrap address (the old process gave that port
            # up, so, unlike a P the control plane declared lost, it writes no more): the old incarnation's loads
            # fail in the ledger and its streams end;
            # its link and transport peer are replaced by the next handshake (dropping them here could drop the new
            # incarnation's, which a room may be handshaking with right now)
            self.ledger.peer_restarted(rank.agent, new_epoch)
            self.streams.peer_lost(rank.agent, reason, before_epoch=new_epoch)
        else:
            try:  # lost: its loads and streams end now, its link and transport peer go
                self.consumer.invalidate_peer(rank.agent, rank.epoch, reason)
            except TimeoutError as exc:
                logger.error("kvlifecycle: invalidating prefill %s: %s", pid, exc)
        CommonKVReceiver.disconnect_endpoint(NetworkAddress(rank.rank_ip, rank.rank_port).to_tcp())
