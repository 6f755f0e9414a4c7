"""Run by ``test_digest_kernels_interpreted.py`` under Triton's interpreter (``TRITON_INTERPRET=1``) in a Python that
has Triton (the vLLM venv): the GPU digester's kernels, the ones a GPU runs, over host tensors, bit-exact with the
host contract. Prints one ``ok`` line per case; an assertion ends it with a traceback and a nonzero status."""

from __future__ import annotations

import os
import sys

import numpy as np

assert os.environ.get("TRITON_INTERPRET") == "1", "run under TRITON_INTERPRET=1"
import torch  # noqa: E402
from kvlifecycle.transports import digest_gpu  # noqa: E402
from kvlifecycle.transports.digest_gpu import GpuDigester  # noqa: E402

from kvlifecycle.digest import DigestError, digest_units, slice_view  # noqa: E402
from kvlifecycle.transport import KVLayout, MemoryKind  # noqa: E402

GEN = torch.Generator().manual_seed(1)


def regions(blocks: int, width: int, count: int) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (blocks, width), dtype=torch.uint8, generator=GEN) for _ in range(count)]


def digester(regs: list[torch.Tensor], **kwargs: object) -> GpuDigester:
    layout = KVLayout(MemoryKind.VRAM, 0, regs[0].shape[0], [r.data_ptr() for r in regs], [r.shape[1] for r in regs])
    return GpuDigester(layout, **kwargs)  # type: ignore[arg-type]


def host(regs: list[torch.Tensor]) -> list[list[np.ndarray]]:
    return [[r.numpy() for r in regs]]


# (regions, block bytes, pieces per unit, head slices): whole rows (the wide row kernel), 8-byte words across
# pieces, odd bytes, a short leaf (gathered), leaves past 64 rows (the chains' loops)
SHAPES = [(4, 4096, 1, 1), (4, 4096, 1, 4), (3, 2048, 2, 1), (2, 1024, 3, 2), (3, 136, 2, 1), (3, 333, 1, 1),
          (2, 1000, 2, 5), (1, 1088, 1, 1), (5, 200, 1, 1), (2, 65536 + 8, 1, 1), (2, 70 * 1024, 1, 1)]
for count, width, pieces, slices in SHAPES:
    regs = regions(6, width, count)
    rng = np.random.default_rng(width)
    units = np.stack([rng.choice(6, pieces, replace=False) for _ in range(3)])
    for kwargs in ({}, {"inline_ids": False}, {"loads_first": False}, {"leaf_split": 2}, {"leaf_split": 3},
                   {"one_launch": False}, {"wide": False}, {"deep_chain": False}, {"wide_cache": 0}):
        d = digester(regs, **kwargs)
        for index in range(slices):
            offset, length = slice_view(width, slices, index) if slices > 1 else (0, 0)
            want = digest_units(host(regs), units, offset=offset, length=length)
            got = d.digests(units, offset=offset, length=length)
            assert np.array_equal(got, want), (count, width, pieces, slices, kwargs)
        assert all(not c.any() for c in d._arrived.values()), "the one-launch kernel left a count behind"
    print("ok shape", count, width, pieces, slices, flush=True)

# the root at every branch of XXH64 (under 4 leaves, stripes, a remainder): in the one-launch kernel, merged with
# the chains, and apart
for count in (1, 2, 3, 4, 5, 7, 9, 33):
    regs = regions(4, 1024, count)
    units = np.array([3, 0])
    want = digest_units(host(regs), units)
    assert np.array_equal(digester(regs).digests(units), want), count
    assert np.array_equal(digester(regs, one_launch=False).digests(units), want), count
    assert np.array_equal(digester(regs, leaf_split=4).digests(units), want), count
    merged, digest_gpu.MERGED_ROOT_REGIONS = digest_gpu.MERGED_ROOT_REGIONS, 0
    try:
        assert np.array_equal(digester(regs).digests(units), want), count
    finally:
        digest_gpu.MERGED_ROOT_REGIONS = merged
    print("ok root", count, flush=True)

# the fused copy: the bytes land in the chosen slots, nothing else is written, the digests are what was moved
src = regions(8, 4096, 5)
dst = [torch.zeros_like(r) for r in src]
d = digester(src)
got = d.copy_and_digest(np.array([7, 2, 1]), [r.data_ptr() for r in dst], np.array([0, 5, 3]))
assert np.array_equal(got.numpy().view(np.uint64), digest_units(host(src), np.array([7, 2, 1])))
for s, t in zip(src, dst, strict=True):
    assert torch.equal(t[[0, 5, 3]], s[[7, 2, 1]]) and not t[[1, 2, 4, 6, 7]].any()
again = [torch.zeros_like(r) for r in src]
got = d.copy_and_digest(np.array([7, 2, 1]), [r.data_ptr() for r in again], np.array([0, 5, 3]),
                        device_ids=(torch.tensor([7, 2, 1]), torch.tensor([0, 5, 3])))
assert np.array_equal(got.numpy().view(np.uint64), digest_units(host(src), np.array([7, 2, 1])))
assert all(torch.equal(a, t) for a, t in zip(again, dst, strict=True))
two = [torch.zeros_like(r) for r in src]  # the row pass, then the chains and roots: the same
got = digester(src, one_launch=False).copy_and_digest(np.array([7, 2, 1]), [r.data_ptr() for r in two],
                                                      np.array([0, 5, 3]))
assert np.array_equal(got.numpy().view(np.uint64), digest_units(host(src), np.array([7, 2, 1])))
assert all(torch.equal(a, t) for a, t in zip(two, dst, strict=True))
uploaded = [torch.zeros_like(r) for r in src]  # the ids through memory, stores step by step: the same
got = digester(src, inline_ids=False, loads_first=False).copy_and_digest(
    np.array([7, 2, 1]), [r.data_ptr() for r in uploaded], np.array([0, 5, 3]))
assert np.array_equal(got.numpy().view(np.uint64), digest_units(host(src), np.array([7, 2, 1])))
assert all(torch.equal(a, t) for a, t in zip(uploaded, dst, strict=True))
# 16 units, the most the launch parameters hold, and 17, one past them
many = regions(40, 1024, 2)
rng = np.random.default_rng(16)
for n in (16, 17):
    s_ids, d_ids = rng.choice(40, n, replace=False), rng.choice(40, n, replace=False)
    out = [torch.zeros_like(r) for r in many]
    got = digester(many).copy_and_digest(s_ids, [r.data_ptr() for r in out], d_ids)
    assert np.array_equal(got.numpy().view(np.uint64), digest_units(host(many), s_ids)), n
    assert all(torch.equal(t[d_ids], r[s_ids]) for r, t in zip(many, out, strict=True)), n
    assert all(int(t.count_nonzero()) == int(t[d_ids].count_nonzero()) for t in out), n  # nothing else written
    assert np.array_equal(digester(many).digests(s_ids), digest_units(host(many), s_ids)), n
try:
    d.copy_and_digest(np.array([7]), [r.data_ptr() for r in again], np.array([0]),
                      device_ids=(torch.tensor([7], dtype=torch.int32), torch.tensor([0])))
    sys.exit("int32 device ids were taken")
except DigestError:
    pass
print("ok fused", flush=True)

# one flipped byte changes exactly its unit's digest
regs = regions(6, 2048, 4)
d = digester(regs)
before = d.digests(np.arange(6))
regs[2][4, 1000] ^= 1
after = d.digests(np.arange(6))
assert np.flatnonzero(before != after).tolist() == [4]
print("ok flip", flush=True)
