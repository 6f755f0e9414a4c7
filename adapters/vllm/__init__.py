"""vLLM adapter: ``KVLifecycleConnector`` (load with ``kv_connector_module_path = "kvlifecycle.adapters.vllm"``)."""

from .connector import KVLifecycleConnector

__all__ = ["KVLifecycleConnector"]
