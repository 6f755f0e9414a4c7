"""Region groups in one layout (:class:`kvlifecycle.transport.RegionGroup`): blocks of their own count and size per
group (SGLang's KV pages and aux rows), one id space, one post. Descriptor math first, then the real NIXL DRAM
transport, then one handoff (grant, claim, load) spanning both groups."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvlifecycle import layout as L
from kvlifecycle.transport import WHOLE_BLOCK, BlockView, KVLayout, LayoutWire, MemoryKind, RegionGroup

PAGES, PAGE_BYTES, KV_REGIONS = 8, 256, 4
ROWS, ROW_BYTES, AUX_REGIONS = 3, 48, 2


def grouped(kv_addrs: list[int], aux_addrs: list[int]) -> KVLayout:
    kv = L.rows_layout("DRAM", 0, kv_addrs, [PAGES * PAGE_BYTES] * KV_REGIONS, [PAGE_BYTES] * KV_REGIONS)
    aux = L.rows_layout("DRAM", 0, aux_addrs, [ROWS * ROW_BYTES] * AUX_REGIONS, [ROW_BYTES] * AUX_REGIONS)
    return L.grouped_layout(kv, aux)


LAYOUT = grouped([1 << 20, 2 << 20, 3 << 20, 4 << 20], [5 << 20, 6 << 20])


def test_a_grouped_layout_is_one_id_space_group_after_group() -> None:
    assert LAYOUT.num_blocks == PAGES + ROWS
    assert LAYOUT.region_groups == (RegionGroup(KV_REGIONS, PAGES), RegionGroup(AUX_REGIONS, ROWS))
    assert LAYOUT.region_blocks == (PAGES,) * KV_REGIONS + (ROWS,) * AUX_REGIONS
    assert LAYOUT.region_bytes == (PAGES * PAGE_BYTES,) * KV_REGIONS + (ROWS * ROW_BYTES,) * AUX_REGIONS
    assert L.group_start(LAYOUT, 1) == PAGES
    plain = KVLayout(MemoryKind.DRAM, 0, 4, (4096,), (64,))
    assert plain.region_groups == (RegionGroup(1, 4),) and plain.region_blocks == (4,)


def test_descriptors_list_each_region_with_its_groups_blocks() -> None:
    descs = L.block_descs(LAYOUT)
    assert descs.shape == (KV_REGIONS * PAGES + AUX_REGIONS * ROWS, 3)
    aux_first = KV_REGIONS * PAGES  # region 4 (the first aux buffer) starts after the KV regions' descriptors
    assert descs[aux_first].tolist() == [5 << 20, ROW_BYTES, 0]
    assert descs[aux_first + ROWS + 2].tolist() == [(6 << 20) + 2 * ROW_BYTES, ROW_BYTES, 0]
    assert descs[PAGES + 1].tolist() == [(2 << 20) + PAGE_BYTES, PAGE_BYTES, 0]
    strided = L.block_descs_strided(LAYOUT)
    assert strided is not None
    expanded = np.concatenate([np.stack([a + s * np.arange(n, dtype=np.uint64), np.full(n, ln, dtype=np.uint64),
                                         np.full(n, d, dtype=np.uint64)], axis=1) for a, ln, d, s, n in strided])
    assert np.array_equal(expanded, descs)


def test_a_post_spanning_groups_moves_each_block_in_its_groups_regions() -> None:
    groups = LAYOUT.region_groups
    local = np.array([2, 5, PAGES + 1])  # two pages and aux row 1
    remote = np.array([7, 0, PAGES + 2])
    lids, rids = L.group_desc_ids(groups, groups, local, remote, np.arange(LAYOUT.num_regions))
    aux = KV_REGIONS * PAGES
    want_local = [r * PAGES + b for r in range(KV_REGIONS) for b in (2, 5)] + [aux + 1, aux + ROWS + 1]
    want_remote = [r * PAGES + b for r in range(KV_REGIONS) for b in (7, 0)] + [aux + 2, aux + ROWS + 2]
    assert lids.tolist() == want_local and rids.tolist() == want_remote
    descs = L.block_descs(LAYOUT)
    assert set(descs[lids, 1].tolist()) == {PAGE_BYTES, ROW_BYTES}
    with pytest.raises(L.UnsupportedMappingError, match="cannot pair"):  # a page paired with an aux row
        L.group_desc_ids(groups, groups, np.array([1]), np.array([PAGES]), np.arange(LAYOUT.num_regions))


def test_a_view_slices_the_first_group_and_moves_the_others_whole() -> None:
    half = BlockView(offset=PAGE_BYTES // 2, length=PAGE_BYTES // 2)
    assert L.view_block_bytes(LAYOUT, half).tolist() == [PAGE_BYTES // 2] * KV_REGIONS + [ROW_BYTES] * AUX_REGIONS
    descs = L.block_descs(LAYOUT, half)
    assert descs[0, 0] == (1 << 20) + PAGE_BYTES // 2 and descs[KV_REGIONS * PAGES, 0] == 5 << 20
    with pytest.raises(L.UnsupportedMappingError, match="sub-block"):
        L.view_block_bytes(LAYOUT, BlockView(split=2))


def test_groups_that_do_not_cover_the_layout_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="groups must cover the 2 regions"):
        KVLayout(MemoryKind.DRAM, 0, 5, (0, 4096), (64, 64), ((1, 5),))
    with pytest.raises(ValueError, match="add up to num_blocks=5"):
        KVLayout(MemoryKind.DRAM, 0, 5, (0, 4096), (64, 64), ((1, 4), (1, 2)))
    with pytest.raises(ValueError, match="num_blocks must be >= 1"):
        KVLayout(MemoryKind.DRAM, 0, 5, (0, 4096), (64, 64), ((1, 5), (1, 0)))
    with pytest.raises(ValueError, match="single-group layouts"):
        L.grouped_layout(LAYOUT, LAYOUT)


def test_pairing_refuses_different_group_shapes() -> None:
    other = KVLayout(MemoryKind.DRAM, 0, 8, tuple(range(0, 6 * 4096, 4096)), (PAGE_BYTES,) * 6)
    with pytest.raises(L.UnsupportedMappingError, match="region groups differ"):
        L.check_views_match(LAYOUT, WHOLE_BLOCK, other, WHOLE_BLOCK)
    L.check_views_match(LAYOUT, WHOLE_BLOCK, grouped([0, 1, 2, 3], [4, 5]), WHOLE_BLOCK)  # counts may differ


def test_the_wire_form_carries_groups_and_an_older_layout_still_decodes() -> None:
    raw = msgspec.msgpack.encode(LayoutWire.of(LAYOUT))
    assert msgspec.msgpack.decode(raw, type=LayoutWire).to_layout() == LAYOUT
    older = msgspec.msgpack.encode({"kind": "DRAM", "device_id": 0, "num_blocks": 4, "base_addrs": [4096],
                                    "block_bytes": [64]})  # a peer from before region groups
    layout = msgspec.msgpack.decode(older, type=LayoutWire).to_layout()
    assert layout.groups == () and layout.region_groups == (RegionGroup(1, 4),)


# -- groups of different memory kinds (SGLang on a GPU: VRAM pages, host-memory aux rows) -------------------------

def mixed(device: int = 3) -> KVLayout:
    kv = L.rows_layout("VRAM", device, [1 << 30, 2 << 30], [PAGES * PAGE_BYTES] * 2, [PAGE_BYTES] * 2)
    aux = L.rows_layout("DRAM", 0, [5 << 20], [ROWS * ROW_BYTES], [ROW_BYTES])
    return L.grouped_layout(kv, aux)


def test_parts_of_different_kinds_make_a_layout_whose_groups_name_them() -> None:
    layout = mixed()
    assert (layout.kind, layout.device_id) == (MemoryKind.VRAM, 3)
    assert layout.group_kinds == (MemoryKind.VRAM, MemoryKind.DRAM) and layout.kinds_per_group
    assert not LAYOUT.kinds_per_group and LAYOUT.group_kinds == (MemoryKind.DRAM, MemoryKind.DRAM)
    # NIXL's device column: the GPU for VRAM descriptors, 0 for host memory
    assert L.block_descs(layout)[:, 2].tolist() == [3] * (2 * PAGES) + [0] * ROWS
    strided = L.block_descs_strided(layout)
    assert strided is not None and strided[:, 2].tolist() == [3, 3, 0]


def test_vram_parts_on_two_devices_do_not_make_one_layout() -> None:
    a = L.rows_layout("VRAM", 0, [1 << 30], [PAGE_BYTES * PAGES], [PAGE_BYTES])
    b = L.rows_layout("VRAM", 1, [2 << 30], [PAGE_BYTES * PAGES], [PAGE_BYTES])
    with pytest.raises(ValueError, match="one device"):
        L.grouped_layout(a, b)


def test_group_kinds_travel_on_the_wire_and_a_one_kind_layout_encodes_as_before() -> None:
    layout = mixed()
    wire = LayoutWire.of(layout)
    assert wire.group_kinds == ["VRAM", "DRAM"]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(wire), type=LayoutWire).to_layout() == layout
    assert LayoutWire.of(LAYOUT).group_kinds == []  # what an older peer sent and reads: nothing new
    with pytest.raises(ValueError, match="names 1 kinds for 2 groups"):
        msgspec.structs.replace(wire, group_kinds=["VRAM"]).to_layout()
    with pytest.raises(ValueError):
        msgspec.structs.replace(wire, group_kinds=["VRAM", "HBM"]).to_layout()


def test_groups_layout_is_those_groups_alone_and_their_descriptors_are_the_wholes() -> None:
    """What each part of a split transport registers: its groups' regions and blocks, its kind; its descriptors are
    exactly the whole layout's descriptors of those groups, in order."""
    mixed = L.grouped_layout(
        L.rows_layout("VRAM", 3, [1 << 30, 2 << 30], [PAGES * PAGE_BYTES] * 2, [PAGE_BYTES] * 2),
        L.rows_layout("DRAM", 0, [5 << 20], [ROWS * ROW_BYTES], [ROW_BYTES]),
        L.rows_layout("DRAM", 0, [6 << 20], [ROWS * ROW_BYTES], [ROW_BYTES]))
    pages, rows = L.groups_layout(mixed, [0]), L.groups_layout(mixed, [1, 2])
    assert pages == KVLayout(MemoryKind.VRAM, 3, PAGES, (1 << 30, 2 << 30), (PAGE_BYTES, PAGE_BYTES))
    assert rows.kind is MemoryKind.DRAM and rows.device_id == 0 and not rows.kinds_per_group
    assert rows.region_groups == (RegionGroup(1, ROWS), RegionGroup(1, ROWS)) and rows.num_blocks == 2 * ROWS
    whole = L.block_descs(mixed)
    assert np.array_equal(np.concatenate([L.block_descs(pages), L.block_descs(rows)]), whole)
    assert L.groups_layout(mixed, [0, 1, 2]) == mixed
    assert L.groups_by_kind(mixed) == {MemoryKind.VRAM: (0,), MemoryKind.DRAM: (1, 2)}
    for bad in ([], [1, 0], [0, 0], [3], [-1]):
        with pytest.raises(ValueError, match="ascending distinct"):
            L.groups_layout(mixed, bad)
