"""Worker side (vLLM's worker process, where the KV tensors live): ledgers, transport, Producer / Consumer.

- P (``kv_producer`` / ``kv_both``): a :class:`~kvlifecycle.ledger.SourceLedger` and a
  :class:`~kvlifecycle.handoff.Producer` serving grants, handshakes and heartbeats on the side channel. A grant
  command pins the request's blocks under a lease; a released lease (completed, failed, cancelled, expired) is
  reported to vLLM as ``finished_sending`` and only then are the blocks freed (vLLM #21570). With a staging
  policy, the Producer also copies due, unclaimed leases to a host pool (:mod:`.staging`); one released as
  ``staged`` is reported the same way, its grant still published for D to read the host copy.
- D (``kv_consumer`` / ``kv_both``): a :class:`~kvlifecycle.ledger.TargetLedger` and a
  :class:`~kvlifecycle.handoff.Consumer`, which owns each load from its grants to its end; :mod:`.decode_loads`
  hands it vLLM's commands on one adapter thread, never the forward thread. The KV tensors' regions and
  compatibility record are :mod:`.kv_caches`'.
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
import re
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle.digest import BlockDigester, VerifyMode
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.layout import tp_consumers
from kvlifecycle.ledger import LedgerError, SourceLedger, TargetLedger, open_ledger
from kvlifecycle.machines import TargetState
from kvlifecycle.staging_policy import StageWhen
from kvlifecycle.transport import KVLayout, MemoryKind

from .config import AdapterConfig, FastPath
from .decode_loads import DecodeLoads
from .kv_caches import compat_info, describe_kv_caches
from .membership import WorkerMembership
from .metadata import GrantCmd, KVLifecycleMetadata
from .scheduler import side_channel_port
from .staging import StagingGauges, WorkerStaging
from .streaming import LayerStreaming, layer_indices

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("kvlifecycle.adapters.vllm")
RESERVED = int(TargetState.RESERVED)


def digester_for(verify: VerifyMode, layout: KVLayout) -> BlockDigester | None:
    """What reads a rank's blocks for their per-block digests under ``verify``: none when it is ``none``, a
    ``HostDigester`` over KV in DRAM (vLLM on CPU), a ``GpuDigester`` (Triton kernels) over KV in VRAM. Where KV
    is in VRAM but Triton or CUDA is missing, a ``verify`` other than none is refused (``ValueError``) at start-up,
    naming the option and what to set, rather than handing off unchecked while the operator believes every block
    is checked."""
    if verify is VerifyMode.NONE:
        return None
    if layout.kind is MemoryKind.DRAM:
        from kvlifecycle.transports.digest_host import HostDigester
        return HostDigester(layout)
    try:
        from kvlifecycle.transports.digest_gpu import GpuDigester
        return GpuDigester(layout)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"kv_connector_extra_config verify={verify.value!r} over KV in {layout.kind.value} needs "
                         f"the GPU digester, which cannot run here ({exc}): install Triton with a CUDA torch, or "
                         f"set \"verify\": \"none\" in kv_connector_extra_config, on P and D alike") from exc


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
            verify=config.verify,
        )
        self.transport: Any = None
        self.fast_transport: Any = None  # CUDA IPC over the same regions (same-node GPUs); None: NIXL only
        self.producer: Producer | None = None
        self.consumer: Consumer | None = None
        self.source: SourceLedger | None = None
        self.target: TargetLedger | None = None
        self.loads: DecodeLoads | None = None  # D: the adapter thread and vLLM's receive results
        # P: requests whose blocks vLLM may free now (lease ended, or no grant could be made); any thread adds
        self._results_lock = threading.Lock()
        self._sending_done: set[str] = set()
        self.streaming: LayerStreaming | None = None  # layer-wise streaming (requests the proxy marks for it)
        self.memberships: list[WorkerMembership] = []  # etcd registrations (none without etcd endpoints)
        self.staging: WorkerStaging | None = None  # P's host staging tier (a staging policy in the extra config)
        self.staging_gauges: StagingGauges | None = None  # P: staged blocks, pool occupancy, pinned-block-seconds

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
        digester = digester_for(self.config.verify, layout)  # refuses verify over VRAM before anything starts
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
            self.staging = self._build_staging(layout, f"{agent}-host")
            self.staging_gauges = StagingGauges(self.source, self.staging.pool if self.staging else None)
            # P picks the path of its pushes (layer-wise streams) per D at its handshake, as D picks its reads'
            self.producer = Producer(self.source, self.transport, compat, tp_rank=self.tp_rank,
                                     options=self.options, fast_transport=self.fast_transport,
                                     path_selector=SameNodeSelector(), digester=digester,
                                     staging=self.staging.tier if self.staging is not None else None)
            log.info("KVLifecycleConnector: producer side channel %s", self.producer.address)
        if self.is_consumer:
            self.target = open_ledger("target", self.num_blocks, self._log_dir("target"), fsync=self.config.fsync,
                                      worker=f"d-{self.rank_name}",
                                      failure_policy=self.failure_policy)
            self.loads = DecodeLoads(self.target, self.config, tp_rank=self.tp_rank, tp_size=self.tp_size)
            consumer_options = HandoffOptions(
                secret=self.options.secret, host=self.options.host, port=0,
                request_timeout_s=self.options.request_timeout_s, load_timeout_s=self.options.load_timeout_s,
                verify=self.options.verify, on_abandoned=self.loads.on_abandoned,
                # heterogeneous TP views are in (head x token) units: on vLLM's CPU layout one unit is a token's
                # fused K and V of one head (2 x head_size elements); a K/V-outer region holds K or V alone
                unit_bytes=(1 if caches.kv_outer else 2) * compat.head_size * first.element_size())
            # the Consumer picks the fast path per P at connect (SameNodeSelector: same node, VRAM on both sides,
            # self-test passed) and logs the choice; NIXL stays the fallback
            self.consumer = Consumer(self.target, self.transport, compat, tp_rank=self.tp_rank,
                                     options=consumer_options, fast_transport=self.fast_transport,
                                     path_selector=SameNodeSelector(), digester=digester)
            if digester is not None and self.fast_transport is not None:
                # D's check over CUDA IPC is the copy itself (one kernel moves and digests the words): no read-back
                self.fast_transport.digest_reads(True)
        self.streaming = LayerStreaming(
            producer=self.producer, consumer=self.consumer, layers=caches.num_layers,
            regions_per_layer=2 if caches.kv_outer else 1, stream_timeout_s=self.config.load_timeout_s,
            layer_of=layer_indices(list(kv_caches), [t.data_ptr() for t in kv_caches.values()]), kv_device=first.device)
        if self.loads is not None and self.consumer is not None:
            self.loads.streaming = self.streaming
            self.loads.start(self.consumer)
        self.memberships = WorkerMembership.start(self.config, self.engine_id, producer=self.producer,
                                                  consumer=self.consumer,
                                                  dp=int(self.vllm_config.parallel_config.data_parallel_index))

    def _build_staging(self, layout: KVLayout, agent: str) -> WorkerStaging | None:
        """P's host staging tier when the extra config's policy stages anything (its pool registered with NIXL
        as DRAM in an agent of its own, its ledger logged beside the source ledger's), else None."""
        policy = self.config.staging
        if not policy.enabled:
            return None
        assert self.source is not None
        staging = WorkerStaging.build(policy, self.source, layout, agent, self.config.backends,
                                      self._log_dir("staging"), self.config.fsync)
        when = (f"unclaimed for {policy.stage_after_ms:g} ms" if policy.when is StageWhen.AFTER
                else f"below {policy.free_block_watermark} free blocks")
        log.info("KVLifecycleConnector: host staging pool of %d blocks (%s bytes/block x %d regions), stages a lease "
                 "%s, when full: %s, copy by %s, agent %s", policy.pool_blocks, layout.block_bytes[0],
                 layout.num_regions, when, policy.when_full.value, staging.copy_path, agent)
        return staging

    def _build_fast_path(self, layout: KVLayout, agent: str) -> Any:
        """A CUDA IPC transport over the same regions when the KV lives in VRAM (``fast_path: "auto"``), else
        None. Any reason it cannot be built is logged and leaves NIXL alone: a missing fast path must never stop
        the connector, nor go unnoticed."""
        if self.config.fast_path is FastPath.OFF:
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
        if self.loads is not None:
            self.loads.on_metadata(meta)

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
            self.source.hold(request, block_ids)  # prefix-cached blocks another request holds are shared
            self.source.prefill_done(request)
            self.producer.grant(request, consumers=self.consumers, ttl_s=self.config.lease_ttl_s)
        except (LedgerError, ValueError) as exc:
            # the blocks cannot be handed off: D's grant lookup fails and it reports a load failure
            log.error("cannot grant %s: %s", request, exc)
            with contextlib.suppress(LedgerError):
                if request in self.source.requests and self.source.requests[request].leases:
                    self.source.cancel(request)
                self.source.free_held(request, cache=self.cache_blocks)
            with self._results_lock:
                self._sending_done.add(request)

    def _drain_released(self) -> None:
        """Leases that ended (any reason): free the requests in the ledger now and queue them for vLLM's
        ``finished_sending``. Runs before new grants too, so a block whose lease just ended is not RELEASABLE
        (which cannot be granted) when a new request shares it."""
        assert self.source is not None
        staging = self.staging
        staged_ended = staging.take_ended() if staging is not None else []  # before the releases: see take_ended
        for released in self.source.take_released():
            if released.reason == "staged" and staging is not None:
                # the core released the GPU lease: the copy to host is whole and no read of the GPU copy is in
                # flight. D is served from the host pool, under the grant it will still ask for
                staging.handed_over(released.transfer, released.request)
                log.info("KVLifecycleConnector: %s staged to the host pool (%s); its GPU blocks go back to vLLM",
                         released.request, released.transfer)
            req = self.source.requests.get(released.request)
            if req is None or req.leases:
                continue  # another lease still pins it (prefix shared by two grants)
            try:
                self.source.free_held(released.request, cache=self.cache_blocks)
            except LedgerError as exc:
                log.warning("freeing %s after its lease ended: %s", released.request, exc)
            if released.reason != "staged" or staging is None:
                self._forget_grant(released.request)
            with self._results_lock:
                self._sending_done.add(released.request)
        if staging is not None:
            for request in staging.grants_to_forget(staged_ended):
                self._forget_grant(request)

    def get_transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        if self.source is not None:
            self._drain_released()
            self.source.commit()
        with self._results_lock:
            sending, self._sending_done = self._sending_done, set()
        recving, failed = self.loads.take_results() if self.loads is not None else (set(), set())
        return sending, recving, failed

    def take_failed_blocks(self) -> set[int]:
        return self.loads.take_failed_blocks() if self.loads is not None else set()

    def _forget_grant(self, request: str) -> None:
        producer = self.producer
        if producer is not None:
            producer.forget(request)

    # -- teardown ------------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        for membership in self.memberships:  # first: P drains while its side channel still serves
            membership.stop()
        if self.loads is not None:
            self.loads.stop()
        _close_quietly(self.streaming)
        for closer in (self.consumer, self.producer):
            _close_quietly(closer)
        for ledger in (self.source, self.target):
            if ledger is not None and ledger.log is not None:
                ledger.log.close()
        _close_quietly(self.staging)  # after the Producer: it releases the copies still in flight first
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
