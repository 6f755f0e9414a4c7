"""``KVLifecycleConnector``: vLLM's KV connector interface as a thin facade over :mod:`.scheduler` and
:mod:`.worker` (one or the other per instance, as vLLM builds one connector per role)."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import AdapterConfig
from .metadata import KVLifecycleMetadata
from .nixl_migration import check_buffer_device, check_transfer_config
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvlifecycle import events as ev

    from .stats import KVLifecyclePromMetrics, KVLifecycleStats


def _log_through_vllm() -> None:
    """Route kvlifecycle's log records to vLLM's handlers (vLLM configures only its own logger tree)."""
    ours = logging.getLogger("kvlifecycle")
    if ours.handlers:
        return
    for handler in logging.getLogger("vllm").handlers:
        ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    ours.propagate = False


def check_supported_parallelism(vllm_config: VllmConfig) -> None:
    """Refuse, at start-up and in words, what this connector cannot move correctly; a silent partial or wrong
    handoff is worse than a clear refusal.

    - Tensor parallelism: any size (each rank moves its own heads; unequal P and D sizes go through the core's
      TP plans at the handshake).
    - Pipeline parallelism: refused. Each stage would have to publish and read its own layers under its own
      lease, and the request be ready only when every stage's layers landed; that is not wired.
    - MLA (DeepSeek-style latent KV, replicated on every TP rank): refused. Every rank holds the whole latent
      cache, so the per-rank head slicing of the TP plans would move each block TP times or split a latent
      vector that must not be split.
    - Hybrid models (attention + Mamba / linear-attention state, several KV cache groups): refused. Their
      recurrent state is not a block of the paged KV cache, and this connector moves one KV cache group.
    """
    parallel = vllm_config.parallel_config
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp != 1:
        raise ValueError(
            f"KVLifecycleConnector does not support pipeline parallelism (pipeline_parallel_size={pp}): each "
            "stage would have to hand off its own layers; run P and D with pipeline_parallel_size=1 "
            "(tensor parallelism of any size is supported)")
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return
    if bool(getattr(model, "use_mla", False)):
        raise ValueError(
            f"KVLifecycleConnector does not support MLA models ({model.model}): their latent KV is replicated on "
            "every TP rank, which the per-rank head slices of its TP plans would move or split wrongly; use "
            "vLLM's NixlConnector for MLA models")
    if bool(getattr(model, "is_hybrid", False)):
        raise ValueError(
            f"KVLifecycleConnector does not support hybrid models ({model.model}): their Mamba / linear-attention "
            "state is not a paged KV block and lives in its own KV cache group, while this connector moves one "
            "attention KV cache group")


class KVLifecycleConnector(KVConnectorBase_V1):
    """Load with ``--kv-transfer-config '{"kv_connector": "KVLifecycleConnector",
    "kv_connector_module_path": "kvlifecycle.adapters.vllm", "kv_role": "kv_producer" | "kv_consumer",
    "kv_connector_extra_config": {...}}'`` (options: docs/vllm.md)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _log_through_vllm()
        kv_config = vllm_config.kv_transfer_config
        assert kv_config is not None
        self.adapter_config = AdapterConfig.from_extra(kv_config.kv_connector_extra_config)
        check_transfer_config(kv_config)
        check_supported_parallelism(vllm_config)
        engine_id = kv_config.engine_id or "engine"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._stats: KVLifecycleStats | None = None  # worker side: this interval's transfer statistics
        self._stats_lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, self.adapter_config, engine_id)
        else:
            self._worker = WorkerSide(vllm_config, self.adapter_config, engine_id, kv_cache_config)

    # -- scheduler side ------------------------------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._kv_cache_config.transfer_group_ids  # we load the request's own blocks, every group

    # -- worker side ---------------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        first = next(iter(kv_caches.values()), None)
        if first is not None:
            check_buffer_device(self._vllm_config.kv_transfer_config, first.device.type)
        self._worker.register_kv_caches(kv_caches)
        from .stats import KVLifecycleStats  # lazily: vLLM's metrics modules are only needed once stats flow

        self._stats = KVLifecycleStats()
        for ledger in (self._worker.source, self._worker.target):
            if ledger is not None:
                ledger.listeners.append(self._observe)

    def _observe(self, event: ev.Event) -> None:
        stats = self._stats
        if stats is not None:
            with self._stats_lock:
                stats.observe(event)

    # -- vLLM's stats interface: the workers' statistics reach /metrics as vllm:kvlifecycle_* ----------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._stats is None:
            return None
        gauges = self._worker.staging_gauges if self._worker is not None else None
        with self._stats_lock:
            if gauges is not None:  # P: staging's numbers, sampled once per step (they move with time, not events)
                self._stats.observe_staging(*gauges.take(), rank=self._worker.tp_rank if self._worker else 0)
            return None if self._stats.is_empty() else self._stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        from .stats import KVLifecycleStats

        return KVLifecycleStats(data=data) if data is not None else KVLifecycleStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVLifecyclePromMetrics:
        from .stats import KVLifecyclePromMetrics

        return KVLifecyclePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVLifecycleMetadata) and not meta.is_empty():
            self._worker.on_metadata(meta)  # enqueues; the transfers are posted off the forward thread

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous, streamed ones too: vLLM holds the request in WAITING_FOR_REMOTE_KVS until every
        # layer of every block landed, so no forward ever reads a layer that is still loading.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # After the layer returned (its KV is in the cache on CPU): layer-wise requests queue its post; the
        # transfer runs off the forward thread. Pull and push move the finished prefill instead. The step's
        # metadata is read here, not in start_load_kv: vLLM calls that after the forward when no load is sync.
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVLifecycleMetadata) and meta.streams:
            self._worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        sending, recving, failed = self._worker.get_transfer_results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Failed loads are reported per request (failed_recving), which vLLM maps onto kv_load_failure_policy;
        # the block ids are drained here so they are never reported twice.
        if self._worker is not None:
            self._worker.take_failed_blocks()
        return set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
