"""What both halves of the SGLang backend's manager share, and the one class SGLang makes for either role.

SGLang's ``get_kv_class(MANAGER)`` gives one class for both roles, so :class:`KVLifecycleKVManager` holds what both
halves share (settings, agent name and epoch, transport, ledger, compatibility record, SGLang's own control socket)
and makes the half of its role: :class:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager` or
:class:`~kvlifecycle.adapters.sglang.decode.DecodeKVManager`. The halves subclass it and name their role on their
class line; :mod:`kvlifecycle.adapters.sglang.conn`, the module SGLang's lookup loads, imports both. What stays of
SGLang's own control on a rank's socket is its ``ABORT`` frames; any other frame there is refused and counted.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from kvlifecycle.adapters.sglang.transfer import DataPlane, layouts
from kvlifecycle.transports._common import new_epoch  # the transports' agent epoch
from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification, CommonKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device, get_parallel
from sglang.srt.server_args import ServerArgs

from kvlifecycle import envvars
from kvlifecycle.choices import Side
from kvlifecycle.digest import BlockDigester, VerifyMode
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger, open_ledger
from kvlifecycle.protocol.bounds import min_stream_timeout
from kvlifecycle.streaming import StreamOptions
from kvlifecycle.transport import KVLayout, MemoryKind
from kvlifecycle.untrusted import RateLimitedLog

# the backend's one logger (the halves log through it too), named for the module SGLang's lookup loads
logger = logging.getLogger("kvlifecycle.adapters.sglang.conn")


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Bounds of the backend; every one names a cause, none is a fixed 300 s wait."""

    heartbeat_s: float = 1.0  # D reads each prefill's epochs off its bootstrap server this often
    peer_timeout_s: float = 10.0  # a prefill whose bootstrap server is silent this long is dead: its rooms fail
    claim_timeout_s: float = 120.0  # a room D did not reserve for by then fails; so does a prefill that never appears
    serve_timeout_s: float = 300.0  # a reserved room the prefill has not served by then fails on both sides
    write_timeout_s: float = 60.0  # the last chunk's writes must land within this after the serve bound
    log_dir: str = ""
    verify: str = ""  # per-block digests (none | sample | all); "": SGLang's own checksum setting decides

    @classmethod
    def from_env(cls) -> Settings:
        """Read once, through the project's environment registry (``kvlifecycle.envvars``)."""
        return cls(
            heartbeat_s=_float(envvars.SGLANG_HEARTBEAT_S.read()),
            peer_timeout_s=envvars.sglang_peer_timeout_s(),
            claim_timeout_s=_float(envvars.SGLANG_CLAIM_TIMEOUT_S.read()),
            serve_timeout_s=_float(envvars.SGLANG_SERVE_TIMEOUT_S.read()),
            write_timeout_s=_float(envvars.SGLANG_WRITE_TIMEOUT_S.read()),
            log_dir=str(envvars.SGLANG_LOG_DIR.read() or ""),
            verify=str(envvars.SGLANG_VERIFY.read() or ""),
        )

    def verification(self, server_args: ServerArgs, layout: KVLayout) -> tuple[VerifyMode, BlockDigester | None]:
        """The ``verify`` of both halves and the digester over this rank's regions. ``KVL_SGLANG_VERIFY`` if set;
        else ``all`` where the operator turned on SGLang's own KV checksum (``--disaggregation-enable-kv-checksum``,
        which still runs: its aux buffer travels as any aux row), on KV in host memory. Explicit verification of KV
        in VRAM is refused in words (no GPU digester in this backend)."""
        asked = bool(getattr(server_args, "disaggregation_enable_kv_checksum", False))
        host = layout.kind is MemoryKind.DRAM and all(k is MemoryKind.DRAM for k in layout.group_kinds)
        if self.verify:
            mode = VerifyMode.parse(self.verify, "KVL_SGLANG_VERIFY")
            if mode is not VerifyMode.NONE and not host:
                raise ValueError(f"KVL_SGLANG_VERIFY={self.verify}: per-block digests read KV in host memory, and "
                                 "this rank's pages are in VRAM; unset it or set none (SGLang's own "
                                 "--disaggregation-enable-kv-checksum still works)")
        else:
            mode = VerifyMode.ALL if asked and host else VerifyMode.NONE
        if mode is VerifyMode.NONE:
            return mode, None
        from kvlifecycle.transports.digest_host import HostDigester

        return mode, HostDigester(layout)

    def stream_options(self, regions: int) -> StreamOptions:
        """One stream per room, one "layer" over all ``regions``: P's writes of a room end within the serve bound
        + the write timeout of D's reservation (its write window), and D's stream timeout outlasts that window."""
        window = self.serve_timeout_s + self.write_timeout_s
        return StreamOptions(regions_per_layer=regions, write_window_s=window, reservation_ttl_s=window,
                             stream_timeout_s=min_stream_timeout(window) + self.peer_timeout_s,
                             heartbeat_interval_s=self.heartbeat_s, peer_timeout_s=self.peer_timeout_s)


def _float(value: float | None) -> float:
    assert value is not None  # every SGLang timeout has a default in the registry
    return float(value)


def attention_tp() -> tuple[int, int]:
    """This scheduler rank's attention TP size and rank (SGLang's ``get_parallel()``, as ``CommonKVManager`` reads
    them): the TP the KV heads are split over, so the one the handshake compares."""
    parallel = get_parallel()
    return max(1, int(parallel.attn_tp_size or 1)), int(parallel.attn_tp_rank or 0)


def _total_heads(args: KVArgs, tp_size: int) -> int:
    total = int(getattr(args, "total_kv_head_num", 0) or 0)  # SGLang's decode sets the head counts only sometimes
    return total or int(getattr(args, "kv_head_num", 0) or 0) * tp_size or 1


def compat_of(args: KVArgs, server_args: ServerArgs, tp_size: int, *, replicated: bool = False) -> CompatInfo:
    """The compatibility record both sides' handshake compares. The rows' sizes are not in it: the transport checks
    every region's row size against its own when it prepares the push plan (a mismatch is refused there, by name).
    ``tp_size`` is SGLang's attention TP size; the heads are the model's (all ranks'). ``replicated``: an MLA
    backend, whose latent KV is whole on every rank (the handshake refuses it between different TP sizes)."""
    return CompatInfo(model_id=str(server_args.model_path)[:256], dtype=str(args.kv_cache_dtype_str or "auto"),
                      num_layers=max(1, len(args.kv_data_ptrs)), num_kv_heads=_total_heads(args, tp_size),
                      head_size=1, block_size=int(args.page_size), kv_layout="NHD", tp_size=max(1, tp_size),
                      kv_replicated=replicated)


def unit_bytes_of(args: KVArgs, tp_size: int) -> int:
    """Bytes of one head × one token in a KV page row of this rank (``HandoffOptions.unit_bytes``: the TP plan's
    views are in those units, the compatibility record's ``head_size`` being 1). 0 when the rows do not split
    evenly into this rank's heads × the page size (K and V rows of different sizes): no heterogeneous TP then."""
    heads = int(getattr(args, "kv_head_num", 0) or 0) or _total_heads(args, tp_size) // tp_size
    rows = {int(n) for n in args.kv_item_lens}
    per_page = max(1, heads) * max(1, int(args.page_size))
    if len(rows) != 1 or next(iter(rows)) % per_page:
        return 0
    return next(iter(rows)) // per_page


# role -> its half, filled as each half's class is defined (``__init_subclass__``)
_halves: dict[DisaggregationMode, type[KVLifecycleKVManager]] = {}


class KVLifecycleKVManager(CommonKVManager):
    """One per scheduler rank: what both halves share. Made through this class (as SGLang does), it is the half of
    its role, a :class:`~kvlifecycle.adapters.sglang.prefill.PrefillKVManager` or a
    :class:`~kvlifecycle.adapters.sglang.decode.DecodeKVManager`: each registers for its role as it is defined, so
    this module imports neither (they import it)."""

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
            half = _halves.get(disaggregation_mode)
            if half is None:
                raise LookupError(f"no half of the kvlifecycle SGLang manager serves {disaggregation_mode!r} (the "
                                  "halves are defined when kvlifecycle.adapters.sglang.conn is imported)")
            cls = half
        return super().__new__(cls)

    def __init_subclass__(cls, *, role: DisaggregationMode | None = None, **kwargs: Any) -> None:
        """A half names the role it serves on its class line (``role=DisaggregationMode.PREFILL``)."""
        super().__init_subclass__(**kwargs)
        if role is not None:
            _halves[role] = cls

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: bool | None = False,
    ) -> None:
        self.settings = Settings.from_env()
        self.kvl_kv_replicated = bool(is_mla_backend)  # before the handoff starts: its compatibility record says it
        self.kvl_epoch = new_epoch()
        self.kvl_side = Side.SOURCE if disaggregation_mode == DisaggregationMode.PREFILL else Side.TARGET
        self.kvl_agent = self._agent_name(args, server_args)
        if args.state_types:
            raise NotImplementedError(f"kvlifecycle SGLang backend: state pools {args.state_types} not supported yet")
        device = get_device().device
        if device not in ("cpu", "cuda"):
            raise NotImplementedError(f"kvlifecycle SGLang backend moves KV in host memory or on CUDA GPUs, not on "
                                      f"device {device!r}")
        # two region groups of one layout: KV pages, and aux rows (one per running request). On a GPU the pages are
        # VRAM and the aux rows (SGLang's metadata buffers) host memory, as SGLang's own NIXL backend registers them
        kind = MemoryKind.VRAM if device == "cuda" else MemoryKind.DRAM
        self.kv_layout = layouts(args.kv_data_ptrs, args.kv_data_lens, args.kv_item_lens,
                                 args.aux_data_ptrs, args.aux_data_lens, args.aux_item_lens, kind=kind,
                                 device_id=int(args.gpu_id) if device == "cuda" else 0, aux_kind=MemoryKind.DRAM)
        self.plane = DataPlane(self.kvl_agent, self.kvl_epoch, self.kv_layout)
        self.num_pages = self.plane.num_pages
        # one log per incarnation: a restarted prefill keeps its agent name, under a new epoch
        log_dir = os.path.join(self.settings.log_dir, f"{self.kvl_agent}.{self.kvl_epoch}") if self.settings.log_dir \
            else None
        # the ledgers span pages and aux rows (one block id space): a room's blocks are its pages, then its aux row
        self.ledger: SourceLedger | TargetLedger = open_ledger(self.kvl_side, self.kv_layout.num_blocks, log_dir,
                                                               worker=self.kvl_agent)
        self.ledger_log_dir = log_dir
        self.stream_options = self.settings.stream_options(self.kv_layout.num_regions)
        self.kvl_verify, self.kvl_digester = self.settings.verification(server_args, self.kv_layout)
        self.malformed = 0  # frames on SGLang's rank socket that are not SGLang's ABORT (counted, logged bounded)
        self._log_malformed = RateLimitedLog(logger)
        self._log_handler_error = RateLimitedLog(logger, level=logging.ERROR)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # the handoff before SGLang's own setup: a prefill registers at its bootstrap server inside it, and
        # publishes its side channel there
        self._start_handoff(args, server_args)
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self.pp_size > 1 or self.attn_cp_size > 1 or self.kv_shard_size > 1:
            self.close()
            raise NotImplementedError("kvlifecycle SGLang backend: PP, CP and KV sharding are not supported yet")

    def _agent_name(self, args: KVArgs, server_args: ServerArgs) -> str:
        """A decode's agent is new each start; a prefill rank keeps its name across restarts (its epoch changes),
        so a decode's ledger sees one peer come back under a new epoch and fails the old incarnation's loads."""
        if self.kvl_side is Side.TARGET:
            return f"kvl-decode-{uuid.uuid4().hex[:12]}"
        return (f"kvl-prefill-{socket.gethostname()}-{server_args.disaggregation_bootstrap_port}-"
                f"dp{getattr(args, 'system_dp_rank', 0) or 0}-tp{args.engine_rank}-pp{args.pp_rank}")

    def _start_handoff(self, args: KVArgs, server_args: ServerArgs) -> None:
        raise NotImplementedError  # each half makes its side of the handoff

    # -- SGLang's rank socket: its ABORT frames, nothing else -----------------------------------------------------
    def _serve_rank_socket(self, on_abort: Callable[[AbortNotification], None]) -> None:
        """Serve SGLang's rank socket until closed: an ``ABORT`` frame (SGLang's receiver sends it) is handed on;
        any other frame is counted and dropped, logged at a bounded rate (the handoff's own messages travel on the
        side channel). Nothing a peer sends ends this loop."""
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
                self._log_handler_error("kvlifecycle: rank socket receive failed: %s", exc)
                self._stop.wait(0.2)
                continue
            note = AbortNotification.from_zmq(frames) if frames and frames[0] == ABORT_TAG else None
            if note is None:
                self.malformed += 1
                self._log_malformed("kvlifecycle: refused a frame on the rank socket (%d frames, first %.40r)",
                                    len(frames), frames[0] if frames else b"")
                continue
            try:
                on_abort(note)
            except Exception:
                self._log_handler_error("kvlifecycle: ABORT handler failed", exc_info=True)

    def _start_threads(self, *threads: threading.Thread) -> None:
        self._threads = list(threads)
        for t in self._threads:
            t.start()

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status.get(bootstrap_room, KVPoll.Failed)

    def _close_handoff(self) -> None:
        pass  # each half closes its side of the handoff

    def close(self) -> None:
        """Stop the backend's threads, the handoff and the transport (tests, role switch)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)
        self._close_handoff()
        if self.ledger.log is not None:
            self.ledger.log.close()
        self.plane.close()

    def teardown(self) -> None:
        self.close()

