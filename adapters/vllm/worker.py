"""Worker side (vLLM's worker process, where the KV tensors live): ledgers, transport, Producer / Consumer.

- P (``kv_producer`` / ``kv_both``): a :class:`~kvlifecycle.ledger.SourceLedger` and a
  :class:`~kvlifecycle.handoff.Producer` serving grants, handshakes and heartbeats on the side channel. A grant
  command pins the request's blocks under a lease; a released lease (completed, failed, cancelled, expired) is
  reported to vLLM as ``finished_sending`` and only then are the blocks freed (vLLM #21570).
- D (``kv_consumer`` / ``kv_both``): a :class:`~kvlifecycle.ledger.TargetLedger` and a
  :class:`~kvlifecycle.handoff.Consumer`. Everything that may block (fetching the grant, the handshake, the claim)
  runs on one adapter thread, never on the forward thread; completions come back through a ledger listener.
- KV caches in VRAM (``fast_path: "auto"``) also get a CUDA IPC transport over the same regions, handed to both
  as ``fast_transport``: D picks it per P at the handshake when both are on one node; NIXL stays the fallback.

Neither side pins a thread (vLLM's CPU NIXL worker pins the forward thread to one core); the connector's threads
are started free of the forward thread's binding (:meth:`WorkerSide.register_kv_caches` says why), and the NIXL
agent runs without UCX's progress thread (it spins a core); the transport's service thread drives progress.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.handoff import Consumer, GrantReply, HandoffOptions, Producer, SideChannelError
from kvlifecycle.handshake import CompatInfo, CompatMismatchError
from kvlifecycle.layout import UnsupportedMappingError, tp_consumers, tp_source_ranks
from kvlifecycle.ledger import InvalidTransitionError, LedgerError, open_ledger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.transport import KVLayout, MemoryKind, TransportError

from .config import AdapterConfig
from .membership import WorkerMembership
from .metadata import GrantCmd, KVLifecycleMetadata, PeerRef, RecvCmd
from .scheduler import side_channel_port
from .streaming import LayerStreaming, layer_indices

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvlifecycle.adapters.vllm")
RESERVED = int(TargetState.RESERVED)
FREE, PREFIX_CACHED = int(SourceState.FREE), int(SourceState.PREFIX_CACHED)
OWN_SUFFIX = "#own"  # the companion request that holds a request's newly allocated blocks (see _acquire)


class LayoutError(ValueError):
    """vLLM's KV tensors are not in a layout the handoff can move block by block: refused at registration."""


def _layer_key(name: str) -> tuple[Any, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


@dataclass(frozen=True, slots=True)
class KVCaches:
    """vLLM's per-layer KV tensors as the handoff sees them (the same on P and D for the same backend)."""

    layout: KVLayout
    num_layers: int  # distinct KV tensors: layers that share one cache count once
    kv_layout: str  # within a region's block: "HND" (heads outside tokens) or "NHD" (tokens outside heads)
    kv_outer: bool  # [2, blocks, ...] per layer: K and V are two regions; else one region per layer


def _block_major_bytes(cache: torch.Tensor, num_blocks: int) -> tuple[int, str] | None:
    """(bytes per block, "HND" | "NHD") when block ``b`` is ``cache[b]``, one dense span; None otherwise. vLLM
    hands each layer as a logical [blocks, heads, block_size, 2 x head_size] view (K and V fused per token):
    identity memory order is LBHNC (the CPU backend; "HND"), and a block stored token-major under that same view
    is LBNHC (vLLM 0.32's default on GPU with FlashAttention; "NHD")."""
    if cache.dim() < 2 or cache.shape[0] != num_blocks:
        return None
    block = cache[0]
    per_block = block.numel() * cache.element_size()
    if cache.stride(0) * cache.element_size() != per_block:
        return None
    if block.is_contiguous():
        return int(per_block), "HND"
    if block.dim() == 3 and block.permute(1, 0, 2).is_contiguous():
        return int(per_block), "NHD"
    return None


def _kv_outer_bytes(cache: torch.Tensor, num_blocks: int) -> tuple[int, str] | None:
    """(bytes per block, "NHD" | "HND") when the tensor is K/V-outer, [2, blocks, block_size, heads, head_size]
    (FlashAttention's per-layer cache in vLLM releases that allocate K and V outermost), with every K and V block
    dense: in token order (NHD, the default) or head-major (an HND stride order: the same logical shape over
    [2, blocks, heads, block_size, head_size] memory); None otherwise."""
    if cache.dim() != 5 or cache.shape[0] != 2 or cache.shape[1] != num_blocks:
        return None
    block = cache[0, 0]  # [block_size, heads, head_size]; V's blocks have the same strides
    per_block = block.numel() * cache.element_size()
    if cache.stride(1) * cache.element_size() != per_block:
        return None
    if block.is_contiguous():
        return int(per_block), "NHD"
    if block.permute(1, 0, 2).is_contiguous():
        return int(per_block), "HND"
    return None


def _classify(name: str, cache: torch.Tensor, num_blocks: int) -> tuple[bool, int, str]:
    """(K/V-outer, bytes per block and region, "NHD" | "HND") of one layer's cache, or LayoutError in words."""
    major = _block_major_bytes(cache, num_blocks)
    outer = _kv_outer_bytes(cache, num_blocks)
    shape, stride = tuple(cache.shape), cache.stride()
    if major is not None and outer is not None:
        # only possible with 2 blocks: [2, 2, ...] dense reads both ways and moving the wrong one corrupts K/V
        raise LayoutError(f"{name}: KV cache shape {shape} with {num_blocks} blocks is ambiguous (block-major "
                          "[blocks, ...] or K/V-outer [2, blocks, ...]); give vLLM more than 2 KV blocks")
    if outer is not None:
        return True, *outer
    if major is not None:
        return False, *major
    if cache.dim() == 5 and cache.shape[0] == 2 and cache.shape[1] == num_blocks:
        raise LayoutError(f"{name}: K/V-outer KV cache {shape} is not block-contiguous (stride {stride}): each K "
                          "and V block must be one dense [block_size, heads, head_size] or [heads, block_size, "
                          "head_size] span")
    if cache.dim() >= 2 and cache.shape[0] == num_blocks:
        raise LayoutError(f"{name}: blocks are not contiguous (shape {shape}, stride {stride}): each block must be "
                          "one dense span (LBHNC or LBNHC; cross-layer and head-outer layouts are not supported)")
    raise LayoutError(f"{name}: KV cache shape {shape} is neither block-major over {num_blocks} blocks "
                      f"([{num_blocks}, heads, block_size, 2 x head_size]) nor K/V-outer ([2, {num_blocks}, "
                      "block_size, heads, head_size]); cross-layer layouts are not supported")


def describe_kv_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVCaches:
    """Regions in one order on P and D: layers sorted by name; a block-major layer is one region, a K/V-outer
    layer two (K then V). Block ``b`` of a region is ``block_bytes`` bytes at ``base + b * block_bytes``."""
    bases: list[int] = []
    block_bytes: list[int] = []
    seen: set[int] = set()
    kind: MemoryKind | None = None
    device = -1
    form: tuple[bool, str] | None = None  # (K/V-outer, NHD | HND): one for every layer
    for name in sorted(kv_caches, key=_layer_key):
        cache = kv_caches[name]
        if cache.data_ptr() in seen:
            continue  # layers sharing one KV cache
        seen.add(cache.data_ptr())
        this_kind = MemoryKind.DRAM if cache.device.type == "cpu" else MemoryKind.VRAM
        if kind is not None and this_kind != kind:
            raise LayoutError("KV caches live on different memory kinds")
        if kind is MemoryKind.VRAM and cache.get_device() != device:
            raise LayoutError(f"{name}: KV caches live on different devices ({device} and {cache.get_device()})")
        kind, device = this_kind, cache.get_device()
        outer, per_block, order = _classify(name, cache, num_blocks)
        if form is not None and form != (outer, order):
            raise LayoutError(f"{name}: layers mix KV layouts ({'K/V-outer' if outer else 'block-major'} {order} "
                              f"after {'K/V-outer' if form[0] else 'block-major'} {form[1]})")
        form = (outer, order)
        halves = (cache[0], cache[1]) if outer else (cache,)
        bases += [int(half.data_ptr()) for half in halves]
        block_bytes += [per_block] * len(halves)
    if kind is None or form is None:
        raise LayoutError("no KV caches to register")
    layout = KVLayout(kind, 0 if kind is MemoryKind.DRAM else max(device, 0), num_blocks, tuple(bases),
                      tuple(block_bytes))
    return KVCaches(layout, len(seen), form[1], form[0])


def kv_layout_from_caches(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> KVLayout:
    """The regions of :func:`describe_kv_caches`."""
    return describe_kv_caches(kv_caches, num_blocks).layout


def compat_info(vllm_config: VllmConfig, caches: KVCaches, dtype: str) -> CompatInfo:
    model = vllm_config.model_config
    return CompatInfo(
        model_id=str(model.model),
        dtype=dtype,
        # model layers with their own KV cache, not regions: a K/V-outer layer is two regions, and P and D must
        # agree on the model, whatever layout each one's backend chose
        num_layers=caches.num_layers,
        num_kv_heads=int(model.get_total_num_kv_heads()),
        head_size=int(model.get_head_size()),
        block_size=int(vllm_config.cache_config.block_size),
        kv_layout=caches.kv_layout,
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
    )


@dataclass
class _Keepalive:
    address: str  # the P rank's side channel
    grant: GrantReply
    last_beat: float


class GrantCountError(ValueError):
    """P counts its lease's consumers for another D TP size than this D's: a read would release it too early or
    never (P's ``decode_tp_size`` must name this D's TP size)."""


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, config: AdapterConfig, engine_id: str,
                 kv_cache_config: KVCacheConfig) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.vllm_config = vllm_config
        self.config = config
        self.engine_id = engine_id
        self.num_blocks = int(kv_cache_config.num_blocks)
        kv_config = vllm_config.kv_transfer_config
        role = kv_config.kv_role if kv_config is not None else "kv_both"
        self.is_producer = role in ("kv_producer", "kv_both")
        self.is_consumer = role in ("kv_consumer", "kv_both")
        self.failure_policy = getattr(kv_config, "kv_load_failure_policy", "fail") or "fail"
        self.tp_rank = int(get_tensor_model_parallel_rank())
        self.tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        # "<engine>-tp<r>", "<engine>-dp<d>-tp<r>" under DP: vLLM makes each DP rank's engine id unique by a
        # "_dp<d>" tail (a dense model's workers see DP size 1), which the 12-character prefix drops, and two DP
        # ranks' ledgers must not share a worker name
        dp_tail = re.search(r"_dp(\d+)$", engine_id)
        self.rank_name = f"{engine_id[:12]}{f'-dp{dp_tail[1]}' if dp_tail else ''}-tp{self.tp_rank}"
        # P: D ranks that read each of this rank's leases (D TP > P TP: several read slices of one block)
        self.consumers = tp_consumers(p_tp=self.tp_size, d_tp=config.decode_tp_size or self.tp_size)
        self.cache_blocks = bool(vllm_config.cache_config.enable_prefix_caching)
        self.options = HandoffOptions(
            secret=config.secret.encode() if config.secret else None,
            host=config.side_channel_host,
            port=side_channel_port(config, vllm_config, self.tp_rank),
            request_timeout_s=config.handshake_timeout_s,
            load_timeout_s=config.load_timeout_s,
        )
        self.transport: Any = None
        self.fast_transport: Any = None  # CUDA IPC over the same regions (same-node GPUs); None: NIXL only
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.source = None
        self.target = None
        # D: results for vLLM, filled by the ledger listener (any thread), drained on the forward thread
        self._results_lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        # P: requests whose blocks vLLM may free now (lease ended, or no grant could be made)
        self._sending_done: set[str] = set()
        self._load_of_transfer: dict[str, str] = {}
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._grants: dict[tuple[str, str], GrantReply] = {}  # (D request, P rank address) -> its grant
        self._keepalive: dict[tuple[str, str], _Keepalive] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.streaming: LayerStreaming | None = None  # layer-wise streaming (requests the proxy marks for it)
        self.memberships: list[WorkerMembership] = []  # etcd registrations (none without etcd endpoints)

    # -- start-up ----------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Register the caches and start the connector's threads (transport, side channel, Producer, Consumer).

        vLLM's CPU worker binds its forward thread to one core (``VLLM_CPU_OMP_THREADS_BIND``) and threads inherit
        the binding of the thread that starts them: started from here as is, every connector thread would queue
        behind the forward thread on that one core, which spins while a handoff is pending. Measured on real vLLM
        at P TP 1 -> D TP 2 on two cores: a D rank could not complete one side-channel round trip within a 30 s
        lease. So the threads are started with the process's whole CPU set and the forward thread's binding is
        restored afterwards; the forward thread itself is never re-pinned."""
        bound = _widen_affinity()
        try:
            self._register_kv_caches(kv_caches)
        finally:
            _restore_affinity(bound)

    def _register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvlifecycle.transports.nixl import NixlTransport
        from kvlifecycle.transports.select import SameNodeSelector

        caches = describe_kv_caches(kv_caches, self.num_blocks)
        layout = caches.layout
        first = next(iter(kv_caches.values()))
        dtype = str(first.dtype).removeprefix("torch.")
        compat = compat_info(self.vllm_config, caches, dtype)
        agent = f"kvl-{self.rank_name}-{uuid.uuid4().hex[:8]}"
        self.transport = NixlTransport(agent, backends=self.config.backends)
        self.transport.register(layout)
        self.fast_transport = self._build_fast_path(layout, f"{agent}-ipc")
        log.info("KVLifecycleConnector: registered %d regions x %d blocks (%s bytes/block, %s %s, %s), agent %s, "
                 "mode %s, fast path %s", layout.num_regions, layout.num_blocks, layout.block_bytes[0],
                 "K/V-outer" if caches.kv_outer else "block-major", caches.kv_layout, layout.kind.value, agent,
                 self.config.mode, "cuda_ipc offered" if self.fast_transport is not None else "none")
        if self.is_producer:
            self.source = open_ledger("source", self.num_blocks, self._log_dir("source"), fsync=self.config.fsync,
                                      worker=f"p-{self.rank_name}",
                                      default_ttl_s=self.config.lease_ttl_s)
            # P picks the path of its pushes (layer-wise streams) per D at its handshake, as D picks its reads'
            self.producer = Producer(self.source, self.transport, compat, tp_rank=self.tp_rank,
                                     options=self.options, fast_transport=self.fast_transport,
                                     path_selector=SameNodeSelector())
            log.info("KVLifecycleConnector: producer side channel %s", self.producer.address)
        if self.is_consumer:
            self.target = open_ledger("target", self.num_blocks, self._log_dir("target"), fsync=self.config.fsync,
                                      worker=f"d-{self.rank_name}",
                                      failure_policy=self.failure_policy)
            self.target.listeners.append(self._on_target_event)
            consumer_options = HandoffOptions(
                secret=self.options.secret, host=self.options.host, port=0,
                request_timeout_s=self.options.request_timeout_s, load_timeout_s=self.options.load_timeout_s,
                on_abandoned=self._on_abandoned,
                # heterogeneous TP views are in (head x token) units: on vLLM's CPU layout one unit is a token's
                # fused K and V of one head (2 x head_size elements); a K/V-outer region holds K or V alone
                unit_bytes=(1 if caches.kv_outer else 2) * compat.head_size * first.element_size())
            # the Consumer picks the fast path per P at connect (SameNodeSelector: same node, VRAM on both sides,
            # self-test passed) and logs the choice; NIXL stays the fallback
            self.consumer = Consumer(self.target, self.transport, compat, tp_rank=self.tp_rank,
                                     options=consumer_options, fast_transport=self.fast_transport,
                                     path_selector=SameNodeSelector())
            self._thread = threading.Thread(target=self._serve, name="kvl-vllm-consumer", daemon=True)
            self._thread.start()
        self.streaming = LayerStreaming(
            producer=self.producer, consumer=self.consumer, layers=caches.num_layers,
            regions_per_layer=2 if caches.kv_outer else 1, stream_timeout_s=self.config.load_timeout_s,
            layer_of=layer_indices(list(kv_caches), [t.data_ptr() for t in kv_caches.values()]), kv_device=first.device)
        self.memberships = WorkerMembership.start(self.config, self.engine_id, producer=self.producer,
                                                  consumer=self.consumer,
                                                  dp=int(self.vllm_config.parallel_config.data_parallel_index))

    def _build_fast_path(self, layout: KVLayout, agent: str) -> Any:
        """A CUDA IPC transport over the same regions when the KV lives in VRAM (``fast_path: "auto"``), else
        None. Any reason it cannot be built is logged and leaves NIXL alone: a missing fast path must never stop
        the connector, nor go unnoticed."""
        if self.config.fast_path == "off":
            return None
        from kvlifecycle.transports.select import cuda_ipc_fast_path

        return cuda_ipc_fast_path(layout, agent, logger=log, who="KVLifecycleConnector")

    def _log_dir(self, side: str) -> str | None:
        if not self.config.log_dir:
            return None
        path = Path(self.config.log_dir) / f"{side}-{self.rank_name}-{os.getpid()}"
        path.mkdir(parents=True, exist_ok=True)
        return str(path)

    # -- every step (forward thread): cheap, never blocks -------------------------------------------------------
    def on_metadata(self, meta: KVLifecycleMetadata) -> None:
        if meta.grants and self.source is not None:
            self._drain_released()
        for cmd in meta.grants:
            if cmd.stream_key and self._stream_finished(cmd):
                continue
            self._grant(cmd.request, np.asarray(cmd.block_ids, dtype=np.int32))
            if cmd.stream_key and self.producer is not None:  # D's fallback fetches the grant by the stream key
                self.producer.alias_grant(cmd.request, cmd.stream_key)
        # Ends first: vLLM may hand a block it freed from a finished request to one it admitted in the same step,
        # and the ledger reserves that block for the new request only once the old one let it go.
        for request in meta.finishes:
            self._commands.put(("finish", request))
        for peer in meta.announces:
            self._commands.put(("announce", peer))
        for recv in meta.recvs:
            self._commands.put(("recv", recv))
        for peer in meta.skips:
            self._commands.put(("skip", peer))
        for request in meta.cancels:
            self._commands.put(("cancel", request))

    def save_kv_layer(self, layer_name: str, meta: KVLifecycleMetadata) -> None:
        if self.streaming is not None:
            self.streaming.save_layer(layer_name, meta)

    def _stream_finished(self, cmd: GrantCmd) -> bool:
        """A layer-wise P request ended: streamed (no grant; vLLM frees its blocks once the writes settled)?"""
        if self.streaming is None:
            return False

        def sending_done() -> None:
            with self._results_lock:
                self._sending_done.add(cmd.request)

        return self.streaming.finished(cmd.request, cmd.stream_key, aborted=cmd.aborted, sending_done=sending_done)

    def _grant(self, request: str, block_ids: np.ndarray) -> None:
        if self.producer is None or self.source is None:
            log.error("grant for %s on a worker that is not a producer (kv_role)", request)
            return
        try:
            self._acquire(request, block_ids)
            self.source.prefill_done(request)
            self.producer.grant(request, consumers=self.consumers, ttl_s=self.config.lease_ttl_s)
        except (LedgerError, ValueError) as exc:
            # the blocks cannot be handed off: D's grant lookup fails and it reports a load failure
            log.error("cannot grant %s: %s", request, exc)
            with contextlib.suppress(LedgerError):
                if request in self.source.requests and self.source.requests[request].leases:
                    self.source.cancel(request)
                self._free_source(request)
            with self._results_lock:
                self._sending_done.add(request)

    def _acquire(self, request: str, block_ids: np.ndarray) -> None:
        """Enter the request's blocks in the ledger. With prefix caching some of them may already be held by
        another request (e.g. pinned for its own handoff): those are shared (no new epoch), the others allocated.
        The ledger takes one or the other per request, so the newly allocated part is held by a companion
        request ``<id>#own`` that is freed together with the request."""
        assert self.source is not None
        states = self.source.block_states(block_ids)
        fresh = ((states == FREE) | (states == PREFIX_CACHED)) & (self.source.refs[block_ids] == 0)
        if fresh.all():
            self.source.allocate(request, block_ids)
            return
        if fresh.any():
            own = f"{request}{OWN_SUFFIX}"
            self.source.allocate(own, block_ids[fresh])
            self.source.prefill_done(own)
        self.source.share(request, block_ids)

    def _free_source(self, request: str) -> None:
        assert self.source is not None
        for name in (request, f"{request}{OWN_SUFFIX}"):
            if name in self.source.requests:
                self.source.free(name, cache=self.cache_blocks)

    def _drain_released(self) -> None:
        """Leases that ended (any reason): free the requests in the ledger now and queue them for vLLM's
        ``finished_sending``. Runs before new grants too, so a block whose lease just ended is not RELEASABLE
        (which cannot be granted) when a new request shares it."""
        assert self.source is not None
        for released in self.source.take_released():
            req = self.source.requests.get(released.request)
            if req is None or req.leases:
                continue  # another lease still pins it (prefix shared by two grants)
            try:
                self._free_source(released.request)
            except LedgerError as exc:
                log.warning("freeing %s after its lease ended: %s", released.request, exc)
            self._forget_grant(released.request)
            with self._results_lock:
                self._sending_done.add(released.request)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        if self.source is not None:
            self._drain_released()
            self.source.commit()
        with self._results_lock:
            sending, self._sending_done = self._sending_done, set()
            recving, self._done_recving = self._done_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        return sending, recving, failed

    def take_failed_blocks(self) -> set[int]:
        with self._results_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _forget_grant(self, request: str) -> None:
        producer = self.producer
        if producer is not None:
            producer.forget(request)

    # -- D: ledger listener (runs on whichever thread changed the target ledger) ---------------------------------
    def _on_target_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.TgtLoadStarted):
            self._load_of_transfer[event.transfer] = event.request
        elif isinstance(event, ev.TgtPartDone):
            if self.target is not None and event.transfer not in self.target.loads:
                request = self._load_of_transfer.pop(event.transfer, None)
                if request is not None:
                    with self._results_lock:
                        self._done_recving.add(request)
        elif isinstance(event, ev.TgtLoadFailed):
            request = self._load_of_transfer.pop(event.transfer, None)
            if request is not None:
                blocks = self.target.requests.get(request) if self.target is not None else None
                with self._results_lock:
                    self._failed_recving.add(request)
                    self._done_recving.add(request)  # vLLM: a failed receive is also a finished receive
                    if blocks is not None:
                        self._failed_blocks.update(int(b) for b in blocks.blocks)
                if event.recompute:
                    self._commands.put(("release", request))
                log.warning("KV load of %s failed (%s): %s", request,
                            "recompute" if event.recompute else "fail", event.reason)

    def _on_abandoned(self, request: str, reason: str) -> None:
        """The consumer could not start the load (P refused the claim: its lease was gone). No load exists in the
        ledger to fail, so vLLM learns it here; the consumer already applied the policy to the reservation."""
        log.warning("KV load of %s not started: %s", request, reason)
        with self._results_lock:
            self._failed_recving.add(request)
            self._done_recving.add(request)
        self._commands.put(("release", request))

    # -- D: the adapter thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                kind, arg = self._commands.get(timeout=0.05)
            except queue.Empty:
                kind, arg = "", None
            try:
                if kind == "announce":
                    self._announce(arg)
                elif kind == "recv":
                    self._recv(arg)
                elif kind == "skip":
                    self._skip(arg)
                elif kind == "cancel":
                    self._cancel(arg)
                elif kind == "finish":
                    self._finish(arg)
                elif kind == "release":
                    self._release_reservation(arg)
                self._beat_keepalives()
                if self.target is not None:
                    self.target.commit()
            except Exception:
                log.exception("KVLifecycleConnector adapter thread: %s failed", kind or "keepalive")

    def _source_addresses(self, peer: PeerRef) -> list[str]:
        """The side channels of the P ranks this D rank reads (the core's TP plan: rank i <-> rank i at equal
        sizes, several P ranks when P TP > D TP, one shared P rank when P TP < D TP)."""
        ranks = tp_source_ranks(p_tp=peer.remote_tp_size, d_tp=self.tp_size, d_rank=self.tp_rank)
        return [peer.rank_address(rank) for rank in ranks]

    def _fetch_grant(self, peer: PeerRef, address: str) -> GrantReply:
        """P publishes the grant one scheduler step after its request finished: wait for it (bounded). P's
        ``grant_ended`` (the lease ended before D asked, e.g. it expired) is final: no wait, so that one late
        request does not hold this thread, and every request queued behind it, for ``grant_wait_s``."""
        assert self.consumer is not None
        grant = self._grants.get((peer.request, address))
        if grant is None:
            grant = self.consumer.fetch_grant(address, peer.remote_request, wait_s=self.config.grant_wait_s)
            self._grants[(peer.request, address)] = grant
        return grant

    def _announce(self, peer: PeerRef) -> None:
        try:
            addresses = self._source_addresses(peer)
        except UnsupportedMappingError as exc:
            log.warning("request %s: %s; its load will be refused", peer.request, exc)
            return
        for address in addresses:
            try:
                grant = self._fetch_grant(peer, address)
            except SideChannelError as exc:
                log.warning("request %s: no grant from %s yet (%s); will retry when blocks are reserved",
                            peer.request, address, exc)
                continue
            self._keepalive[(peer.request, address)] = _Keepalive(address, grant, 0.0)
        self._beat_keepalives()

    def _drop_keepalives(self, request: str) -> None:
        for key in [key for key in self._keepalive if key[0] == request]:
            del self._keepalive[key]

    def _forget_grants(self, request: str) -> None:
        for key in [key for key in self._grants if key[0] == request]:
            del self._grants[key]

    def _beat_keepalives(self) -> None:
        assert self.consumer is not None
        now = time.monotonic()
        for key, keep in list(self._keepalive.items()):
            if now - keep.last_beat < keep.grant.ttl_s / 6:
                continue
            keep.last_beat = now
            try:
                ack = self.consumer.keep_alive(keep.address, keep.grant, timeout_s=1.0)
            except SideChannelError as exc:
                log.info("heartbeat for %s to %s failed: %s", key[0], keep.address, exc)
                continue
            if not ack.ok:
                log.warning("lease of %s is gone on %s: %s", key[0], keep.address, ack.detail)
                self._keepalive.pop(key, None)

    def _recv(self, cmd: RecvCmd) -> None:
        try:
            self._recv_unguarded(cmd)
        except Exception as exc:  # every shipped recv must settle, or vLLM waits on it forever
            log.exception("request %s: recv failed unexpectedly", cmd.peer.request)
            if self.target is not None and cmd.peer.request in self.target.requests:
                self._fail_before_load(cmd.peer, None, f"internal error: {type(exc).__name__}: {exc}")
            else:
                with self._results_lock:
                    self._failed_recving.add(cmd.peer.request)
                    self._done_recving.add(cmd.peer.request)

    def _recv_unguarded(self, cmd: RecvCmd) -> None:
        assert self.consumer is not None and self.target is not None
        peer = cmd.peer
        blocks = np.asarray(cmd.block_ids, dtype=np.int32)
        try:
            self.target.reserve(peer.request, blocks)
        except LedgerError as exc:
            # vLLM gave us blocks the ledger still sees in use: refuse to load into them
            log.error("request %s: cannot reserve %d blocks: %s", peer.request, blocks.size, exc)
            self._drop_keepalives(peer.request)
            with self._results_lock:
                self._failed_recving.add(peer.request)
                self._done_recving.add(peer.request)
            return
        grants: list[tuple[str, GrantReply]] = []
        try:
            if cmd.stream and self._stream(peer):
                return
            # every P rank's grant before any handshake: a handshake refused by one P rank then tells all of them,
            # instead of leaving the ranks not yet asked pinned until their leases expire
            for address in self._source_addresses(peer):
                grants.append((address, self._fetch_grant(peer, address)))
            for address, grant in grants:
                link = self.consumer.links.get(address)
                if link is None or link.epoch != grant.epoch:  # first contact, or P restarted on this address
                    self._beat_keepalives()  # a first handshake can be slow: the announced leases stay renewed
                    self.consumer.connect(address, push=self.config.mode == "push")
                expected = self.consumer.links[address].plan.consumers_per_p_rank
                if grant.consumers != expected:
                    raise GrantCountError(
                        f"P rank at {address} granted {peer.remote_request} for {grant.consumers} consumer(s), but "
                        f"D TP {self.tp_size} reading P TP {peer.remote_tp_size} makes {expected}: set "
                        f"decode_tp_size={self.tp_size} in P's kv_connector_extra_config")
            if self.config.mode == "push":
                address, grant = grants[0]
                self.consumer.request_push(peer.request, grant, address=address)
            else:
                self.consumer.pull(peer.request, grants)
        except (CompatMismatchError, SideChannelError, TransportError, LedgerError, ValueError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.error("request %s: handoff from %s refused: %s", peer.request, peer.address, reason)
            self._fail_before_load(peer, grants, reason)
        finally:
            self._drop_keepalives(peer.request)  # the consumer's claim heartbeat takes over (or nothing is left)
            self._forget_grants(peer.request)

    def _stream(self, peer: PeerRef) -> bool:
        """Layer-wise: ask P to stream into the reservation; False when declined (the post-prefill path follows)."""
        assert self.consumer is not None and self.streaming is not None
        if peer.remote_tp_size != self.tp_size:  # this adapter streams rank to rank; other sizes pull after it
            return False
        address = self._source_addresses(peer)[0]
        if address not in self.consumer.links:
            self.consumer.connect(address, push=True)
        return self.streaming.request(peer.request, address, peer.remote_request)

    def _consumer_index(self, peer: PeerRef) -> int:
        """This rank's consumer number on a P lease (D TP > P TP: the D ranks sharing one P rank count 0..r-1)."""
        return self.tp_rank % tp_consumers(p_tp=peer.remote_tp_size, d_tp=self.tp_size)

    def _fail_before_load(self, peer: PeerRef, grants: list[tuple[str, GrantReply]], reason: str) -> None:
        """A handoff that never started (no grant, handshake refused): the ledger records a failed load so that
        the failure policy applies, and every P rank whose grant D fetched is told to release now rather than
        at lease expiry (a P rank shared by several D ranks releases when all of them settled)."""
        assert self.consumer is not None
        self.consumer.fail_unstarted(peer.request, grants or [], reason, consumer=self._consumer_index(peer))

    def _skip(self, peer: PeerRef) -> None:
        """Nothing to load (full local prefix hit, or the request never got blocks): release P's grant now."""
        assert self.consumer is not None
        self._drop_keepalives(peer.request)
        grants: list[tuple[str, GrantReply]] = []
        try:
            for address in self._source_addresses(peer):
                try:
                    grants.append((address, self._fetch_grant(peer, address)))
                except SideChannelError as exc:
                    log.info("could not release %s on %s: %s (its lease will expire)", peer.remote_request,
                             address, exc)
            self.consumer.hand_back(grants, "not needed by D", consumer=self._consumer_index(peer))
        except UnsupportedMappingError as exc:
            log.info("could not release %s: %s (its lease will expire)", peer.remote_request, exc)
        finally:
            self._forget_grants(peer.request)

    def _cancel(self, request: str) -> None:
        """vLLM aborted a request whose load it had not seen settle. In flight: the ledger keeps the blocks
        LOADING and the listener reports the request once the transfer settles (vLLM frees the blocks then).
        Otherwise its settling was already reported: only the ledger needs to know."""
        assert self.target is not None
        self._drop_keepalives(request)
        if self.streaming is not None and self.streaming.cancel(request):
            return  # a stream: P stops posting, the blocks go once its writes settled
        if request in self.target.requests:
            self.target.cancel(request)

    def _release_reservation(self, request: str) -> None:
        """After a failed load under policy ``recompute`` vLLM frees the request's blocks and allocates new ones
        for the local prefill (no valid computed tokens): the ledger gives the old reservation back too."""
        assert self.target is not None
        req = self.target.requests.get(request)
        if req is not None and req.transfer is None:
            self.target.cancel(request)

    def _finish(self, request: str) -> None:
        assert self.target is not None
        req = self.target.requests.get(request)
        if req is None:
            return  # a failed load already freed it
        try:
            if req.transfer is None and req.state == RESERVED:  # the request's own state: no full-array view
                self.target.local_fill(request)  # RESERVED after a failed load: vLLM recomputed it
            self.target.finish(request)
        except (InvalidTransitionError, LedgerError) as exc:
            log.warning("finishing %s: %s", request, exc)

    # -- teardown ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for membership in self.memberships:  # first: P drains while its side channel still serves
            membership.stop()
        self._stop.set()
        _close_quietly(self.streaming)
        if self._thread is not None:
            self._thread.join(5)
        for closer in (self.consumer, self.producer):
            _close_quietly(closer)
        for ledger in (self.source, self.target):
            if ledger is not None and ledger.log is not None:
                ledger.log.close()
        for transport in (self.transport, self.fast_transport):
            _close_quietly(transport)


def _widen_affinity() -> set[int] | None:
    """Let threads started by the calling thread run on every CPU of the process's cgroup; returns the calling
    thread's previous CPU set (None: nothing changed, e.g. not Linux or already unbound)."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    bound = os.sched_getaffinity(0)
    wide = set(range(os.cpu_count() or 1))
    if wide <= bound:
        return None
    try:
        os.sched_setaffinity(0, wide)  # the kernel keeps the part the cgroup allows
    except OSError as exc:
        log.info("connector threads keep the forward thread's CPU binding %s: %s", sorted(bound), exc)
        return None
    return bound


def _restore_affinity(bound: set[int] | None) -> None:
    if bound is not None:
        os.sched_setaffinity(0, bound)


def _close_quietly(part: Any) -> None:
    """Close ``part`` (if any) and log a failure instead of raising: shutdown must finish."""
    if part is None:
        return
    try:
        part.close()
    except Exception as exc:
        log.warning("closing %s: %s", type(part).__name__, exc)
