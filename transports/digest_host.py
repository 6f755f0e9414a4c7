"""Per-block digests over KV regions in host memory (DRAM): :class:`kvlifecycle.digest.BlockDigester` for the NIXL
DRAM and loopback transports. P digests its granted blocks on the Producer's side-channel thread (never the
engine's scheduler thread); D re-reads what landed in its own blocks on its service thread, before ``part_done``.

The regions are read in place through numpy views of the registered addresses (no copy): XXH3 over the views runs
at memory bandwidth (``kvlifecycle bench transport --verify all`` measures it against the transfer)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from kvlifecycle.digest import digest_units
from kvlifecycle.transport import KVLayout, MemoryKind


class HostDigester:
    """Digests the blocks of ``layout`` (every region in host memory) where they lie."""

    def __init__(self, layout: KVLayout) -> None:
        if layout.kind is not MemoryKind.DRAM or any(k is not MemoryKind.DRAM for k in layout.group_kinds):
            raise ValueError(f"host digests need DRAM regions, got a {layout.kind} layout")
        regions: list[np.ndarray] = []
        for addr, block, blocks in zip(layout.base_addrs, layout.block_bytes, layout.region_blocks, strict=True):
            raw = (ctypes.c_uint8 * (block * blocks)).from_address(addr)
            regions.append(np.ctypeslib.as_array(raw).reshape(blocks, block))
        self._groups: list[list[np.ndarray]] = []
        first = 0
        for group in layout.region_groups:
            self._groups.append(regions[first:first + group.regions])
            first += group.regions

    def digests(self, units: np.ndarray, *, offset: int = 0, length: int = 0,
                only: Sequence[int] | None = None) -> np.ndarray:
        return digest_units(self._groups, units, offset=offset, length=length, only=only)
