"""Compatibility hash, field-by-field refusal, heterogeneous TP / block size plans, agent epochs, layout math."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvlifecycle import layout as L
from kvlifecycle.handshake import CompatInfo, CompatMismatchError, EpochTracker, negotiate
from kvlifecycle.transport import WIRE_VERSION, BlockView, KVLayout, MemoryKind


def compat(**over) -> CompatInfo:
    base = dict(model_id="m", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_size=64, block_size=16,
                kv_layout="HND", tp_size=1)
    base.update(over)
    return CompatInfo(**base)


def test_hash_is_stable_and_covers_every_field() -> None:
    a = compat()
    assert a.compat_hash() == compat().compat_hash()
    changes = dict(model_id="x", dtype="float16", num_layers=5, num_kv_heads=4, head_size=128, block_size=32,
                   kv_layout="NHD", tp_size=2, wire_version=99, kv_replicated=True)
    assert set(changes) == set(CompatInfo.__struct_fields__)
    for name, value in changes.items():
        assert compat(**{name: value}).compat_hash() != a.compat_hash(), name


def test_identical_peers_get_a_plain_plan() -> None:
    plan = negotiate(compat(), compat())
    assert plan.parts == 1 and plan.consumers_per_p_rank == 1
    assert plan.reads[0].remote_view == BlockView()


@pytest.mark.parametrize("field", ["model_id", "dtype", "num_layers", "head_size", "num_kv_heads", "wire_version",
                                   "kv_replicated"])
def test_strict_mismatch_refused_field_by_field(field: str) -> None:
    value = {"model_id": "other", "dtype": "float32", "num_layers": 7, "head_size": 32, "num_kv_heads": 2,
             "wire_version": WIRE_VERSION + 1, "kv_replicated": True}[field]
    with pytest.raises(CompatMismatchError) as info:
        negotiate(compat(), compat(**{field: value}))
    assert [f[0] for f in info.value.fields] == [field]
    assert f"{field}: local=" in str(info.value) and repr(value) in str(info.value)


def test_several_mismatches_all_listed() -> None:
    with pytest.raises(CompatMismatchError) as info:
        negotiate(compat(), compat(dtype="float16", num_layers=9))
    text = str(info.value)
    assert "dtype: local='bfloat16' remote='float16'" in text and "num_layers: local=4 remote=9" in text


def test_d_tp_above_p_tp_slices_heads_and_counts_consumers() -> None:
    # D TP 2 reads from P TP 1: each D rank reads half of every P block; P counts 2 consumers
    plans = [negotiate(compat(tp_size=2), compat(tp_size=1), d_rank=r) for r in (0, 1)]
    assert [p.consumers_per_p_rank for p in plans] == [2, 2]
    assert [p.reads[0].p_rank for p in plans] == [0, 0]
    # units: (8 heads / 1) × 16 tokens per P block, halves of 64 units
    assert [p.reads[0].remote_view for p in plans] == [BlockView(0, 64), BlockView(64, 64)]


@pytest.mark.parametrize(("d_tp", "p_tp"), [(1, 2), (2, 1)])
def test_replicated_kv_across_tp_sizes_is_refused_naming_mla(d_tp: int, p_tp: int) -> None:
    # MLA's latent cache is whole on every rank: a head split would stitch parts of several copies together
    with pytest.raises(CompatMismatchError) as info:
        negotiate(compat(tp_size=d_tp, kv_replicated=True), compat(tp_size=p_tp, kv_replicated=True))
    assert "replicated on every TP rank (MLA)" in str(info.value)
    assert [f[0] for f in info.value.fields] == ["tp_size"]


def test_replicated_kv_at_one_tp_size_moves_whole_blocks() -> None:
    plan = negotiate(compat(tp_size=2, kv_replicated=True), compat(tp_size=2, kv_replicated=True), d_rank=1)
    assert [(r.p_rank, r.remote_view) for r in plan.reads] == [(1, BlockView())] and plan.parts == 1


def test_a_record_without_the_replicated_field_decodes_as_not_replicated() -> None:
    # an older peer's record (the field appended later) is a split-heads cache
    old = {f: getattr(compat(), f) for f in CompatInfo.__struct_fields__ if f != "kv_replicated"}
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(old), type=CompatInfo)
    assert decoded.kv_replicated is False and decoded == compat()


def test_p_tp_above_d_tp_reads_several_p_ranks() -> None:
    plan = negotiate(compat(tp_size=1), compat(tp_size=2), d_rank=0)
    assert plan.parts == 2 and plan.consumers_per_p_rank == 1
    assert [r.p_rank for r in plan.reads] == [0, 1]
    assert [r.local_view for r in plan.reads] == [BlockView(0, 64), BlockView(64, 64)]


def test_hetero_tp_needs_hnd_or_nhd_blocks_of_one_token() -> None:
    with pytest.raises(CompatMismatchError) as refused:
        negotiate(compat(tp_size=2, kv_layout="NHD"), compat(tp_size=1, kv_layout="NHD"))
    assert ("heterogeneous TP (P 1 ↔ D 2) needs the HND layout, or NHD blocks of one token (SGLang --page-size 1); "
            "got NHD blocks of 16 tokens") in str(refused.value)
    # a one-token NHD block is head-major too: the same plan as HND's
    for d_tp, p_tp in ((2, 1), (1, 2)):
        one = negotiate(compat(tp_size=d_tp, kv_layout="NHD", block_size=1),
                        compat(tp_size=p_tp, kv_layout="NHD", block_size=1))
        hnd = negotiate(compat(tp_size=d_tp, block_size=1), compat(tp_size=p_tp, block_size=1))
        assert one == hnd and one.parts == p_tp


def test_block_size_ratio_with_nhd_splits_bigger_blocks() -> None:
    plan = negotiate(compat(kv_layout="NHD", block_size=16), compat(kv_layout="NHD", block_size=32))
    assert plan.remote_split == 2 and plan.local_split == 1
    with pytest.raises(CompatMismatchError, match="NHD"):
        negotiate(compat(block_size=16), compat(block_size=32))  # HND: refused
    with pytest.raises(CompatMismatchError, match="divide"):
        negotiate(compat(kv_layout="NHD", block_size=16), compat(kv_layout="NHD", block_size=24))


def test_tp_and_block_size_both_differing_refused() -> None:
    with pytest.raises(CompatMismatchError, match="both differ"):
        negotiate(compat(tp_size=2, block_size=32), compat())


def test_compat_round_trips_on_the_wire() -> None:
    c = compat(tp_size=4)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(c), type=CompatInfo) == c


def test_epoch_tracker() -> None:
    t = EpochTracker()
    assert t.observe("h:1", 10).kind == "new"
    assert t.observe("h:1", 10).kind == "same"
    change = t.observe("h:1", 12)
    assert (change.kind, change.previous) == ("restarted", 10)
    assert t.observe("h:1", 11).kind == "stale"
    assert t.current("h:1") == 12


# --- layout math ---------------------------------------------------------------------------------------------------


def test_desc_ids_region_major() -> None:
    ids = L.desc_ids(np.array([3, 7]), 10, 3)
    assert ids.dtype == np.int32 and ids.tolist() == [3, 7, 13, 17, 23, 27]
    assert L.desc_ids([1], 10, [2]).tolist() == [21]


def test_block_descs_addresses() -> None:
    lay = KVLayout(MemoryKind.DRAM, 0, 4, (1000, 5000), (100, 100))
    d = L.block_descs(lay)
    assert d.shape == (8, 3) and d[:, 0].tolist() == [1000, 1100, 1200, 1300, 5000, 5100, 5200, 5300]
    half = L.block_descs(lay, BlockView(50, 50))
    assert half[0].tolist() == [1050, 50, 0]
    split = L.block_descs(lay, BlockView(split=2))
    assert split.shape == (16, 3) and split[:4, 0].tolist() == [1000, 1050, 1100, 1150]
    with pytest.raises(L.UnsupportedMappingError):
        L.block_descs(lay, BlockView(60, 50))


def test_permute_round_trip_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    heads, tokens, dim = 2, 4, 3
    x = np.arange(5 * heads * tokens * dim).reshape(5, -1)
    nhd = L.permute_blocks(x, num_heads=heads, block_size=tokens, head_dim=dim, src="HND", dst="NHD")
    assert nhd.reshape(5, tokens, heads, dim)[1, 2, 1, 0] == x.reshape(5, heads, tokens, dim)[1, 1, 2, 0]
    back = L.permute_blocks(nhd, num_heads=heads, block_size=tokens, head_dim=dim, src="NHD", dst="HND")
    assert np.array_equal(back, x)
    t = torch.from_numpy(x)
    assert np.array_equal(L.permute_blocks(t, num_heads=heads, block_size=tokens, head_dim=dim, src="HND",
                                           dst="NHD").numpy(), nhd)
