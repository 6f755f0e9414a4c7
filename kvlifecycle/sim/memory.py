"""Byte-addressable simulated memory with tagged KV blocks.

Every worker's KV regions are numpy arrays in one simulated address space (addresses are plain integers handed
out by :class:`AddressSpace`). A prefill writes into each block a 16-byte tag repeated over each KV head's bytes:
``(worker << 16 | head << 8 | region, agent epoch, source block, allocation epoch)``. Whatever moves bytes (the
simulated transport) moves tags, so a target block's bytes say exactly which source block of which allocation (and
which incarnation of P) they came from, and which head: a stale, torn or mixed read, or a head slice read into the
wrong heads, is visible byte for byte.
"""

from __future__ import annotations

import numpy as np

TAG = np.dtype([("who", "<u4"), ("agent_epoch", "<u4"), ("block", "<u4"), ("epoch", "<u4")])
TAG_BYTES = TAG.itemsize  # 16


class AddressSpace:
    """Regions by base address. ``resolve(addr, nbytes)`` is the byte range a descriptor names."""

    def __init__(self) -> None:
        self._regions: dict[int, np.ndarray] = {}
        self._next = 1 << 20

    def allocate(self, nbytes: int) -> tuple[int, np.ndarray]:
        base = self._next
        self._next += (nbytes + 4095) // 4096 * 4096 + 4096  # a guard page between regions
        array = np.zeros(nbytes, dtype=np.uint8)
        self._regions[base] = array
        return base, array

    def free(self, base: int) -> None:
        self._regions.pop(base, None)

    def region(self, base: int) -> np.ndarray:
        try:
            return self._regions[base]
        except KeyError:
            raise KeyError(f"no simulated region at {base:#x}") from None


def who(worker: int, head: int, region: int) -> int:
    """A tag's ``who`` field: the worker, the KV head and the region the bytes were computed for."""
    return worker << 16 | head << 8 | region


def tag_bytes(worker: int, region: int, agent_epoch: int, block: int, epoch: int, nbytes: int,
              heads: range = range(1)) -> np.ndarray:
    """``nbytes`` bytes of a block: each of ``heads`` (equal shares of the bytes, each a multiple of
    :data:`TAG_BYTES`) holds its own tag, repeated."""
    tags = np.array([(who(worker, h, region), agent_epoch, block, epoch) for h in heads], dtype=TAG)
    return np.repeat(tags, nbytes // TAG_BYTES // len(heads)).view(np.uint8)


def read_tags(raw: np.ndarray) -> np.ndarray:
    """The tags in a byte range (a multiple of :data:`TAG_BYTES`), as a structured array."""
    return np.ascontiguousarray(raw).view(TAG)
