"""P's host staging pool as memory: one host buffer per KV region, ``slots`` blocks each, laid out like the KV cache
it stages, so that a consumer's KV layout pairs with it one descriptor to one (same regions, same block bytes).

The pool is registered with NIXL as DRAM in an agent of its own beside the KV cache's: a consumer that claims a
staged lease (:meth:`kvlifecycle.staging.HostStaging.claim` says ``HOST``) reads the slots from that agent; one that
claims before the hand-over reads the GPU blocks from the KV cache's agent. The path is chosen per source memory
kind: VRAM blocks on one node go over CUDA IPC as before, the pool over NIXL.

:meth:`HostPool.copy_in` is the staging copy for a KV cache in host memory (CPU engines, tests). A KV cache in
VRAM is copied on a CUDA stream after the prefill's (each layer's blocks gathered on the GPU, then one
device -> pinned host copy per region: ``bench/staging_copy.py`` measures it at 0.93 x a plain ``copy_``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from kvlifecycle.transport import KVLayout, MemoryKind

_PAGE = 4096


class HostPool:
    """``slots`` blocks of host memory per region of ``kv`` (page-aligned, zeroed)."""

    def __init__(self, kv: KVLayout, slots: int) -> None:
        if len(kv.region_groups) > 1:
            raise ValueError("a host pool stages a KV layout of one region group")
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.kv, self.slots = kv, int(slots)
        self._buffers = [self._aligned(self.slots * b) for b in kv.block_bytes]
        self.layout = KVLayout(MemoryKind.DRAM, 0, self.slots, tuple(int(a.ctypes.data) for a in self._buffers),
                               kv.block_bytes, owner=self)  # a transport that registers it keeps the pool alive

    @staticmethod
    def _aligned(nbytes: int) -> np.ndarray:
        raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
        start = (-raw.ctypes.data) % _PAGE
        return raw[start:start + nbytes]

    def region(self, r: int) -> np.ndarray:
        """Region ``r`` as ``[slots, block_bytes]`` (a view)."""
        return self._buffers[r].reshape(self.slots, self.kv.block_bytes[r])

    def copy_in(self, gpu_blocks: Sequence[int] | np.ndarray, slots: Sequence[int] | np.ndarray) -> None:
        """The staging copy of a host-memory KV cache: every region's ``gpu_blocks`` into ``slots``, in order."""
        if self.kv.kind is not MemoryKind.DRAM:
            raise ValueError("copy_in reads host memory; a VRAM KV cache is staged on a CUDA stream")
        src, dst = np.asarray(gpu_blocks, dtype=np.int64), np.asarray(slots, dtype=np.int64)
        if src.shape != dst.shape:
            raise ValueError(f"{src.size} blocks for {dst.size} slots")
        if src.size and (src.min() < 0 or src.max() >= self.kv.num_blocks or dst.min() < 0
                         or dst.max() >= self.slots):
            raise ValueError("a block or slot id out of range")
        for r, (base, size) in enumerate(zip(self.kv.base_addrs, self.kv.block_bytes, strict=True)):
            to = int(self._buffers[r].ctypes.data)
            for block, slot in zip(src.tolist(), dst.tolist(), strict=True):
                ctypes.memmove(to + slot * size, base + block * size, size)
