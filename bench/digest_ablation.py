"""Where the fused copy + digest of a small request spends its time over the plain block copy, and whether a
persistent launch hides each leaf's chain behind the next leaf's loads.

    bash bench/gpu_run.sh ablation                                    # on a GPU: 16 blocks x 64 regions x 32 KiB
    TRITON_INTERPRET=1 .venv-vllm/bin/python bench/digest_ablation.py   # on the CPU: a small shape, digests checked

The one-launch kernel (``GpuDigester.copy_and_digest``, block ids as launch parameters) cut into stages, each a
launch of the same program shape (a program per leaf, the leaf's 32 rows as one tile): 0 the copy alone, 1 + the
row math and its additions stored, 2 + the leaf's chain, 3 + the unit's count and root (the production kernel).
Then ``persist``: a fixed number of programs per SM, each walking leaves ``pid, pid + P, ...``, that stores a leaf
and issues the next leaf's loads before running this leaf's chain. Every figure is a CUDA-event median with ~1 ms of
GPU spin ahead of the launch, a new random id set each repetition, beside the unverified block copy timed first and
last in the same run. Digests of the full variants are checked against ``xxhash``, and the bytes moved.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from kvlifecycle.transports.cuda_ipc.triton_copy import _pick16
from kvlifecycle.transports.digest_gpu import (
    _block_row_words,
    _chain_unrolled,
    _part_of,
    _root_if_last,
    _store_adds,
    _wide_load,
    _wide_store,
    _wide_sums,
    _wide_tile,
)

INTERP = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _ids(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15):
    return _pick16(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15).to(tl.int64)


@triton.jit
def stage_kernel(anchor64_ptr, bases_ptr, dst_bases_ptr, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr,
                 out_ptr, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                 d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, stride, lo, total, units,
                 ROWS: tl.constexpr, NROWS: tl.constexpr, REGIONS: tl.constexpr, SPLIT: tl.constexpr,
                 ALIGN: tl.constexpr, STAGE: tl.constexpr):
    """STAGE 0: the copy alone in the one-launch program shape; 1: + row math and the additions stored;
    2: + the leaf's chain; 3: + the unit count and root (= the production kernel with SPLIT 1)."""
    leaf, unit, region, row = _part_of(SPLIT, REGIONS, ROWS)
    block = _ids(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15)
    dst_block = _ids(unit, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15)
    first = _block_row_words(block, tl.load(bases_ptr + region), stride, lo, row, NROWS, ALIGN)
    dst_first = _block_row_words(dst_block, tl.load(dst_bases_ptr + region), stride, lo, row, NROWS, ALIGN)
    even, odd = _wide_tile(anchor64_ptr, first, dst_first, secret_ptr, NROWS, row, ROWS, True, 1, True)
    if STAGE >= 1:
        _store_adds(adds_ptr, leaf, NROWS, row, even, odd)
    if STAGE >= 2:
        tl.debug_barrier()
        lane = tl.arange(0, 8)[None, :]
        h = _chain_unrolled(adds_ptr + leaf * NROWS * 8 + lane, secret_ptr, lane, total, 1, NROWS, False)
        tl.store(leaves_ptr + leaf + tl.arange(0, 1), h.to(tl.int64, bitcast=True))
    if STAGE >= 3:
        tl.debug_barrier()
        _root_if_last(leaves_ptr, arrived_ptr, out_ptr, primes_ptr, unit, REGIONS)


@triton.jit
def persist_kernel(anchor64_ptr, bases_ptr, dst_bases_ptr, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr,
                   out_ptr, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
                   d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15, stride, lo, total, units,
                   NROWS: tl.constexpr, REGIONS: tl.constexpr, ALIGN: tl.constexpr):
    """Leaves pid, pid + P, ...: a leaf's stores and row math, then the next leaf's loads issued, then this leaf's
    chain (and root) while they are in flight."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    leaves = units * REGIONS
    j = tl.arange(0, 32)[None, :].to(tl.int64)
    row = tl.arange(0, NROWS)[:, None].to(tl.int64)
    last_row = row == NROWS - 1
    lane = tl.arange(0, 8)[None, :]
    leaf = pid.to(tl.int64)
    live = (row * 0 + leaf) < leaves
    unit = tl.minimum(leaf, leaves - 1) // REGIONS
    region = tl.minimum(leaf, leaves - 1) - unit * REGIONS
    first = _block_row_words(_ids(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15),
                             tl.load(bases_ptr + region), stride, lo, row, NROWS, ALIGN)
    dst_first = _block_row_words(_ids(unit, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15),
                                 tl.load(dst_bases_ptr + region), stride, lo, row, NROWS, ALIGN)
    src = anchor64_ptr + first + j
    r0 = _wide_load(src, live, 1)
    r1 = _wide_load(src + 32, live, 1)
    r2 = _wide_load(src + 64, live, 1)
    r3 = _wide_load(src + 96, live, 1)
    for _ in range(pid, leaves, nprog):
        dst = anchor64_ptr + dst_first + j
        _wide_store(dst, r0, live, 1)
        _wide_store(dst + 32, r1, live, 1)
        _wide_store(dst + 64, r2, live, 1)
        _wide_store(dst + 96, r3, live, 1)
        even, odd = _wide_sums(r0, r1, r2, r3, secret_ptr, j, last_row, NROWS)
        _store_adds(adds_ptr, leaf, NROWS, row, even, odd)
        this_leaf, this_unit = leaf, unit
        # the next leaf's loads, before this leaf's chain
        leaf = leaf + nprog
        live = (row * 0 + leaf) < leaves
        unit = tl.minimum(leaf, leaves - 1) // REGIONS
        region = tl.minimum(leaf, leaves - 1) - unit * REGIONS
        first = _block_row_words(_ids(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15),
                                 tl.load(bases_ptr + region), stride, lo, row, NROWS, ALIGN)
        dst_first = _block_row_words(_ids(unit, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14,
                                          d15), tl.load(dst_bases_ptr + region), stride, lo, row, NROWS, ALIGN)
        src = anchor64_ptr + first + j
        r0 = _wide_load(src, live, 1)
        r1 = _wide_load(src + 32, live, 1)
        r2 = _wide_load(src + 64, live, 1)
        r3 = _wide_load(src + 96, live, 1)
        tl.debug_barrier()
        h = _chain_unrolled(adds_ptr + this_leaf * NROWS * 8 + lane, secret_ptr, lane, total, 1, NROWS, False)
        tl.store(leaves_ptr + this_leaf + tl.arange(0, 1), h.to(tl.int64, bitcast=True))
        tl.debug_barrier()
        _root_if_last(leaves_ptr, arrived_ptr, out_ptr, primes_ptr, this_unit, REGIONS)


Launch = Callable[[np.ndarray, np.ndarray], Any]


def main() -> None:
    from kvlifecycle.transports.digest_gpu import GpuDigester, reference_digests

    from kvlifecycle.tools.bench_gpu import fastpath
    from kvlifecycle.transport import KVLayout, MemoryKind

    dev = torch.device("cpu") if INTERP else torch.device("cuda", 0)
    regions, pool, bb, n = (4, 8, 32768, 3) if INTERP else (64, 512, 32768, 16)
    reps = 3 if INTERP else 40
    gen = torch.Generator(device=dev).manual_seed(3)
    src = torch.randint(0, 256, (regions, pool, bb), dtype=torch.uint8, device=dev, generator=gen)
    dst = torch.zeros_like(src)
    layout = KVLayout(MemoryKind.VRAM, dev.index or 0, pool, [src[r].data_ptr() for r in range(regions)],
                      [bb] * regions)
    dig = GpuDigester(layout)
    dst_bases = [dst[r].data_ptr() for r in range(regions)]
    rng = np.random.default_rng(5)
    sets = [(rng.choice(pool, n, replace=False), rng.choice(pool, n, replace=False)) for _ in range(reps)]
    bases_t, dst_t = dig._offsets([src[r].data_ptr() for r in range(regions)]), dig._offsets(dst_bases)
    nrows, leaves = bb // 1024, n * regions
    adds = torch.empty((leaves, nrows, 8), dtype=torch.int64, device=dev)
    leaf_digests = torch.empty(leaves, dtype=torch.int64, device=dev)
    out = torch.empty(n, dtype=torch.int64, device=dev)
    arrived = torch.zeros(4096, dtype=torch.int32, device=dev)  # left zero by every launch that counts
    scratch = (dig._anchor64, bases_t, dst_t, dig._secret, dig._primes, adds, leaf_digests, arrived, out)

    def inline(s: np.ndarray, d: np.ndarray) -> list[int]:
        return [int(b) for b in s] + [0] * (16 - n) + [int(b) for b in d] + [0] * (16 - n)

    def stage(number: int, warps: int) -> Launch:
        def run(s: np.ndarray, d: np.ndarray) -> Any:
            stage_kernel[(leaves,)](*scratch, *inline(s, d), bb, 0, bb, n, ROWS=nrows, NROWS=nrows, REGIONS=regions,
                                    SPLIT=1, ALIGN=2, STAGE=number, num_warps=warps)
            return out
        return run

    def persist(programs: int, warps: int) -> Launch:
        def run(s: np.ndarray, d: np.ndarray) -> Any:
            persist_kernel[(min(programs, leaves),)](*scratch, *inline(s, d), bb, 0, bb, n, NROWS=nrows,
                                                    REGIONS=regions, ALIGN=2, num_warps=warps, num_stages=1)
            return out
        return run

    def timed(fn: Launch, args: list[Any]) -> float:
        for a in args[:3]:
            fn(*a)
        if INTERP:
            return float("nan")
        torch.cuda.synchronize()
        xs = []
        for a in args:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(2_000_000)
            start.record()
            fn(*a)
            end.record()
            end.synchronize()
            xs.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(xs)

    def exact(fn: Launch) -> bool:
        s, d = sets[0]
        dst.zero_()
        got = fn(s, d).cpu().numpy().view(np.uint64).copy()
        want = reference_digests([src[r] for r in range(regions)], s.astype(np.int64))
        moved = bool(torch.equal(dst[:, torch.from_numpy(d).long()], src[:, torch.from_numpy(s).long()]))
        return bool(np.array_equal(got, want)) and moved

    sms = 1 if INTERP else torch.cuda.get_device_properties(dev).multi_processor_count
    variants: dict[str, Launch] = {"production": lambda s, d: dig.copy_and_digest(s, dst_bases, d)}
    variants |= {f"stage {k} 4w": stage(k, 4) for k in range(4)}
    variants |= {"stage 0 8w": stage(0, 8), "stage 3 8w": stage(3, 8)}
    variants |= {f"persist {k}/SM {w}w": persist(k * sms, w) for k, w in ((2, 4), (3, 4), (4, 4), (5, 4), (2, 8),
                                                                           (3, 8))}
    checked = {"production", "stage 3 4w", "stage 3 8w"} | {k for k in variants if k.startswith("persist")}
    if INTERP:  # the full variants, checked; a persistent grid of 2 and 3 programs walks several leaves each
        variants = {k: v for k, v in variants.items() if k in ("production", "stage 3 4w", "persist 2/SM 4w",
                                                               "persist 3/SM 4w")}
    copier = None
    if not INTERP:
        specs = [[fastpath.RegionSpec.of_tensor(p[r]) for r in range(regions)] for p in (src, dst)]
        copier = fastpath.BlockCopier(specs[0], specs[1], dev)
    dev_sets = [(torch.from_numpy(s.astype(np.int32)).to(dev), torch.from_numpy(d.astype(np.int32)).to(dev))
                for s, d in sets]

    def unverified() -> float:
        return timed(lambda s, d: copier.copy(s, d), dev_sets) if copier else float("nan")

    name = "interpreter" if INTERP else torch.cuda.get_device_name(dev)
    print(f"ablation on {name}: {n} blocks x {regions} regions x {bb // 1024} KiB")
    base = unverified()
    print(f"  unverified block copy: {base * 1e6:.1f} us")
    for key, fn in variants.items():
        try:
            t = timed(fn, sets)
            verdict = exact(fn) if key in checked else "-"
            print(f"  {key:20s} {t * 1e6:7.1f} us  x unverified {base / t:.3f}  exact {verdict}")
        except Exception as exc:  # a variant that does not compile or fit is reported, not fatal
            print(f"  {key}: {type(exc).__name__}: {str(exc)[:300]}")
    print(f"  unverified block copy again: {unverified() * 1e6:.1f} us")


if __name__ == "__main__":
    main()
