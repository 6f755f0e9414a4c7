"""Two region groups in DRAM, SGLang's form (KV pages, then aux rows), for the tests of one post spanning both:
a worker's buffers, their grouped layout, and the check that exactly the paired pages and row moved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
from waiting import until

from kvlifecycle import layout as L
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.transport import KVLayout, MemoryKind

PAGES, PAGE_BYTES, KV_REGIONS = 12, 512, 4
ROWS, ROW_BYTES, AUX_REGIONS = 5, 40, 2
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=4,
                    kv_layout="NHD")


def kinds_named(layout: KVLayout) -> KVLayout:
    """The same layout, its groups naming their memory kind (DRAM): NIXL then posts it as a layout of several
    kinds is posted (SGLang on a GPU: VRAM pages, host-memory aux rows), one descriptor list and one transfer per
    group, the notification once all are DONE (transports/nixl_kinds.py). On this CPU machine both are DRAM."""
    groups = tuple(attrs.evolve(g, kind=MemoryKind.DRAM) for g in layout.region_groups)
    return attrs.evolve(layout, groups=groups)


class Side:
    """One worker's pages and aux rows in DRAM, and their grouped layout (``kinds``: its groups name their
    memory kind)."""

    def __init__(self, seed: int | None, kinds: bool = False) -> None:
        rng = np.random.default_rng(seed)
        fill = (lambda n: rng.integers(0, 256, n, dtype=np.uint8)) if seed is not None else \
            (lambda n: np.zeros(n, dtype=np.uint8))
        self.kv = [fill(PAGES * PAGE_BYTES).reshape(PAGES, PAGE_BYTES) for _ in range(KV_REGIONS)]
        self.aux = [fill(ROWS * ROW_BYTES).reshape(ROWS, ROW_BYTES) for _ in range(AUX_REGIONS)]
        self.layout = L.grouped_layout(
            L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.kv], [a.nbytes for a in self.kv],
                          [PAGE_BYTES] * KV_REGIONS),
            L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.aux], [a.nbytes for a in self.aux],
                          [ROW_BYTES] * AUX_REGIONS))
        if kinds:
            self.layout = kinds_named(self.layout)

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in self.kv + self.aux]


def assert_moved(src: Side, dst: Side, before: list[np.ndarray], pages: tuple[list[int], list[int]],
                 rows: tuple[int, int]) -> None:
    """Exactly the paired pages and the paired aux row changed on D, to P's bytes; nothing else did."""
    (sp, dp), (sr, dr) = pages, rows
    for r in range(KV_REGIONS):
        assert np.array_equal(dst.kv[r][dp], src.kv[r][sp])
        others = np.setdiff1d(np.arange(PAGES), dp)
        assert np.array_equal(dst.kv[r][others], before[r][others])
    for r in range(AUX_REGIONS):
        assert np.array_equal(dst.aux[r][dr], src.aux[r][sr])
        others = np.setdiff1d(np.arange(ROWS), [dr])
        assert np.array_equal(dst.aux[r][others], before[KV_REGIONS + r][others])


def wait(fn: Callable[[], Any], timeout_s: float = 20.0) -> bool:
    """:func:`waiting.until` with the longer bound these multi-agent posts take on two loaded cores."""
    return until(fn, timeout_s)


def aux_block(layout: KVLayout, row: int) -> int:
    return L.group_start(layout, 1) + row
