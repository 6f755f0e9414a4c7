"""The prefill stand-in: each layer's work on the compute stream writes that layer's K and V into vLLM-shaped caches.

A decoder layer's matmuls at a Llama-3-8B-like shape (QKV, output projection, gated MLP; hidden 4096, 8 KV heads of
128, MLP 14336), with the layer's K and V written into its cache's blocks as vLLM's ``reshape_and_cache`` does. The
attention itself is left out: it only makes each layer longer, so leaving it out leaves streaming less compute to
hide its copies behind (the comparison errs against streaming). Weights are shared by the layers: only the time and
the data dependency matter (a copy that ran before its layer's KV was written would move the wrong bytes, and the
byte check would see it).

Caches: one tensor per layer in FlashAttention's K/V-outer layout, ``[2, blocks, block_size, kv_heads, head_size]``
(token-major blocks), bf16; regions are K and V of every layer (two per layer), as the connector registers them.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Any

from kvlifecycle.transport import KVLayout, MemoryKind

POISON = -7.25  # a bf16 value no layer writes: blocks filled with it before a checked run


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int = 32
    kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    hidden: int = 4096
    ffn: int = 14336
    pool_blocks: int = 512  # blocks per layer cache on each side

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_size

    @property
    def block_bytes(self) -> int:
        """One block of K (or V) of one layer, bf16."""
        return self.block_size * self.kv_dim * 2

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def request_bytes(self, tokens: int) -> int:
        """K and V of every layer for a prompt of ``tokens`` (whole blocks)."""
        return self.blocks_for(tokens) * self.block_bytes * 2 * self.layers

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def vllm_caches(torch: Any, shape: ModelShape, device: Any) -> list[Any]:
    """Zeroed per-layer caches, ``[2, pool_blocks, block_size, kv_heads, head_size]`` bf16, each its own allocation
    (as vLLM allocates them; CUDA IPC exports each once)."""
    physical = (2, shape.pool_blocks, shape.block_size, shape.kv_heads, shape.head_size)
    return [torch.zeros(physical, dtype=torch.bfloat16, device=device) for _ in range(shape.layers)]


def caches_layout(caches: list[Any]) -> KVLayout:
    """Regions = K then V of every layer (``cache[0]``, ``cache[1]``), block ``b`` at ``base + b * block_bytes``."""
    halves = [half for cache in caches for half in (cache[0], cache[1])]
    block_bytes = halves[0][0].numel() * halves[0].element_size()
    on_gpu = halves[0].device.type == "cuda"
    return KVLayout(MemoryKind.VRAM if on_gpu else MemoryKind.DRAM, (halves[0].device.index or 0) if on_gpu else 0,
                    halves[0].shape[0], tuple(h.data_ptr() for h in halves), tuple(block_bytes for _ in halves))


def layer_regions(layer: int) -> tuple[int, int]:
    """The regions of one layer's K and V in :func:`caches_layout`."""
    return 2 * layer, 2 * layer + 1


def poison(caches: list[Any], block_ids: Any) -> None:
    """Fill the given blocks of every layer (K and V) with :data:`POISON` (on the current stream)."""
    for cache in caches:
        cache.index_fill_(1, block_ids, POISON)


def digests(torch: Any, caches: list[Any], block_ids: Any) -> list[str]:
    """Per layer: a SHA-256 of its K and V blocks ``block_ids`` in that order (P's and D's must be equal)."""
    torch.cuda.synchronize() if caches[0].device.type == "cuda" else None
    out = []
    for cache in caches:
        moved = cache.index_select(1, block_ids).view(torch.int16).cpu().numpy()
        out.append(hashlib.sha256(moved.tobytes()).hexdigest())
    return out


class PrefillStandIn:
    """A decoder layer's matmuls over ``tokens`` rows, writing the layer's K and V into its cache blocks."""

    def __init__(self, torch: Any, shape: ModelShape, device: Any, seed: int) -> None:
        self.torch, self.shape, self.device = torch, shape, device
        gen = torch.Generator(device=device).manual_seed(seed)
        h, kv, f = shape.hidden, shape.kv_dim, shape.ffn

        def weight(rows: int, cols: int) -> Any:
            w = torch.randn((rows, cols), generator=gen, device=device, dtype=torch.float32) * rows**-0.5
            return w.to(torch.bfloat16)

        self.w_qkv = weight(h, h + 2 * kv)
        self.w_o = weight(h, h)
        self.w_gate_up = weight(h, 2 * f)
        self.w_down = weight(f, h)

    def inputs(self, tokens: int, seed: int) -> Any:
        """The prompt's hidden states, different for every run (so a stale copy never matches by chance)."""
        gen = self.torch.Generator(device=self.device).manual_seed(seed)
        x = self.torch.randn((tokens, self.shape.hidden), generator=gen, device=self.device, dtype=self.torch.float32)
        return x.to(self.torch.bfloat16)

    def layer(self, x: Any, cache: Any, block_ids: Any) -> Any:
        """One layer over ``x`` (``len(block_ids) * block_size`` rows); its K and V land in ``cache``'s blocks."""
        torch, s = self.torch, self.shape
        n = block_ids.numel()
        q, k, v = (x @ self.w_qkv).split([s.hidden, s.kv_dim, s.kv_dim], dim=-1)
        cache[0].index_copy_(0, block_ids, k.reshape(n, s.block_size, s.kv_heads, s.head_size))
        cache[1].index_copy_(0, block_ids, v.reshape(n, s.block_size, s.kv_heads, s.head_size))
        x = x + q @ self.w_o
        gate, up = (x @ self.w_gate_up).chunk(2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ self.w_down
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)
