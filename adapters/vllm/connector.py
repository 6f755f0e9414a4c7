"""``KVLifecycleConnector``: vLLM's KV connector interface as a thin facade over :mod:`.scheduler` and
:mod:`.worker` (one or the other per instance, as vLLM builds one connector per role)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from .config import AdapterConfig
from .metadata import KVLifecycleMetadata
from .scheduler import SchedulerSide
from .worker import WorkerSide

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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
    """Refuse, at start-up and in words, what this connector does not wire yet: it publishes and reads one grant
    per request (P rank 0 -> D rank 0). Heterogeneous TP exists in the core (``kvlifecycle.handshake``) but is not
    driven from vLLM's ranks here, and a silent partial handoff is worse than a clear refusal."""
    parallel = vllm_config.parallel_config
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = int(getattr(parallel, name, 1) or 1)
        if size != 1:
            raise ValueError(
                f"KVLifecycleConnector supports {name}=1 in this release (got {size}); "
                "use vLLM's NixlConnector for multi-rank P/D until kvlifecycle drives its TP plans from vLLM ranks"
            )


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
        check_supported_parallelism(vllm_config)
        engine_id = kv_config.engine_id or "engine"
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
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
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, KVLifecycleMetadata) and not meta.is_empty():
            self._worker.on_metadata(meta)  # enqueues; the transfers are posted off the forward thread

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous: vLLM holds the request in WAITING_FOR_REMOTE_KVS until every layer landed,
        # so no forward ever reads a layer that is still loading.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # Push mode writes the finished prefill's blocks when D asks (its blocks reserved), not layer by layer.
        return

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
