"""The adapter's options, read once from ``kv_transfer_config.kv_connector_extra_config``.

Documented in docs/vllm.md. Unknown keys are refused (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_SIDE_CHANNEL_PORT = 5700


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    mode: str = "pull"  # pull: D READs from P; push: P WRITEs into D's reserved blocks
    transport: str = "nixl"
    backends: tuple[str, ...] = ("UCX",)
    lease_ttl_s: float = 30.0
    log_dir: str | None = None  # event logs, one directory per ledger; None: no log
    fsync: str = "10ms"  # event-log fsync policy (see kvlifecycle.eventlog)
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT  # P's side channel: port + DP index + TP rank
    grant_wait_s: float = 10.0  # how long D waits for P to publish a grant
    handshake_timeout_s: float = 5.0
    load_timeout_s: float = 60.0
    secret: str | None = None  # optional side-channel HMAC secret, shared by P and D
    # "auto": KV in VRAM also registers a CUDA IPC transport, which D picks per P at connect when both are on one
    # node (NIXL stays the fallback); "off": NIXL only
    fast_path: str = "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> AdapterConfig:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown} for KVLifecycleConnector; "
                             f"known: {sorted(known)}")
        env_port = os.environ.get("KVL_SIDE_CHANNEL_PORT") or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        if "side_channel_port" not in extra and env_port:
            extra["side_channel_port"] = int(env_port)
        if "log_dir" not in extra and os.environ.get("KVL_LOG_DIR"):
            extra["log_dir"] = os.environ["KVL_LOG_DIR"]
        if "backends" in extra:
            backends = extra["backends"]
            extra["backends"] = (backends,) if isinstance(backends, str) else tuple(backends)
        config = cls(**extra)
        if config.mode not in ("pull", "push"):
            raise ValueError(f"mode must be 'pull' or 'push', got {config.mode!r}")
        if config.transport != "nixl":
            raise ValueError(f"transport {config.transport!r} is not supported by the vLLM adapter (nixl only)")
        if config.fast_path not in ("auto", "off"):
            raise ValueError(f"fast_path must be 'auto' or 'off', got {config.fast_path!r}")
        if config.lease_ttl_s <= 0:
            raise ValueError("lease_ttl_s must be positive")
        return config
