"""SGLang ``--disaggregation-transfer-backend kvlifecycle``: the classes SGLang's scheduler instantiates.

Built on SGLang's ``Common*`` classes (as its NIXL backend is), so the scheduler finds every attribute it reads
(``conclude_state``, ``abort_notified``, ``kv_mgr``, ``prefill_info_table`` ...). What differs is who decides: a
ledger per manager. SGLang's ``get_kv_class(MANAGER)`` gives one class for both roles, so
:class:`KVLifecycleKVManager` holds what both halves share (settings, agent name and epoch, NIXL plane, ledger,
control socket) and makes the half of its role: :class:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager`
(source ledger, leases, writes) or :class:`~kvlifecycle.adapters.sglang.decode.DecodeKVManager` (target ledger,
loads, prefill epochs); each half's module says what it decides. The sender and the receiver here are thin: each
asks its half.

* Liveness: both sides heartbeat each other every ``KVL_SGLANG_HEARTBEAT_S``; a peer silent for
  ``KVL_SGLANG_PEER_TIMEOUT_S`` fails its rooms, instead of SGLang's fixed 300 s bootstrap/waiting timeouts.
* Every room ends within a stated bound, with a reason that names the cause on both sides: a decode room whose
  prefill never appears fails ``KVL_SGLANG_CLAIM_TIMEOUT_S`` after the receiver was made; a room a live prefill
  does not serve within ``KVL_SGLANG_SERVE_TIMEOUT_S`` of its bootstrap fails on P (which tells D), and D gives up
  on it after the same bound (P acknowledges once its writes settled; an unacknowledged give-up fails the room
  ``KVL_SGLANG_PEER_TIMEOUT_S`` later); a prefill that refuses D's registration (e.g. a page size mismatch) says
  so to D, which fails the rooms waiting on it at once; P drops rooms its engine never made a sender for.
* Epochs: every manager has an agent epoch (µs wall clock at start), published through the bootstrap server
  (:class:`KVLifecycleKVBootstrapServer`), so D tells a restarted prefill from the one it registered with
  (SGLang #10365).
* Aborts: an ABORT from D is acknowledged once every write P posted for the room has settled
  (``is_abort_release_safe``); a P-side abort or failure reaches D at once (SGLang #36033, #28651).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from aiohttp import web
from kvlifecycle.adapters.sglang import wire
from kvlifecycle.adapters.sglang.plane import NixlPlane, Regions
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
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
from kvlifecycle.ledger import SourceLedger, TargetLedger, open_ledger
from kvlifecycle.untrusted import RateLimitedLog

if TYPE_CHECKING:
    from kvlifecycle.adapters.sglang.decode import DecodeKVManager
    from kvlifecycle.adapters.sglang.prefill import PrefillKVManager

logger = logging.getLogger(__name__)

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


class KVLifecycleKVManager(CommonKVManager):
    """One per scheduler rank: what both halves share. Made through this class (as SGLang does), it is the half of
    its role, a :class:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager` or a
    :class:`~kvlifecycle.adapters.sglang.decode.DecodeKVManager`."""

    supports_deferred_decode_kv_release = True
    reports_transfer_latency = True

    def __new__(
        cls,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> KVLifecycleKVManager:
        if cls is KVLifecycleKVManager:
            # imported here: the halves subclass this class, so their modules import this one
            from kvlifecycle.adapters.sglang.decode import DecodeKVManager
            from kvlifecycle.adapters.sglang.prefill import PrefillKVManager

            cls = PrefillKVManager if disaggregation_mode == DisaggregationMode.PREFILL else DecodeKVManager
        return super().__new__(cls)

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
        self.malformed = 0  # control frames refused as malformed (counted; logged at a bounded rate)
        self._log_malformed = RateLimitedLog(logger)
        self._log_handler_error = RateLimitedLog(logger, level=logging.ERROR)
        self._threads: list[threading.Thread] = []

    # -- common helpers --------------------------------------------------------------------------------------------
    def _send(self, ip: str, port: int, frames: list[bytes]) -> bool:
        na = NetworkAddress(ip, port)
        try:
            self._send_multipart_locked(na.to_tcp(), frames, is_ipv6=na.is_ipv6)
            return True
        except Exception as exc:
            logger.debug("kvlifecycle: send to %s:%s failed: %s", ip, port, exc)
            return False

    def _recv_loop(self, handle: Callable[[list[bytes]], None]) -> None:
        """Serve the control socket until closed. Nothing a peer sends ends this loop or floods the log: a
        malformed frame is counted and dropped, a handler's failure logged; both at a bounded rate."""
        poller = zmq.Poller()
        poller.register(self.server_socket, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(200):
                    continue
                frames = self.server_socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:  # the socket itself failed: keep serving, never spin on the log
                self._log_handler_error("kvlifecycle: control socket receive failed: %s", exc)
                self._stop.wait(0.2)
                continue
            try:
                handle(frames)
            except wire.MalformedMessage as exc:
                self.malformed += 1
                self._log_malformed("kvlifecycle: refused a malformed control message: %s", exc)
            except Exception:
                self._log_handler_error("kvlifecycle: control message handler failed", exc_info=True)

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def close(self) -> None:
        """Stop the backend's threads and release NIXL resources (tests, role switch)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        if self.ledger.log is not None:
            self.ledger.log.close()
        self.plane.close()

    def teardown(self) -> None:
        self.close()


class KVLifecycleKVSender(CommonKVSender):
    """P side of one room. ``poll`` is read off the source ledger
    (:meth:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager.p_room_status`)."""

    kv_mgr: PrefillKVManager

    def __init__(self, mgr: PrefillKVManager, bootstrap_addr: str, bootstrap_room: int,
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

    kv_mgr: DecodeKVManager

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
