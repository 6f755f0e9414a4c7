"""Row groups as layouts (:func:`kvlifecycle.layout.rows_layout`): SGLang's (ptr, length, row size) triples."""

from __future__ import annotations

import pytest

from kvlifecycle import layout as L
from kvlifecycle.transport import MemoryKind


def test_a_group_takes_the_fewest_rows_any_region_holds() -> None:
    layout = L.rows_layout("DRAM", 0, [4096, 65536], [10 * 64, 12 * 16], [64, 16])
    assert layout.kind is MemoryKind.DRAM
    assert layout.num_blocks == 10  # the second region holds 12 rows: no descriptor past the first's 10th
    assert layout.base_addrs == (4096, 65536) and layout.block_bytes == (64, 16)
    descs = L.block_descs(layout)
    assert descs.shape == (20, 3) and int(descs[:, 0].max()) == 65536 + 9 * 16


def test_a_group_without_regions_or_whole_rows_is_refused() -> None:
    with pytest.raises(ValueError, match="one ptr, length and row size"):
        L.rows_layout("DRAM", 0, [], [], [])
    with pytest.raises(ValueError, match="one ptr, length and row size"):
        L.rows_layout("DRAM", 0, [4096], [64, 64], [64])
    with pytest.raises(ValueError, match="no whole row"):
        L.rows_layout("DRAM", 0, [4096], [32], [64])
