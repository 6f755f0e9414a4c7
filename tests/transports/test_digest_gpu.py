"""The GPU digester: bit-exact with the host contract (``kvlifecycle.digest.digest_units``, i.e. ``xxhash``).

The first tests need no GPU: :func:`tiled_xxh3` is the leaf kernels' decomposition (row tiles, the scramble chain,
the merge in 32-bit halves) in numpy, and equals ``xxhash`` over many lengths; :func:`tiled_root` is the root
kernel's XXH64 and equals ``xxhash.xxh64`` for every count of leaves that matters; so CI checks the math. The rest
run the Triton kernels on a CUDA device (skipped without one) against the host contract over a copy of the same
bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import xxhash
from kvlifecycle.transports.digest_gpu import SHORT_MAX, row_shape, tiled_root, tiled_xxh3

from kvlifecycle.digest import DigestError, digest_units, slice_view
from kvlifecycle.layout import grouped_layout, rows_layout
from kvlifecycle.transport import KVLayout, MemoryKind

LENGTHS = [241, 255, 256, 257, 320, 511, 960, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048, 2049, 3000, 4096,
           4097, 4160, 16383, 16384, 65536 + 65, 1 << 18]


@pytest.mark.parametrize("n", LENGTHS)
def test_tiled_decomposition_equals_xxhash(n: int) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    assert tiled_xxh3(data) == xxhash.xxh3_64_intdigest(data.tobytes())


def test_tiled_decomposition_equals_xxhash_at_every_length_of_three_rows() -> None:
    data = np.random.default_rng(7).integers(0, 256, 3 * 1024 + 64, dtype=np.uint8)
    for n in range(SHORT_MAX + 1, data.size + 1):
        assert tiled_xxh3(data[:n]) == xxhash.xxh3_64_intdigest(data[:n].tobytes()), n


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 40, 256])
def test_the_wide_kernels_decomposition_equals_xxhash(rows: int) -> None:
    data = np.random.default_rng(rows).integers(0, 256, rows * 1024, dtype=np.uint8)
    assert tiled_xxh3(data, wide=True) == xxhash.xxh3_64_intdigest(data.tobytes())
    with pytest.raises(ValueError, match="whole 1024-byte rows"):
        tiled_xxh3(data[:-8], wide=True)


def test_the_root_kernels_xxh64_equals_xxhash_for_any_count_of_leaves() -> None:
    """Under 4 leaves XXH64 starts from its fifth prime; 4 and more take the stripes; a remainder of 1 to 3 words
    follows them one at a time: 0 to 70 leaves cover each branch many times."""
    rng = np.random.default_rng(11)
    for count in range(71):
        leaves = rng.integers(0, 2**64 - 1, count, dtype=np.uint64, endpoint=True)
        assert tiled_root(leaves) == xxhash.xxh64_intdigest(leaves.astype("<u8").tobytes()), count


def test_row_shape_is_xxh3s_last_block_rule() -> None:
    # whole rows are those before the last byte's row; the last row keeps at most 15 stripes of its own
    assert row_shape(1024) == (1, 15) and row_shape(1025) == (2, 0) and row_shape(2048) == (2, 15)
    assert row_shape(241) == (1, 3) and row_shape(1089) == (2, 1)
    with pytest.raises(ValueError, match="over 240"):
        tiled_xxh3(b"x" * SHORT_MAX)


# --- on a GPU --------------------------------------------------------------------------------------------------

torch = pytest.importorskip("torch")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _regions(blocks: int, widths: list[int], seed: int) -> list[Any]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randint(0, 256, (blocks, w), dtype=torch.uint8, device="cuda", generator=gen) for w in widths]


def _layout(regions: list[Any]) -> KVLayout:
    return KVLayout(MemoryKind.VRAM, torch.cuda.current_device(), regions[0].shape[0],
                    [r.data_ptr() for r in regions], [r.shape[1] for r in regions])


def _host(regions: list[Any]) -> list[np.ndarray]:
    return [r.cpu().numpy() for r in regions]


def _digester(layout: KVLayout) -> Any:
    from kvlifecycle.transports.digest_gpu import GpuDigester

    return GpuDigester(layout)


# (regions, block bytes, pieces per unit, slices): rows whole in a slice, 8-byte words across slices, odd bytes,
# XXH3's short inputs (gathered to the host), a vLLM-like unit of 2 MiB (64 leaves of 32 rows: the unrolled chain),
# leaves past 64 rows (the chain's loop: 65 rows of odd length, 128 whole rows)
SHAPES = [(4, 4096, 1, 1), (4, 4096, 1, 4), (3, 2048, 2, 1), (2, 1024, 3, 2), (5, 200, 1, 1), (3, 136, 2, 1),
          (3, 333, 1, 1), (2, 1000, 2, 5), (1, 64, 1, 1), (2, 96, 1, 1), (1, 1088, 1, 1), (64, 32768, 1, 1),
          (2, 65536 + 8, 1, 1), (5, 131072, 1, 1)]


@cuda
@pytest.mark.parametrize(("regions", "width", "pieces", "slices"), SHAPES)
def test_gpu_digests_equal_the_host_contract(regions: int, width: int, pieces: int, slices: int) -> None:
    blocks = 24
    regs = _regions(blocks, [width] * regions, seed=width + regions)
    digester = _digester(_layout(regs))
    rng = np.random.default_rng(width)
    units = np.stack([rng.choice(blocks, pieces, replace=False) for _ in range(9)])
    host = _host(regs)
    for index in range(slices):
        offset, length = slice_view(width, slices, index) if slices > 1 else (0, 0)
        want = digest_units([host], units, offset=offset, length=length)
        got = digester.digests(units, offset=offset, length=length)
        assert got.dtype == np.dtype("<u8") and np.array_equal(got, want), (offset, length)


@cuda
@pytest.mark.parametrize("width", [241, 256, 1000, 1024, 1032, 1088, 4099, 8192])
def test_one_region_unit_is_xxh64_of_its_bytes_xxh3(width: int) -> None:
    regs = _regions(8, [width], seed=width)
    got = _digester(_layout(regs)).digests(np.arange(8))
    leaves = [xxhash.xxh3_64_intdigest(row.tobytes()) for row in regs[0].cpu().numpy()]
    assert got.tolist() == [xxhash.xxh64_intdigest(leaf.to_bytes(8, "little")) for leaf in leaves]


@cuda
def test_a_region_subset_mixed_widths_and_groups() -> None:
    regs = _regions(16, [2048] * 6, seed=1)
    digester = _digester(_layout(regs))
    units = np.array([3, 0, 15, 7])
    want = digest_units([[_host(regs)[r] for r in (4, 1)]], units)
    assert np.array_equal(digester.digests(units, only=[4, 1]), want)
    # a group of mixed block sizes (gathered to the host) after a KV group (the kernels)
    aux = _regions(5, [4096, 512], seed=2)
    kv = rows_layout("VRAM", 0, [r.data_ptr() for r in regs], [r.numel() for r in regs], [2048] * 6)
    rows = rows_layout("VRAM", 0, [r.data_ptr() for r in aux], [r.numel() for r in aux], [4096, 512])
    grouped = _digester(grouped_layout(kv, rows))
    got = grouped.digests(np.array([1, 16, 20, 2]))
    want_kv = digest_units([_host(regs)], np.array([1, 2]))
    want_aux = digest_units([_host(aux)], np.array([0, 4]))
    assert got.tolist() == [want_kv[0], want_aux[0], want_aux[1], want_kv[1]]
    with pytest.raises(DigestError, match="within one region group"):
        grouped.digests(np.array([[15, 16]]))
    with pytest.raises(DigestError, match="first group"):
        grouped.digests(np.array([16]), only=[0])


@cuda
def test_a_flipped_byte_changes_exactly_its_units_digest() -> None:
    regs = _regions(32, [32768] * 8, seed=3)
    digester = _digester(_layout(regs))
    units = np.arange(32)
    before = digester.digests(units)
    regs[5][17, 12345] ^= 0x01
    after = digester.digests(units)
    assert np.flatnonzero(before != after).tolist() == [17]


@cuda
def test_the_fused_copy_writes_the_blocks_and_digests_what_it_moved() -> None:
    src = _regions(12, [4096] * 6, seed=5)
    dst = [torch.zeros_like(r) for r in src]
    digester = _digester(_layout(src))
    got = digester.copy_and_digest(np.array([7, 2, 11]), [r.data_ptr() for r in dst], np.array([0, 9, 3]))
    assert np.array_equal(got.cpu().numpy().view(np.uint64), digest_units([_host(src)], np.array([7, 2, 11])))
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[0, 9, 3]], s[[7, 2, 11]]) and not d[[1, 2, 4, 5, 6, 7, 8, 10, 11]].any()
    with pytest.raises(DigestError, match="1024-byte"):
        _digester(_layout(_regions(4, [1000], seed=6))).copy_and_digest(np.array([1]), [0], np.array([2]))
    # the ids already on the device (no upload): the same copy and digests; ids of another type are refused
    again = [torch.zeros_like(r) for r in src]
    on_device = (torch.tensor([7, 2, 11], device="cuda"), torch.tensor([0, 9, 3], device="cuda"))
    got = digester.copy_and_digest(np.array([7, 2, 11]), [r.data_ptr() for r in again], np.array([0, 9, 3]),
                                   device_ids=on_device)
    assert np.array_equal(got.cpu().numpy().view(np.uint64), digest_units([_host(src)], np.array([7, 2, 11])))
    assert all(torch.equal(a, d) for a, d in zip(again, dst, strict=True))
    with pytest.raises(DigestError, match="device ids"):
        digester.copy_and_digest(np.array([7, 2, 11]), [r.data_ptr() for r in again], np.array([0, 9, 3]),
                                 device_ids=(on_device[0].int(), on_device[1]))


@cuda
@pytest.mark.parametrize(("rows", "warps"), [(4, 4), (8, 4), (16, 8), (32, 4)])
def test_the_wide_row_kernel_equals_the_host_contract_and_copies(rows: int, warps: int) -> None:
    from kvlifecycle.transports.digest_gpu import GpuDigester

    src = _regions(40, [10240] * 5, seed=rows)  # 10-row leaves: a tile's last program part empty
    dst = [torch.zeros_like(r) for r in src]
    wide = GpuDigester(_layout(src), wide=True, wide_rows=rows, wide_warps=warps, one_launch=False)
    units = np.array([39, 0, 17, 5, 22])
    want = digest_units([_host(src)], units)
    assert np.array_equal(wide.digests(units), want)
    assert np.array_equal(GpuDigester(_layout(src), wide=False).digests(units), want)
    assert np.array_equal(GpuDigester(_layout(src), wide=False, deep_chain=False).digests(units), want)
    got = wide.copy_and_digest(units, [r.data_ptr() for r in dst], np.array([1, 2, 3, 4, 6]))
    assert np.array_equal(got.cpu().numpy().view(np.uint64), want)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[[1, 2, 3, 4, 6]], s[units]) and not d[0].any() and not d[7:].any()


@cuda
@pytest.mark.parametrize(("warps", "split"), [(4, 1), (8, 1), (2, 2), (4, 2), (4, 4)])
def test_the_one_launch_kernel_launch_after_launch_and_on_two_streams(warps: int, split: int) -> None:
    """The one-launch kernel's chains and roots are run by each leaf's last part and each unit's last leaf to
    finish, counted in across programs: right on every launch of a stream (the counts left zero) and on two streams
    at once (a set of counts each)."""
    from kvlifecycle.transports.digest_gpu import GpuDigester

    src = _regions(48, [32768] * 64, seed=warps)  # a vLLM-like unit: 64 leaves of 32 rows
    digester = GpuDigester(_layout(src), leaf_warps=warps, leaf_split=split)
    host = _host(src)
    rng = np.random.default_rng(warps)
    for _ in range(6):
        units = rng.choice(48, 20, replace=False)
        assert np.array_equal(digester.digests(units), digest_units([host], units))
    first, second = torch.cuda.Stream(), torch.cuda.Stream()
    units = [rng.choice(48, 24, replace=False) for _ in range(2)]
    with torch.cuda.stream(first):
        one = digester.enqueue(units[0])
    with torch.cuda.stream(second):
        two = digester.enqueue(units[1])
    torch.cuda.synchronize()
    for got, picked in zip((one, two), units, strict=True):
        assert np.array_equal(got.cpu().numpy().view(np.uint64), digest_units([host], picked))
    assert len(digester._arrived) == 3 and not any(c.any() for c in digester._arrived.values())


@cuda
def test_every_chain_kernel_equals_the_host_contract_on_long_leaves() -> None:
    from kvlifecycle.transports.digest_gpu import GpuDigester

    src = _regions(6, [102400] * 3, seed=9)  # 100-row leaves: past the unrolled chain's 64, the chains' loops
    units = np.array([5, 0, 3])
    want = digest_units([_host(src)], units)
    for kwargs in ({}, {"deep_chain": False}, {"wide": False}, {"wide": False, "deep_chain": False}):
        assert np.array_equal(GpuDigester(_layout(src), **kwargs).digests(units), want), kwargs


@cuda
def test_the_vllm_adapter_picks_the_gpu_digester_for_kv_in_vram() -> None:
    pytest.importorskip("vllm.distributed", reason="the vLLM adapter imports vLLM")
    from kvlifecycle.adapters.vllm.worker import digester_for
    from kvlifecycle.transports.digest_gpu import GpuDigester

    from kvlifecycle.digest import VerifyMode

    regs = _regions(4, [1024] * 2, seed=4)
    assert isinstance(digester_for(VerifyMode.ALL, _layout(regs)), GpuDigester)
