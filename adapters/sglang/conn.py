"""SGLang ``--disaggregation-transfer-backend kvlifecycle``: the classes SGLang's scheduler instantiates.

Built on SGLang's ``Common*`` classes (as its NIXL backend is), so the scheduler finds every attribute it reads
(``conclude_state``, ``abort_notified``, ``kv_mgr``, ``prefill_info_table`` ...). What differs is who decides: the
handoff of the core, the one vLLM uses. A room is a layer-wise stream of one "layer" that spans every region (KV
pages and aux rows, two region groups of one layout): D reserves its pages and aux row and sends the reservation
to P's side channel before P prefills (:class:`~kvlifecycle.streaming.StreamConsumer`; SGLang's
``WaitingForInput``), and P posts each chunk's pages as the chunk is sent, the last with the aux row
(:class:`~kvlifecycle.streaming.StreamProducer`), through :mod:`kvlifecycle.transports`. The handshake,
compatibility record and agent epochs are the side channel's (:class:`~kvlifecycle.handoff.Producer` /
:class:`~kvlifecycle.handoff.Consumer`); aborts both ways are the stream's (P's abort reaches D before any byte;
D's cancel is settled once P's writes landed).

SGLang's ``get_kv_class(MANAGER)`` gives one class for both roles,
:class:`~kvlifecycle.adapters.sglang.manager.KVLifecycleKVManager` (what both halves share, in :mod:`.manager`),
which makes the half of its role: :class:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager` or
:class:`~kvlifecycle.adapters.sglang.decode.DecodeKVManager`; this module imports all three, so the class SGLang
gets from here makes either half. What stays of SGLang's own control is its bootstrap: the bootstrap server
publishes each prefill rank's side channel, agent and epoch (:class:`KVLifecycleKVBootstrapServer`), and SGLang's
``ABORT`` frames reach P's rank socket; any other frame there is refused and counted.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web
from kvlifecycle.adapters.sglang.decode import DecodeKVManager
from kvlifecycle.adapters.sglang.manager import KVLifecycleKVManager
from kvlifecycle.adapters.sglang.prefill import PrefillKVManager
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer, CommonKVReceiver, CommonKVSender

# the classes SGLang's lookup returns (the manager is defined in .manager, its halves in .prefill and .decode)
__all__ = ["KVLifecycleKVBootstrapServer", "KVLifecycleKVManager", "KVLifecycleKVReceiver", "KVLifecycleKVSender"]


class KVLifecycleKVSender(CommonKVSender):
    """P side of one room. ``poll`` is read off the room's stream
    (:meth:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager.p_room_status`)."""

    kv_mgr: PrefillKVManager
    conclude_state: KVPoll | None  # the base class's: the room's final state once known

    def __init__(self, mgr: PrefillKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        mgr.p_open_room(bootstrap_room)
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)

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
        """A P-side abort reaches D at once, through the room's stream (SGLang's own backends let D wait out its
        300 s timeout): D hears it before any byte, or once the writes in flight settled."""
        self.kv_mgr.p_fail_room(self.bootstrap_room, "aborted on prefill (AbortReq)")
        super().abort()
        self.conclude_state = self.kv_mgr.p_room_status(self.bootstrap_room)
        if self.conclude_state != KVPoll.Failed:
            self.conclude_state = None  # a write still in flight: Failed once it settled

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.p_release_room(self.bootstrap_room)


class KVLifecycleKVReceiver(CommonKVReceiver):
    """D side of one room. ``poll`` is Success only once the target ledger made the pages READY_FOR_ATTENTION."""

    kv_mgr: DecodeKVManager
    conclude_state: KVPoll | None  # the base class's: the room's final state once known

    def __init__(self, mgr: DecodeKVManager, bootstrap_addr: str, bootstrap_room: int | None = None) -> None:
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
            self.kv_mgr.d_connect(self)

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
        self.kv_mgr.d_reserve(self, kv_indices, aux_index)
        self.init_time = time.time()

    def _check_waiting_timeout(self) -> None:
        return None  # replaced by the serve bound, the stream's timeout and epochs (see the module docstring)

    def _register_kv_args(self) -> bool:
        return True  # the handshake on P's side channel registers this decode (at init, once per rank and epoch)

    def abort(self) -> None:
        """D's abort: SGLang's ABORT tells P's engine; the room's stream is cancelled, and the pages are safe to
        reuse once P settled it (:meth:`is_abort_release_safe`)."""
        super().abort()
        self.kv_mgr.d_cancel(self.bootstrap_room, "aborted by decode")

    def is_abort_release_safe(self) -> bool:
        return self.kv_mgr.d_settled(self.bootstrap_room)

    def _clear(self) -> None:
        super()._clear()
        self.kv_mgr.d_release_room(self.bootstrap_room)


class KVLifecycleKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server plus each prefill rank's agent, epoch and side channel (``GET /kvl/epochs``;
    ``/route`` answers carry them too): where a decode handshakes, and how it tells a restarted prefill from the one
    it handshook with."""

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
                                   "side": str(data.get("kvl_side", "")),
                                   "rank_ip": data["rank_ip"], "rank_port": int(data["rank_port"]),
                                   "heads": data.get("kvl_heads") if isinstance(data.get("kvl_heads"), int) else 0}
            if known:
                # a restarted rank re-registers: it replaces the old row instead of counting twice
                self._registered_count -= 1

        async def _json() -> dict:
            return data

        # aiohttp is typed only where installed (the SGLang environment)
        request.json = _json  # type: ignore[method-assign, assignment, unused-ignore]
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
        body.update(kvl_agent=row["agent"], kvl_epoch=row["epoch"], kvl_side=row["side"], kvl_rank_key=key,
                    kvl_heads=row["heads"])  # the model's KV heads: a decode whose KVArgs carry none takes them
        return web.json_response(body, status=200)
