"""vLLM's per-layer KV tensors as the handoff's regions: which layouts can move block by block (block-major or
K/V-outer, token- or head-major inside a block), the regions in one order on P and D, and the compatibility record
both sides compare at the handshake."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvlifecycle.handshake import CompatInfo
from kvlifecycle.transport import KVLayout, MemoryKind

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


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
