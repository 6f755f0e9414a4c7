"""Drive the vLLM connector's worker side (``adapters/vllm/worker.py`` ``WorkerSide``) without a vLLM server.

The GPU machine has no package registry, so vLLM cannot be installed there: when it is absent, the handful of vLLM
names the adapter imports are stubbed. Only import-time names are stubbed; the worker side's data path (layout,
ledgers, Producer / Consumer, NIXL and CUDA IPC transports) is the adapter's own code.
"""

from __future__ import annotations

import contextlib
import socket
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

ADAPTER = "kvlifecycle.adapters.vllm"
LAYER = "model.layers.{}.self_attn.attn"

# How vLLM lays a layer's KV cache out -> (K/V outer: two regions per layer, kv_layout the handshake carries)
KV_FORMS = {
    "kv-outer-NHD": (True, "NHD"),  # [2, blocks, block_size, heads, head_size]: FlashAttention, K and V outermost
    "kv-outer-HND": (True, "HND"),  # the same logical shape over head-major memory (vLLM's HND stride order)
    "LBHNC": (False, "HND"),  # [blocks, heads, block_size, 2 x head_size] (K and V fused): vLLM's CPU backend
    "LBNHC": (False, "NHD"),  # the same view over token-major memory: vLLM 0.32 on GPU (FlashAttention) by default
}


def kv_caches(
    form: str,
    layers: list[int],
    *,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    seed: int | None = None,
) -> dict[str, torch.Tensor]:
    """Per-layer caches in one of :data:`KV_FORMS`, as vLLM hands them to ``register_kv_caches``: logical shape
    and physical (stride) order. Zeros, or random values from ``seed``."""
    outer, order = KV_FORMS[form]
    if outer:
        inner = (heads, block_size, head_size) if order == "HND" else (block_size, heads, head_size)
        physical, perm = (2, num_blocks, *inner), ((0, 1, 3, 2, 4) if order == "HND" else None)
    else:
        inner = (heads, block_size, 2 * head_size) if order == "HND" else (block_size, heads, 2 * head_size)
        physical, perm = (num_blocks, *inner), ((0, 2, 1, 3) if order == "NHD" else None)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    out = {}
    for i in layers:
        if gen is None:
            cache = torch.zeros(physical, dtype=dtype, device=device)
        else:
            cache = torch.randn(physical, generator=gen, device=device).to(dtype)
        out[LAYER.format(i)] = cache.permute(*perm) if perm else cache
    return out


def block_dim(form: str) -> int:
    """The dimension of a layer's cache that indexes blocks."""
    return 1 if KV_FORMS[form][0] else 0


def _forget_adapter_modules() -> None:
    for name in [m for m in sys.modules if m.startswith(ADAPTER)]:
        del sys.modules[name]


def _install_stubs(monkeypatch: pytest.MonkeyPatch) -> str:
    try:
        import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
        import vllm.distributed.parallel_state as parallel_state
    except ImportError:
        pass
    else:
        # no distributed group outside a vLLM worker: the worker side runs as TP rank 0
        monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
        return "vllm"
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)  # a partial or unrelated "vllm" found on the path
    base = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.base")
    for name in ("KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorTransferResults"):
        setattr(base, name, type(name, (), {}))
    base.KVConnectorRole = type("KVConnectorRole", (), {"SCHEDULER": 0, "WORKER": 1})  # type: ignore[attr-defined]
    parallel = types.ModuleType("vllm.distributed.parallel_state")
    parallel.get_tensor_model_parallel_rank = lambda: 0  # type: ignore[attr-defined]
    names = [
        "vllm",
        "vllm.distributed",
        "vllm.distributed.kv_transfer",
        "vllm.distributed.kv_transfer.kv_connector",
        "vllm.distributed.kv_transfer.kv_connector.v1",
    ]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, base.__name__, base)
    monkeypatch.setitem(sys.modules, parallel.__name__, parallel)
    return "stubs"


@contextlib.contextmanager
def vllm_or_stubs(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The real vLLM when installed, else stubs; yields which. The adapter's modules are imported afresh inside
    (against whichever it is) and forgotten on exit, so no other test sees adapter classes built on stubs."""
    for name in [m for m in sys.modules if m.startswith(ADAPTER)]:
        monkeypatch.delitem(sys.modules, name)
    try:
        yield _install_stubs(monkeypatch)
    finally:
        _forget_adapter_modules()


def fake_vllm_config(role: str, block_size: int, heads: int, head_size: int) -> Any:
    """The fields of ``VllmConfig`` the worker side reads (TP 1, no prefix caching, policy ``fail``)."""
    model = SimpleNamespace(
        model="tiny-random-llama", get_total_num_kv_heads=lambda: heads, get_head_size=lambda: head_size
    )
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_load_failure_policy="fail"),
        cache_config=SimpleNamespace(block_size=block_size, enable_prefix_caching=False),
        parallel_config=SimpleNamespace(data_parallel_index=0, tensor_parallel_size=1),
        model_config=model,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Pair:
    p: Any  # WorkerSide, kv_producer
    d: Any  # WorkerSide, kv_consumer
    address: str  # P's side channel
    log_dir: Path


@contextlib.contextmanager
def worker_pair(
    p_caches: dict[str, Any],
    d_caches: dict[str, Any],
    *,
    num_blocks: int,
    block_size: int,
    heads: int,
    head_size: int,
    log_dir: Path,
    **options: Any,
) -> Iterator[Pair]:
    """P and D ``WorkerSide`` in this process, their KV caches registered; both shut down on exit. Import the
    adapter inside :func:`vllm_or_stubs`."""
    from kvlifecycle.adapters.vllm.config import AdapterConfig
    from kvlifecycle.adapters.vllm.worker import WorkerSide

    port = free_port()
    config = AdapterConfig(side_channel_port=port, log_dir=str(log_dir), load_timeout_s=30.0, **options)
    kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
    p = WorkerSide(fake_vllm_config("kv_producer", block_size, heads, head_size), config, "engine-p", kv_cache_config)
    d = WorkerSide(fake_vllm_config("kv_consumer", block_size, heads, head_size), config, "engine-d", kv_cache_config)
    try:
        p.register_kv_caches(p_caches)
        d.register_kv_caches(d_caches)
        yield Pair(p, d, f"tcp://127.0.0.1:{port}", log_dir)
    finally:
        d.shutdown()
        p.shutdown()


@dataclass
class Settled:
    received: set[str] = field(default_factory=set)  # D's finished_recving
    failed: set[str] = field(default_factory=set)  # D's failed_recving
    sent: set[str] = field(default_factory=set)  # P's finished_sending


def hand_off(pair: Pair, p_blocks: tuple[int, ...], d_blocks: tuple[int, ...], *, wait_s: float = 60.0) -> Settled:
    """What vLLM does for one request, as connector metadata: grant on P, recv on D; collect finished_recving and
    finished_sending as vLLM's forward thread would (bounded waits, nothing timed); then finish on D."""
    from kvlifecycle.adapters.vllm.metadata import GrantCmd, KVLifecycleMetadata, PeerRef, RecvCmd

    p, d = pair.p, pair.d
    p.on_metadata(KVLifecycleMetadata(grants=[GrantCmd("req-p", p_blocks)]))
    d.on_metadata(KVLifecycleMetadata(recvs=[RecvCmd(PeerRef("req-d", pair.address, "req-p"), d_blocks)]))
    out = Settled()
    deadline = time.monotonic() + wait_s
    while (not out.received or not out.sent) and time.monotonic() < deadline:
        _, recving, failed = d.get_transfer_results()
        out.received |= recving
        out.failed |= failed
        out.sent |= p.get_transfer_results()[0]
        if out.failed:
            break
        time.sleep(0.002)
    if out.received and not out.failed:
        d.on_metadata(KVLifecycleMetadata(finishes=["req-d"]))
        deadline = time.monotonic() + wait_s
        while "req-d" in d.target.requests and time.monotonic() < deadline:
            time.sleep(0.002)
    return out


def replay_problems(log_dir: Path) -> list[str]:
    """Both sides' event logs (written by the worker sides, closed at shutdown), replayed and checked: each one
    quiescent (no pin, lease or load left) and the P/D pair consistent. Empty when clean."""
    from kvlifecycle.replay import check, check_pair, replay

    dirs = sorted(p for p in log_dir.iterdir() if p.is_dir() and p.name.startswith(("source-", "target-")))
    sides = sorted(p.name.split("-")[0] for p in dirs)
    if sides != ["source", "target"]:
        return [f"expected one source and one target log under {log_dir}, found {[p.name for p in dirs]}"]
    results = [replay(p) for p in dirs]
    return [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]
