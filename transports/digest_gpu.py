"""Per-block digests over KV regions in VRAM: :class:`kvlifecycle.digest.BlockDigester` for KV on a GPU, bit-exact
with :class:`~kvlifecycle.transports.digest_host.HostDigester` (the contract of :mod:`kvlifecycle.digest`: XXH3-64,
seed 0, default secret, over each region's slice of a unit, a *leaf*; XXH64 over the leaves). One concept, longer
than most: XXH3 split into a row pass and a chain, and the root, whose kernels only make sense read together.

**How XXH3 splits on a GPU.** XXH3 over more than 240 bytes keeps 8 u64 accumulators and walks 1024-byte *rows* of
16 stripes of 64 bytes. Within a row every stripe only *adds* to the accumulators (``acc[i ^ 1] += x[i]``,
``acc[i] += lo32(x[i] ^ k) * hi32(x[i] ^ k)``), so a row's contribution is a sum that any number of threads can
take in any order; between rows the accumulators are scrambled (xorshift, xor, multiply), a chain that is
sequential per leaf and per lane. So three parts:

1. The row pass, every (leaf, row) at once: a tile of rows per program reduced to each row's 8 additions (the
   last row holds the partial stripes and XXH3's overlapping last stripe, whose secret differs). This is the pass
   over the KV bytes, at memory speed; it writes 64 bytes per 1024 read. Rows that lie whole in one piece's slice
   (KV blocks of whole KiB) are read as a copy reads them (``_wide_tile``: 4 steps of 32 contiguous words);
   others take ``_xxh3_rows_kernel`` (8-byte words or bytes gathered across pieces).
2. The chain, per leaf and lane: the scramble over those additions, then XXH3's merge and avalanche (the
   64×64→128-bit multiply in 32-bit halves, as xxHash's portable path does it), its rows unrolled for leaves of
   up to 64 rows; longer leaves take ``_xxh3_chain_deep_kernel``, its loads 24 steps ahead.
3. The root, per unit: XXH64 over its leaves.

For leaves of whole KiB rows, at most 64 of them (a 32 KiB region slice is 32), ``_xxh3_one_launch_kernel`` runs
all three in one launch: the programs of a leaf read its rows, the last of them to finish runs the leaf's chain,
and the last leaf of a unit to finish its root, each found by an acquire-release count (a second launch would wait
for the slowest row program of the whole request, and costs the 16-block request more than its chains do). Other
leaves take the row pass, then ``_xxh3_leaves_root_kernel`` (a unit's chains and root) or the chain and root
kernels apart. A program issues every load of its tile before its first store: source and destination are both
addressed from one anchor, so the compiler cannot rule out that a store feeds a later load and would otherwise keep
each step's stores ahead of the next step's loads (four memory round trips a tile instead of one; the machine code's
order is a CPU test). Up to 16 one-block units pass their block ids as launch parameters, as the block copy does,
instead of an upload ahead of the launch.

The chain is ``(leaf bytes) / 1024`` dependent steps: 32 for a 32 KiB slice, every leaf of a request at once. (The
digest of before, XXH3 over a whole block across its regions, was one chain of 2,048 steps for a 2 MiB block: 42 µs
on any GPU, more than the copy of a 16-block request.) :func:`tiled_xxh3` and :func:`tiled_root` are the same
decompositions in numpy, checked against ``xxhash`` on the CPU, so CI proves the arithmetic without a GPU.

**What runs where.** Leaves of more than 240 bytes whose regions share one block size run the kernels; smaller
leaves (XXH3's short-input paths) and groups of mixed block sizes are gathered on the device, copied to the host
and hashed there with ``xxhash``; groups in host memory (SGLang's aux rows) are read in place. Launches go to the
device's current stream and the call waits for its result, as the host digester returns its values.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvlifecycle.digest import DIGEST_DTYPE, DigestError, digest_units, root_digest
from kvlifecycle.transport import KVLayout, MemoryKind

from .cuda_ipc.triton_copy import INLINE_IDS

if TYPE_CHECKING:
    import torch

try:  # Triton is optional: without it the digester refuses to be built (the adapter says what to set)
    import triton
    import triton.language as tl

    from .cuda_ipc.triton_copy import _pick16

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False

# xxHash's XXH3_kSecret (xxhash.h): the default 192-byte secret
_K_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671fcb79e64eccc0e578825ad07dccff7221"
    "b8084674f743248ee03590e6813a264c3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364eac5ac8334d3ebc3c581a0fffa1363eb"
    "170ddd51b7f0da49d316552629d4689e2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
SHORT_MAX = 240  # XXH3's short-input paths end here; longer inputs take the striped path the kernels compute
ROW_BYTES, STRIPE_BYTES = 1024, 64
_P32_1, _P32_2, _P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
_P64_1, _P64_2, _P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
_P64_4, _P64_5, _PRIME_MX1 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5, 0x165667919E3779F9
INIT_ACC = np.array([_P32_3, _P64_1, _P64_2, _P64_3, _P64_4, _P32_2, _P64_5, _P32_1], dtype=np.uint64)
LAST_ROW, SCRAMBLE_ROW, MERGE_ROW, INIT_ROW = 16, 17, 18, 19
SHORT_CHAIN_ROWS = 64  # leaves of up to this many rows take the unrolled chain (a region's slice: 32 KiB is 32)
ROOT_UNITS = 32  # units per program of the root kernel (a thread each)
MERGED_ROOT_REGIONS = 256  # up to this many regions, one kernel runs a unit's chains and its root


def _secret_words(start: int) -> list[int]:
    return [int.from_bytes(_K_SECRET[start + 8 * j:start + 8 * j + 8], "little") for j in range(8)]


# The secret as the kernels read it, one row of 8 u64 per use: stripe s's keys (bytes 8s..), the last stripe's
# (byte 121: XXH_SECRET_LASTACC_START), the scramble's (byte 128), the merge's (byte 11) and the initial accumulators
SECRET_TABLE = np.array([_secret_words(8 * s) for s in range(16)] + [_secret_words(121), _secret_words(128),
                        _secret_words(11), [int(v) for v in INIT_ACC]], dtype=np.uint64)


_MASK64 = (1 << 64) - 1
# XXH64's primes and its first and fourth initial accumulators (seed 0) as the root kernel reads them
XXH64_TABLE = np.array([_P64_1, _P64_2, _P64_3, _P64_4, _P64_5, (_P64_1 + _P64_2) & _MASK64, -_P64_1 & _MASK64],
                       dtype=np.uint64)


def row_shape(total: int) -> tuple[int, int]:
    """``(rows, stripes in the last row)`` of XXH3's striped path over ``total`` bytes: rows before the last are
    whole (16 stripes, then a scramble); the last holds ``stripes`` stripes plus the last 64 bytes of the input."""
    full = (total - 1) // ROW_BYTES
    return full + 1, ((total - 1) - ROW_BYTES * full) // STRIPE_BYTES


def _mul128_fold64(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """lo64(a × b) ^ hi64(a × b) in 32-bit halves (xxHash's XXH_mult64to128, portable form): exact in u64."""
    m = np.uint64(0xFFFFFFFF)
    s32 = np.uint64(32)
    lo_lo, hi_lo = (a & m) * (b & m), (a >> s32) * (b & m)
    lo_hi, hi_hi = (a & m) * (b >> s32), (a >> s32) * (b >> s32)
    cross = (lo_lo >> s32) + (hi_lo & m) + lo_hi
    upper = (hi_lo >> s32) + (cross >> s32) + hi_hi
    lower = (cross << s32) | (lo_lo & m)
    return np.asarray(lower ^ upper, dtype=np.uint64)


def tiled_xxh3(data: bytes | np.ndarray, *, wide: bool = False) -> int:
    """XXH3-64 of ``data`` (more than 240 bytes) computed as the kernels compute it: every row's additions from a
    ``[rows, 16, 8]`` tile (positions and masks as ``_xxh3_rows_kernel`` forms them), then the chain and the merge
    (``_xxh3_chain_kernel``). Equal to ``xxhash.xxh3_64_intdigest(data)``; the CPU proof of the kernels' math.
    ``wide``: the additions of whole-row inputs (``len(data) % 1024 == 0``) as ``_xxh3_rows_wide_kernel`` forms them
    (a row as 4 steps of 32 words, each lane's 4 partial sums added after)."""
    buf = np.frombuffer(bytes(data), dtype=np.uint8) if isinstance(data, bytes) else np.asarray(data, np.uint8)
    total = int(buf.size)
    if total <= SHORT_MAX:
        raise ValueError(f"the striped path is for inputs over {SHORT_MAX} bytes, got {total}")
    nrows, last_stripes = row_shape(total)
    row = np.arange(nrows)[:, None, None]
    s = np.arange(16)[None, :, None]
    lane = np.arange(8)[None, None, :]
    last_row, last_slot = row == nrows - 1, (row == nrows - 1) & (s == 15)
    valid = ~last_row | (s < last_stripes) | (s == 15)
    pos = np.where(last_slot, total - STRIPE_BYTES + lane * 8, row * ROW_BYTES + s * STRIPE_BYTES + lane * 8)
    pos = np.where(valid, pos, 0)
    padded = np.concatenate([buf, np.zeros(8, np.uint8)])
    x = np.zeros(pos.shape, np.uint64)
    for b in range(8):  # little-endian words at any byte position (the last stripe is not 8-aligned)
        x |= padded[pos + b].astype(np.uint64) << np.uint64(8 * b)
    x = np.where(valid, x, np.uint64(0))
    sec = np.where(last_slot, SECRET_TABLE[LAST_ROW][None, None, :], SECRET_TABLE[:16][None, :, :])
    key = x ^ sec
    prod = np.where(valid, (key & np.uint64(0xFFFFFFFF)) * (key >> np.uint64(32)), np.uint64(0))
    adds = prod.sum(axis=1, dtype=np.uint64) + x.sum(axis=1, dtype=np.uint64)[:, [1, 0, 3, 2, 5, 4, 7, 6]]
    if wide:
        adds = _wide_adds(buf)
    acc = INIT_ACC.copy()
    for n in range(nrows - 1):
        acc = acc + adds[n]
        acc = ((acc ^ (acc >> np.uint64(47))) ^ SECRET_TABLE[SCRAMBLE_ROW]) * np.uint64(_P32_1)
    acc = acc + adds[nrows - 1]
    merge = SECRET_TABLE[MERGE_ROW]
    h = np.array([total], np.uint64) * np.uint64(_P64_1)  # arrays: numpy wraps them silently, as u64 does
    h += _mul128_fold64(acc[0::2] ^ merge[0::2], acc[1::2] ^ merge[1::2]).sum(dtype=np.uint64)
    h ^= h >> np.uint64(37)
    h *= np.uint64(_PRIME_MX1)
    h ^= h >> np.uint64(32)
    return int(h[0])


def tiled_root(leaves: np.ndarray) -> int:
    """XXH64 (seed 0) of ``leaves`` as little-endian u64, computed as ``_xxh64_root_kernel`` computes it (stripes of
    4 words, the merge whatever their count, the start chosen after). Equal to ``xxhash.xxh64_intdigest`` of the
    words' bytes: the CPU proof of the root kernel's math."""
    words = [int(w) for w in np.asarray(leaves, dtype=np.uint64)]
    p1, p2, p3, p4, p5, v1_init, v4_init = (int(v) for v in XXH64_TABLE)

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (64 - r))) & _MASK64

    def rnd(acc: int, word: int) -> int:
        return rotl((acc + word * p2) & _MASK64, 31) * p1 & _MASK64

    v = [v1_init, p2, 0, v4_init]
    stripes = len(words) // 4
    for s in range(stripes):
        v = [rnd(v[i], words[4 * s + i]) for i in range(4)]
    h = (rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18)) & _MASK64
    for lane in v:
        h = ((h ^ rnd(0, lane)) * p1 + p4) & _MASK64
    h = h if stripes else p5
    h = (h + 8 * len(words)) & _MASK64
    for w in words[4 * stripes:]:
        h = (rotl(h ^ rnd(0, w), 27) * p1 + p4) & _MASK64
    h ^= h >> 33
    h = h * p2 & _MASK64
    h ^= h >> 29
    h = h * p3 & _MASK64
    return h ^ (h >> 32)


def _wide_adds(buf: np.ndarray) -> np.ndarray:
    """Each row's 8 additions as ``_xxh3_rows_wide_kernel`` forms them (whole rows only)."""
    if buf.size % ROW_BYTES:
        raise ValueError(f"the wide row kernel takes whole 1024-byte rows, got {buf.size} bytes")
    nrows = buf.size // ROW_BYTES
    x = buf.view("<u8").astype(np.uint64).reshape(nrows, 4, 32)  # [row, step, word j of the step]
    j = np.arange(32)
    sec = np.broadcast_to(SECRET_TABLE[:16].reshape(4, 32), (nrows, 4, 32)).copy()
    sec[nrows - 1, 3, 24:] = SECRET_TABLE[LAST_ROW][j[24:] % 8]  # the last row's stripe 15: the last stripe
    key = x ^ sec
    m = ((key & np.uint64(0xFFFFFFFF)) * (key >> np.uint64(32))).sum(axis=1, dtype=np.uint64)  # [row, 32]
    a = x.sum(axis=1, dtype=np.uint64)
    m8 = m.reshape(nrows, 4, 8).sum(axis=1, dtype=np.uint64)
    a8 = a.reshape(nrows, 4, 8).sum(axis=1, dtype=np.uint64)
    return np.asarray(m8 + a8[:, [1, 0, 3, 2, 5, 4, 7, 6]], dtype=np.uint64)


if HAVE_TRITON:

    @triton.jit
    def _src_offset(pos, seg, unit_ids, region_base, stride, lo):
        """Byte offset from the anchor of byte ``pos`` of a leaf (one region's slices of a unit's pieces, in order):
        segment ``k = pos // seg`` is piece ``k``'s slice, in the region at ``region_base``."""
        k = pos // seg
        return region_base + tl.load(unit_ids + k) * stride + lo + (pos - k * seg)

    @triton.jit
    def _leaf_of(regions, ROWS: tl.constexpr):
        """A row kernel's program: its leaf (axis 0: unit × region, region fastest), the leaf's unit and region,
        and its tile of the leaf's rows (axis 1)."""
        leaf = tl.program_id(0).to(tl.int64)
        unit = leaf // regions
        row = (tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
        return leaf, unit, leaf - unit * regions, row

    @triton.jit
    def _xxh3_rows_kernel(
        anchor64_ptr,  # int64 view of the anchor: 8-byte words (MODE 0 and 1)
        anchor8_ptr,  # uint8 view of the same anchor (MODE 2)
        bases_ptr,  # int64[R]: byte offset of region r from the anchor
        ids_ptr,  # int64[U, pieces]: each unit's block ids in its group
        dst_bases_ptr,  # COPY: int64[R], the destination regions (same block bytes) from the anchor
        dst_ids_ptr,  # COPY: int64[U, pieces], the destination block ids
        secret_ptr,  # int64[20, 8]: SECRET_TABLE
        adds_ptr,  # int64[U × R, nrows, 8] out: each leaf row's additions to the 8 accumulators
        seg, pieces, stride, lo, total, nrows, last_stripes, regions,  # total, nrows, last_stripes: of one leaf
        ROWS: tl.constexpr,  # rows per program
        MODE: tl.constexpr,  # 0: rows lie whole in one segment; 1: 8-byte words gathered; 2: bytes gathered
        ALIGN: tl.constexpr,  # MODE 0: words per guaranteed alignment of a row's start (2: 16-byte loads)
        COPY: tl.constexpr = False,  # MODE 0: also store every word read to the destination blocks (fused copy)
    ):
        """A ``[ROWS, 8]`` tile per stripe, the 16 stripes summed in registers (no cross-thread reduction): each
        thread keeps its rows' sums, and the 16 loads of a tile are independent, so they are all in flight."""
        leaf, unit, region, row = _leaf_of(regions, ROWS)
        lane = tl.arange(0, 8)[None, :].to(tl.int64)
        live = row < nrows
        last_row = row == nrows - 1
        unit_ids = ids_ptr + unit * pieces
        base = tl.load(bases_ptr + region)
        if MODE == 0:
            # seg % 1024 == 0: a row is contiguous, and the last stripe is its slot 15 (total % 1024 == 0)
            start = _src_offset(tl.where(live, row * 1024, 0), seg, unit_ids, base, stride, lo)
            first = tl.multiple_of(start // 8, [ALIGN, ALIGN])
            if COPY:
                dst = _src_offset(tl.where(live, row * 1024, 0), seg, dst_ids_ptr + unit * pieces,
                                  tl.load(dst_bases_ptr + region), stride, lo)
                dst_first = tl.multiple_of(dst // 8, [ALIGN, ALIGN])
        m = tl.zeros([ROWS, 8], tl.uint64)
        a = tl.zeros([ROWS, 8], tl.uint64)
        for s in tl.static_range(16):
            # whole rows' 16th stripe, or the last row's overlapping last stripe (its own secret); a Triton `if` on a
            # constexpr is resolved when compiled, the form the kernels use throughout
            if s == 15:  # noqa: SIM108
                valid = live
            else:
                valid = live & ((row != nrows - 1) | (row * 0 + s < last_stripes))
            if MODE == 0:
                raw = tl.load(anchor64_ptr + first + s * 8 + lane, mask=valid, other=0, cache_modifier=".cg")
                if COPY:  # MODE 0 covers every byte of a unit (its last row has 15 stripes + the last)
                    tl.store(anchor64_ptr + dst_first + s * 8 + lane, raw, mask=valid, cache_modifier=".cs")
                x = raw.to(tl.uint64, bitcast=True)
            else:
                pos = row * 1024 + s * 64 + lane * 8
                if s == 15:
                    pos = tl.where(last_row, total - 64 + lane * 8, pos)
                pos = tl.where(valid, pos, 0)
                if MODE == 1:
                    off = _src_offset(pos, seg, unit_ids, base, stride, lo)
                    x = tl.load(anchor64_ptr + off // 8, mask=valid, other=0).to(tl.uint64, bitcast=True)
                else:
                    x = tl.zeros([ROWS, 8], tl.uint64)
                    for b in tl.static_range(8):  # a word may straddle two pieces' slices
                        off = _src_offset(pos + b, seg, unit_ids, base, stride, lo)
                        byte = tl.load(anchor8_ptr + off, mask=valid, other=0).to(tl.uint64)
                        x = x | (byte << (8 * b))
            sec = tl.load(secret_ptr + s * 8 + lane).to(tl.uint64, bitcast=True)
            if s == 15:
                sec = tl.where(last_row, tl.load(secret_ptr + 16 * 8 + lane).to(tl.uint64, bitcast=True), sec)
            key = x ^ sec
            # 32 x 32 -> 64 bits: zero-extended halves let the compiler use one wide multiply
            prod = (key & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64) * (key >> 32).to(tl.uint32).to(tl.uint64)
            m += tl.where(valid, prod, 0).to(tl.uint64)
            a += x
        m_even, m_odd = tl.split(tl.reshape(m, [ROWS, 4, 2]))
        x_even, x_odd = tl.split(tl.reshape(a, [ROWS, 4, 2]))
        # acc[i ^ 1] += x[i]: lane 2i takes the odd words, lane 2i + 1 the even ones
        _store_adds(adds_ptr, leaf, nrows, row, m_even + x_odd, m_odd + x_even)

    @triton.jit
    def _row_words(unit_ids, region_base, seg, stride, lo, row, nrows, ALIGN: tl.constexpr):
        """The 8-byte word (from the anchor) where each of ``row``'s rows of a leaf starts, for rows whole in one
        piece's slice (``seg % 1024 == 0``); rows past ``nrows`` are pointed at the first (their accesses are
        masked)."""
        start = _src_offset(tl.where(row < nrows, row * 1024, 0), seg, unit_ids, region_base, stride, lo)
        return tl.multiple_of(start // 8, [ALIGN, ALIGN])

    @triton.jit
    def _block_row_words(block, region_base, stride, lo, row, nrows, ALIGN: tl.constexpr):
        """:func:`_row_words` for a unit of one block whose id the program already holds (a launch parameter)."""
        start = region_base + block * stride + lo + tl.where(row < nrows, row * 1024, 0)
        return tl.multiple_of(start // 8, [ALIGN, ALIGN])

    @triton.jit
    def _unit_row_words(ids_ptr, dst_ids_ptr, bases_ptr, dst_bases_ptr, unit, region, seg, pieces, stride, lo, row,
                        nrows, ALIGN: tl.constexpr, COPY: tl.constexpr):
        """:func:`_row_words` of a unit's rows in ``region``, and (``COPY``) of its destination's: the ids in memory."""
        first = _row_words(ids_ptr + unit * pieces, tl.load(bases_ptr + region), seg, stride, lo, row, nrows, ALIGN)
        dst_first = first
        if COPY:
            dst_first = _row_words(dst_ids_ptr + unit * pieces, tl.load(dst_bases_ptr + region), seg, stride, lo,
                                   row, nrows, ALIGN)
        return first, dst_first

    @triton.jit
    def _wide_load(ptr, live, CACHE: tl.constexpr):
        if CACHE == 1:
            return tl.load(ptr, mask=live, other=0, cache_modifier=".cg")
        return tl.load(ptr, mask=live, other=0)

    @triton.jit
    def _wide_store(ptr, raw, live, CACHE: tl.constexpr):
        if CACHE == 1:
            tl.store(ptr, raw, mask=live, cache_modifier=".cs")
        else:
            tl.store(ptr, raw, mask=live)

    @triton.jit
    def _wide_step(raw, step: tl.constexpr, secret_ptr, j, last_row):
        """One step's 32 words of a row: their secret products and the words themselves, per thread."""
        x = raw.to(tl.uint64, bitcast=True)
        # word 32 * step + j is stripe 4 * step + j // 8, lane j % 8: SECRET_TABLE's rows 0..15 in order
        sec = tl.load(secret_ptr + step * 32 + j).to(tl.uint64, bitcast=True)
        if step == 3:  # the last row's stripe 15 is XXH3's last stripe (same bytes, its own secret)
            last_sec = tl.load(secret_ptr + 16 * 8 + (j % 8)).to(tl.uint64, bitcast=True)
            sec = tl.where(last_row & (j >= 24), last_sec, sec)
        key = x ^ sec
        return (key & 0xFFFFFFFF).to(tl.uint32).to(tl.uint64) * (key >> 32).to(tl.uint32).to(tl.uint64), x

    @triton.jit
    def _wide_tile(anchor64_ptr, first, dst_first, secret_ptr, nrows, row, ROWS: tl.constexpr, COPY: tl.constexpr,
                   CACHE: tl.constexpr, LOADS_FIRST: tl.constexpr = True):
        """The wide read of ``row``'s rows of one leaf, which start at words ``first`` (and, with ``COPY``, their
        store to the rows at ``dst_first``): the rows' additions to the even and the odd accumulators, ``[ROWS,
        4]`` each. A row is 4 steps of 32 contiguous words (256 bytes), so a warp's load is one contiguous span and
        16-byte vectors, not 64-byte pieces 1 KiB apart. Each thread sums stripes ``g, g + 4, g + 8, g + 12`` of its
        lanes across the 4 steps; the 4 partial sums of a lane are added across threads once per tile.
        ``LOADS_FIRST``: the 4 steps' loads are issued before the first store. The source and the destination are
        both addressed from one anchor, so the compiler cannot tell a store from a later load's address and keeps
        their order: stored step by step, each step's load would wait for the one before it to land."""
        j = tl.arange(0, 32)[None, :].to(tl.int64)
        live = row < nrows
        last_row = row == nrows - 1
        src = anchor64_ptr + first + j
        dst = anchor64_ptr + dst_first + j
        r0 = _wide_load(src, live, CACHE)
        if COPY and not LOADS_FIRST:
            _wide_store(dst, r0, live, CACHE)
        r1 = _wide_load(src + 32, live, CACHE)
        if COPY and not LOADS_FIRST:
            _wide_store(dst + 32, r1, live, CACHE)
        r2 = _wide_load(src + 64, live, CACHE)
        if COPY and not LOADS_FIRST:
            _wide_store(dst + 64, r2, live, CACHE)
        r3 = _wide_load(src + 96, live, CACHE)
        if COPY:
            if LOADS_FIRST:
                _wide_store(dst, r0, live, CACHE)
                _wide_store(dst + 32, r1, live, CACHE)
                _wide_store(dst + 64, r2, live, CACHE)
            _wide_store(dst + 96, r3, live, CACHE)
        return _wide_sums(r0, r1, r2, r3, secret_ptr, j, last_row, ROWS)

    @triton.jit
    def _wide_sums(r0, r1, r2, r3, secret_ptr, j, last_row, ROWS: tl.constexpr):
        """The additions of a wide tile's rows from their 4 steps' words: to the even and the odd accumulators,
        ``[ROWS, 4]`` each."""
        m0, x0 = _wide_step(r0, 0, secret_ptr, j, last_row)
        m1, x1 = _wide_step(r1, 1, secret_ptr, j, last_row)
        m2, x2 = _wide_step(r2, 2, secret_ptr, j, last_row)
        m3, x3 = _wide_step(r3, 3, secret_ptr, j, last_row)
        m8 = tl.sum(tl.reshape(m0 + m1 + m2 + m3, [ROWS, 4, 8]), axis=1)
        a8 = tl.sum(tl.reshape(x0 + x1 + x2 + x3, [ROWS, 4, 8]), axis=1)
        m_even, m_odd = tl.split(tl.reshape(m8, [ROWS, 4, 2]))
        x_even, x_odd = tl.split(tl.reshape(a8, [ROWS, 4, 2]))
        # acc[i ^ 1] += x[i]: lane 2i takes the odd words, lane 2i + 1 the even ones
        return m_even + x_odd, m_odd + x_even

    @triton.jit
    def _store_adds(adds_ptr, leaf, nrows, row, even, odd):
        out = adds_ptr + (leaf * nrows + row) * 8 + tl.arange(0, 4)[None, :] * 2
        tl.store(out, even.to(tl.int64, bitcast=True), mask=row < nrows)
        tl.store(out + 1, odd.to(tl.int64, bitcast=True), mask=row < nrows)

    @triton.jit
    def _xxh3_rows_wide_kernel(
        anchor64_ptr, bases_ptr, ids_ptr, dst_bases_ptr, dst_ids_ptr, secret_ptr, adds_ptr,
        seg, pieces, stride, lo, nrows, regions,
        ROWS: tl.constexpr,  # rows per program
        ALIGN: tl.constexpr,  # words per guaranteed alignment of a row's start (2: 16-byte loads)
        COPY: tl.constexpr = False,  # also store every word read to the destination blocks (fused copy)
        CACHE: tl.constexpr = 1,  # 1: .cg loads, .cs stores (streaming, as the block copy); 0: default caching
        LOADS_FIRST: tl.constexpr = True,  # every step's load before the first store (:func:`_wide_tile`)
    ):
        """MODE 0 of :func:`_xxh3_rows_kernel` (rows whole in one segment, ``total % 1024 == 0``) read the way a
        copy reads (:func:`_wide_tile`)."""
        leaf, unit, region, row = _leaf_of(regions, ROWS)
        first, dst_first = _unit_row_words(ids_ptr, dst_ids_ptr, bases_ptr, dst_bases_ptr, unit, region, seg, pieces,
                                           stride, lo, row, nrows, ALIGN, COPY)
        even, odd = _wide_tile(anchor64_ptr, first, dst_first, secret_ptr, nrows, row, ROWS, COPY, CACHE,
                               LOADS_FIRST)
        _store_adds(adds_ptr, leaf, nrows, row, even, odd)

    @triton.jit
    def _scramble(acc, key):
        acc = acc ^ (acc >> 47)
        acc = acc ^ key
        return acc * 0x9E3779B1

    @triton.jit
    def _mul128_fold64_tl(a, b):
        lo_lo = (a & 0xFFFFFFFF) * (b & 0xFFFFFFFF)
        hi_lo = (a >> 32) * (b & 0xFFFFFFFF)
        lo_hi = (a & 0xFFFFFFFF) * (b >> 32)
        hi_hi = (a >> 32) * (b >> 32)
        cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFF) + lo_hi
        upper = (hi_lo >> 32) + (cross >> 32) + hi_hi
        lower = (cross << 32) | (lo_lo & 0xFFFFFFFF)
        return lower ^ upper

    @triton.jit
    def _load8(base, n, last):
        """Rows ``n .. n + 7`` of each unit's additions, clamped to row ``last`` (a prefetch past the end re-reads
        a real row, never used)."""
        return (tl.load(base + tl.minimum(n, last) * 8), tl.load(base + tl.minimum(n + 1, last) * 8),
                tl.load(base + tl.minimum(n + 2, last) * 8), tl.load(base + tl.minimum(n + 3, last) * 8),
                tl.load(base + tl.minimum(n + 4, last) * 8), tl.load(base + tl.minimum(n + 5, last) * 8),
                tl.load(base + tl.minimum(n + 6, last) * 8), tl.load(base + tl.minimum(n + 7, last) * 8))

    @triton.jit
    def _steps8(acc, key, r0, r1, r2, r3, r4, r5, r6, r7):
        acc = _scramble(acc + r0.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r1.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r2.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r3.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r4.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r5.to(tl.uint64, bitcast=True), key)
        acc = _scramble(acc + r6.to(tl.uint64, bitcast=True), key)
        return _scramble(acc + r7.to(tl.uint64, bitcast=True), key)

    @triton.jit
    def _xxh3_chain_kernel(adds_ptr, secret_ptr, out_ptr, units, nrows, total, UNITS: tl.constexpr):
        """Per unit: the accumulators through every whole row's additions and scramble, the last row's additions,
        then XXH3's merge and avalanche. The chain is the one sequential part of XXH3, so its loads run one to two
        chunks of 8 rows ahead of it (loop-carried registers): a step waits on arithmetic, not on memory."""
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        lane = tl.arange(0, 8)[None, :]
        base = adds_ptr + tl.minimum(u, units - 1)[:, None] * nrows * 8 + lane
        acc = tl.zeros([UNITS, 8], tl.uint64) + tl.load(secret_ptr + 19 * 8 + lane).to(tl.uint64, bitcast=True)
        key = tl.load(secret_ptr + 17 * 8 + lane).to(tl.uint64, bitcast=True)
        whole = nrows - 1
        chunks = whole // 8
        zero = tl.program_id(0) * 0
        c0, c1, c2, c3, c4, c5, c6, c7 = _load8(base, zero, whole)
        n0, n1, n2, n3, n4, n5, n6, n7 = _load8(base, zero + 8, whole)
        for k in range(chunks):
            f0, f1, f2, f3, f4, f5, f6, f7 = _load8(base, k * 8 + 16, whole)
            acc = _steps8(acc, key, c0, c1, c2, c3, c4, c5, c6, c7)
            c0, c1, c2, c3, c4, c5, c6, c7 = n0, n1, n2, n3, n4, n5, n6, n7
            n0, n1, n2, n3, n4, n5, n6, n7 = f0, f1, f2, f3, f4, f5, f6, f7
        for n in range(chunks * 8, whole):
            acc = _scramble(acc + tl.load(base + n * 8).to(tl.uint64, bitcast=True), key)
        acc += tl.load(base + whole * 8).to(tl.uint64, bitcast=True)
        h = _xxh3_finish(acc, secret_ptr, lane, total, UNITS)
        tl.store(out_ptr + u, h.to(tl.int64, bitcast=True), mask=u < units)


    @triton.jit
    def _xxh3_chain_deep_kernel(adds_ptr, secret_ptr, out_ptr, units, nrows, total, UNITS: tl.constexpr):
        """:func:`_xxh3_chain_kernel` with its loads 24 steps ahead: four groups of 8 rows, each group's registers
        reloaded right after the group is consumed. Nothing is rotated between registers (a rotation's moves wait
        on the loads they move, so the older kernel waited on each chunk's loads within the iteration that issued
        them); a load is waited for only where its row is added, three groups later."""
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        lane = tl.arange(0, 8)[None, :]
        base = adds_ptr + tl.minimum(u, units - 1)[:, None] * nrows * 8 + lane
        acc = tl.zeros([UNITS, 8], tl.uint64) + tl.load(secret_ptr + 19 * 8 + lane).to(tl.uint64, bitcast=True)
        key = tl.load(secret_ptr + 17 * 8 + lane).to(tl.uint64, bitcast=True)
        whole = nrows - 1
        chunks = whole // 32
        zero = tl.program_id(0) * 0
        a0, a1, a2, a3, a4, a5, a6, a7 = _load8(base, zero, whole)
        b0, b1, b2, b3, b4, b5, b6, b7 = _load8(base, zero + 8, whole)
        c0, c1, c2, c3, c4, c5, c6, c7 = _load8(base, zero + 16, whole)
        d0, d1, d2, d3, d4, d5, d6, d7 = _load8(base, zero + 24, whole)
        for k in range(chunks):
            acc = _steps8(acc, key, a0, a1, a2, a3, a4, a5, a6, a7)
            a0, a1, a2, a3, a4, a5, a6, a7 = _load8(base, k * 32 + 32, whole)
            acc = _steps8(acc, key, b0, b1, b2, b3, b4, b5, b6, b7)
            b0, b1, b2, b3, b4, b5, b6, b7 = _load8(base, k * 32 + 40, whole)
            acc = _steps8(acc, key, c0, c1, c2, c3, c4, c5, c6, c7)
            c0, c1, c2, c3, c4, c5, c6, c7 = _load8(base, k * 32 + 48, whole)
            acc = _steps8(acc, key, d0, d1, d2, d3, d4, d5, d6, d7)
            d0, d1, d2, d3, d4, d5, d6, d7 = _load8(base, k * 32 + 56, whole)
        for n in range(chunks * 32, whole):
            acc = _scramble(acc + tl.load(base + n * 8).to(tl.uint64, bitcast=True), key)
        acc += tl.load(base + whole * 8).to(tl.uint64, bitcast=True)
        h = _xxh3_finish(acc, secret_ptr, lane, total, UNITS)
        tl.store(out_ptr + u, h.to(tl.int64, bitcast=True), mask=u < units)


    @triton.jit
    def _xxh3_chain_short_kernel(adds_ptr, secret_ptr, out_ptr, units, total, NROWS: tl.constexpr,
                                 UNITS: tl.constexpr):
        """:func:`_xxh3_chain_kernel` for leaves of at most 64 rows (a region's slice of a block: 32 rows for 32
        KiB), the rows unrolled: no load waits on the chain, so all of them are in flight before its first step."""
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        lane = tl.arange(0, 8)[None, :]
        base = adds_ptr + tl.minimum(u, units - 1)[:, None] * NROWS * 8 + lane
        h = _chain_unrolled(base, secret_ptr, lane, total, UNITS, NROWS)
        tl.store(out_ptr + u, h.to(tl.int64, bitcast=True), mask=u < units)

    @triton.jit
    def _chain_unrolled(base, secret_ptr, lane, total, N: tl.constexpr, NROWS: tl.constexpr,
                        L2: tl.constexpr = False):
        """XXH3's digests of ``N`` leaves of ``NROWS`` rows whose additions are at ``base`` (``[N, 8]`` pointers,
        a row 8 words on): the chain with its rows unrolled, so no load waits on it, then the merge. ``L2``: the
        additions are read from L2 (other programs of the launch wrote some)."""
        acc = tl.zeros([N, 8], tl.uint64) + tl.load(secret_ptr + 19 * 8 + lane).to(tl.uint64, bitcast=True)
        key = tl.load(secret_ptr + 17 * 8 + lane).to(tl.uint64, bitcast=True)
        for n in tl.static_range(NROWS - 1):
            acc = _scramble(acc + _word(base + n * 8, L2), key)
        acc += _word(base + (NROWS - 1) * 8, L2)
        return _xxh3_finish(acc, secret_ptr, lane, total, N)

    @triton.jit
    def _xxh3_finish(acc, secret_ptr, lane, total, N: tl.constexpr):
        """XXH3's merge of the 8 accumulators of ``N`` leaves of ``total`` bytes, and its avalanche."""
        merge = tl.load(secret_ptr + 18 * 8 + lane).to(tl.uint64, bitcast=True)
        acc_even, acc_odd = tl.split(tl.reshape(acc ^ merge, [N, 4, 2]))
        h = tl.sum(_mul128_fold64_tl(acc_even, acc_odd), axis=1)
        h = h + total.to(tl.uint64) * 0x9E3779B185EBCA87
        h = h ^ (h >> 37)
        h = h * 0x165667919E3779F9
        return h ^ (h >> 32)

    @triton.jit
    def _rotl(x, r: tl.constexpr):
        return (x << r) | (x >> (64 - r))

    @triton.jit
    def _xxh64_round(acc, word, p1, p2):
        return _rotl(acc + word * p2, 31) * p1

    @triton.jit
    def _word(ptr, L2: tl.constexpr):
        if L2:  # from L2, past this SM's L1: words other SMs wrote in this launch
            return tl.load(ptr, cache_modifier=".cg").to(tl.uint64, bitcast=True)
        return tl.load(ptr).to(tl.uint64, bitcast=True)

    @triton.jit
    def _xxh64_words(base, zero, primes_ptr, REGIONS: tl.constexpr, L2: tl.constexpr = False):
        """XXH64 (seed 0) over the ``REGIONS`` u64 words at ``base`` (a pointer per unit, or one), unrolled so every
        load is issued before the first round: 32-byte stripes of 4 words into 4 accumulators, the words left one at
        a time, then the avalanche. ``primes_ptr``: :data:`XXH64_TABLE`; ``zero``: a u64 zero of the result's shape;
        ``L2``: the words are read from L2 (written by other programs of the same launch)."""
        p1 = tl.load(primes_ptr + 0).to(tl.uint64, bitcast=True)
        p2 = tl.load(primes_ptr + 1).to(tl.uint64, bitcast=True)
        p3 = tl.load(primes_ptr + 2).to(tl.uint64, bitcast=True)
        p4 = tl.load(primes_ptr + 3).to(tl.uint64, bitcast=True)
        if REGIONS >= 4:
            v1 = zero + tl.load(primes_ptr + 5).to(tl.uint64, bitcast=True)  # p1 + p2, as u64
            v2 = zero + p2
            v3 = zero
            v4 = zero + tl.load(primes_ptr + 6).to(tl.uint64, bitcast=True)  # 0 - p1, as u64
            for s in tl.static_range(REGIONS // 4):
                v1 = _xxh64_round(v1, _word(base + 4 * s, L2), p1, p2)
                v2 = _xxh64_round(v2, _word(base + 4 * s + 1, L2), p1, p2)
                v3 = _xxh64_round(v3, _word(base + 4 * s + 2, L2), p1, p2)
                v4 = _xxh64_round(v4, _word(base + 4 * s + 3, L2), p1, p2)
            h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
            h = (h ^ _xxh64_round(zero, v1, p1, p2)) * p1 + p4
            h = (h ^ _xxh64_round(zero, v2, p1, p2)) * p1 + p4
            h = (h ^ _xxh64_round(zero, v3, p1, p2)) * p1 + p4
            h = (h ^ _xxh64_round(zero, v4, p1, p2)) * p1 + p4
        else:  # under 32 bytes XXH64 starts from its fifth prime
            h = zero + tl.load(primes_ptr + 4).to(tl.uint64, bitcast=True)
        h = h + REGIONS * 8
        for w in tl.static_range(REGIONS // 4 * 4, REGIONS):
            h = h ^ _xxh64_round(zero, _word(base + w, L2), p1, p2)
            h = _rotl(h, 27) * p1 + p4
        h = h ^ (h >> 33)
        h = h * p2
        h = h ^ (h >> 29)
        h = h * p3
        return h ^ (h >> 32)

    @triton.jit
    def _xxh64_root_kernel(leaves_ptr, primes_ptr, out_ptr, units, REGIONS: tl.constexpr, UNITS: tl.constexpr):
        """Per unit, a thread each: XXH64 over its ``REGIONS`` leaf digests (the root of the digest,
        :func:`kvlifecycle.digest.root_digest`), after a chain kernel wrote the leaves."""
        u = tl.program_id(0).to(tl.int64) * UNITS + tl.arange(0, UNITS)
        base = leaves_ptr + tl.minimum(u, units - 1) * REGIONS
        h = _xxh64_words(base, tl.zeros([UNITS], tl.uint64), primes_ptr, REGIONS)
        tl.store(out_ptr + u, h.to(tl.int64, bitcast=True), mask=u < units)

    @triton.jit
    def _xxh3_leaves_root_kernel(adds_ptr, secret_ptr, primes_ptr, leaves_ptr, out_ptr, total, NROWS: tl.constexpr,
                                 REGIONS: tl.constexpr, RP2: tl.constexpr):
        """One unit per program, the chain and the root in one launch: every leaf's chain at once (a ``[RP2, 8]``
        tile, the rows unrolled as in :func:`_xxh3_chain_short_kernel`), the leaves stored, a barrier (the CTA's
        global writes are visible to its threads after it), then XXH64 over them."""
        u = tl.program_id(0).to(tl.int64)
        leaf = tl.arange(0, RP2)
        lane = tl.arange(0, 8)[None, :]
        base = adds_ptr + (u * REGIONS + tl.minimum(leaf, REGIONS - 1))[:, None] * NROWS * 8 + lane
        h = _chain_unrolled(base, secret_ptr, lane, total, RP2, NROWS)
        tl.store(leaves_ptr + u * REGIONS + leaf, h.to(tl.int64, bitcast=True), mask=leaf < REGIONS)
        tl.debug_barrier()
        root = _xxh64_words(leaves_ptr + u * REGIONS, tl.zeros([1], tl.uint64), primes_ptr, REGIONS)
        tl.store(out_ptr + u + tl.arange(0, 1), root.to(tl.int64, bitcast=True))

    @triton.jit
    def _part_of(SPLIT: tl.constexpr, REGIONS: tl.constexpr, ROWS: tl.constexpr):
        """A one-launch program's leaf (``SPLIT`` programs each, in order), the leaf's unit and region, and its
        rows."""
        program = tl.program_id(0).to(tl.int64)
        leaf = program // SPLIT
        unit = leaf // REGIONS
        row = ((program - leaf * SPLIT) * ROWS + tl.arange(0, ROWS))[:, None]
        return leaf, unit, leaf - unit * REGIONS, row

    @triton.jit
    def _one_launch_leaf(anchor64_ptr, first, dst_first, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr,
                         out_ptr, total, units, leaf, unit, row, ROWS: tl.constexpr, NROWS: tl.constexpr,
                         REGIONS: tl.constexpr, SPLIT: tl.constexpr, COPY: tl.constexpr, CACHE: tl.constexpr,
                         LOADS_FIRST: tl.constexpr):
        """One program of the one-launch kernels: the wide read of its rows of ``leaf`` (:func:`_wide_tile`, with the
        fused copy's stores), then the leaf's chain if it is the leaf's last part to finish, then the unit's root if
        that leaf is the unit's last. A part counts itself in after a barrier (its additions stored before the count,
        which is acquire-release at GPU scope); the one that completes the count reads what the others wrote from
        L2, and sets the count back to zero for the next launch on the stream."""
        even, odd = _wide_tile(anchor64_ptr, first, dst_first, secret_ptr, NROWS, row, ROWS, COPY, CACHE, LOADS_FIRST)
        _store_adds(adds_ptr, leaf, NROWS, row, even, odd)
        tl.debug_barrier()
        chain = True
        if SPLIT > 1:
            chain = tl.atomic_add(arrived_ptr + units + leaf, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if chain:
            lane = tl.arange(0, 8)[None, :]
            h = _chain_unrolled(adds_ptr + leaf * NROWS * 8 + lane, secret_ptr, lane, total, 1, NROWS, SPLIT > 1)
            tl.store(leaves_ptr + leaf + tl.arange(0, 1), h.to(tl.int64, bitcast=True))
            if SPLIT > 1:
                tl.store(arrived_ptr + units + leaf, 0)
            tl.debug_barrier()
            _root_if_last(leaves_ptr, arrived_ptr, out_ptr, primes_ptr, unit, REGIONS)

    @triton.jit
    def _root_if_last(leaves_ptr, arrived_ptr, out_ptr, primes_ptr, unit, REGIONS: tl.constexpr):
        """A leaf's digest stored (and a barrier passed): count it in to ``unit``, and if it completes the count,
        the unit's root over its leaves (from L2: other programs wrote them), and the count set back to zero."""
        if tl.atomic_add(arrived_ptr + unit, 1, sem="acq_rel", scope="gpu") == REGIONS - 1:
            root = _xxh64_words(leaves_ptr + unit * REGIONS, tl.zeros([1], tl.uint64), primes_ptr, REGIONS, True)
            tl.store(out_ptr + unit + tl.arange(0, 1), root.to(tl.int64, bitcast=True))
            tl.store(arrived_ptr + unit, 0)

    @triton.jit
    def _xxh3_one_launch_kernel(
        anchor64_ptr, bases_ptr, ids_ptr, dst_bases_ptr, dst_ids_ptr, secret_ptr, primes_ptr,
        adds_ptr,  # int64[U × R, NROWS, 8]: scratch, each leaf's row additions
        leaves_ptr,  # int64[U × R]: scratch, the leaf digests
        arrived_ptr,  # int32[U + U × R]: zero on entry, and left zero: the units' leaves done, the leaves' parts done
        out_ptr,  # int64[U]: the digests
        seg, pieces, stride, lo, total, units,
        ROWS: tl.constexpr,  # rows per program: NROWS / SPLIT to a power of two
        NROWS: tl.constexpr,
        REGIONS: tl.constexpr,
        SPLIT: tl.constexpr,  # programs per leaf
        ALIGN: tl.constexpr,
        COPY: tl.constexpr,
        CACHE: tl.constexpr,
        LOADS_FIRST: tl.constexpr = True,
    ):
        """The whole digest in one launch, ``SPLIT`` programs per leaf of at most 64 rows (:func:`_one_launch_leaf`),
        the units' block ids read from ``ids_ptr`` (and ``dst_ids_ptr``). No second launch waits for the last row
        pass."""
        leaf, unit, region, row = _part_of(SPLIT, REGIONS, ROWS)
        first, dst_first = _unit_row_words(ids_ptr, dst_ids_ptr, bases_ptr, dst_bases_ptr, unit, region, seg, pieces,
                                           stride, lo, row, NROWS, ALIGN, COPY)
        _one_launch_leaf(anchor64_ptr, first, dst_first, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr,
                         out_ptr, total, units, leaf, unit, row, ROWS, NROWS, REGIONS, SPLIT, COPY, CACHE, LOADS_FIRST)

    # The same with the block ids of up to INLINE_IDS one-block units as launch parameters (s_i -> d_i), as the block
    # copy takes a small request's: no id upload ahead of the kernel, which for the 16-block request is a driver
    # call and a DMA worth a tenth of the copy. Never specialised on the ids' values (one compiled kernel whatever
    # they are).
    @triton.jit(do_not_specialize=[f"{side}{i}" for side in "sd" for i in range(INLINE_IDS)])
    def _xxh3_one_launch_inline_kernel(
        anchor64_ptr, bases_ptr, dst_bases_ptr, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr, out_ptr,
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,
        stride, lo, total, units,
        ROWS: tl.constexpr, NROWS: tl.constexpr, REGIONS: tl.constexpr, SPLIT: tl.constexpr, ALIGN: tl.constexpr,
        COPY: tl.constexpr, CACHE: tl.constexpr, LOADS_FIRST: tl.constexpr = True,
    ):
        leaf, unit, region, row = _part_of(SPLIT, REGIONS, ROWS)
        block = _pick16(unit, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15).to(tl.int64)
        first = _block_row_words(block, tl.load(bases_ptr + region), stride, lo, row, NROWS, ALIGN)
        dst_first = first
        if COPY:
            dst_block = _pick16(unit, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14,
                                d15).to(tl.int64)
            dst_first = _block_row_words(dst_block, tl.load(dst_bases_ptr + region), stride, lo, row, NROWS, ALIGN)
        _one_launch_leaf(anchor64_ptr, first, dst_first, secret_ptr, primes_ptr, adds_ptr, leaves_ptr, arrived_ptr,
                         out_ptr, total, units, leaf, unit, row, ROWS, NROWS, REGIONS, SPLIT, COPY, CACHE, LOADS_FIRST)


@functools.lru_cache(maxsize=64)
def _alignment(words: tuple[int, ...]) -> int:
    """16, 8 or 1: the bytes every address and offset of a launch is a multiple of (one request's launch checks the
    same regions' 130-odd words again: cached)."""
    return 16 if all(v % 16 == 0 for v in words) else 8 if all(v % 8 == 0 for v in words) else 1


@dataclass(frozen=True, slots=True)
class _Group:
    kind: MemoryKind
    first: int  # the group's first block id in the layout's one id space
    blocks: int
    bases: tuple[int, ...]
    block_bytes: tuple[int, ...]


class GpuDigester:
    """Digests the blocks of ``layout`` (KV in VRAM, on ``layout.device_id``) where they lie.

    ``rows_per_program``/``num_warps``: the older row kernel's tile (32 rows, 32 KiB a program: on an H100 over 512
    MiB, 32 rows gave 1,060 GB/s, 64 rows 784, 128 rows 884); ``wide``/``wide_rows``/``wide_warps``: the wide row
    kernel for rows whole in one slice, and its tile (16 rows / 4 warps: 2,000 GB/s on an H100 over 512 MiB, 4 rows
    1,913, 32 rows / 8 warps 1,995; figures of the flat digest, whose rows the same kernels read); ``chain_units``:
    leaves per program of the chain kernels (8 lanes each); ``deep_chain``: leaves past 64 rows take the chain with
    its loads 24 steps ahead (False: the older chain); ``wide_cache``: the wide kernel's cache hints (1: streaming
    loads and stores, as the block copy's; 0: none); ``one_launch``: leaves of whole KiB rows, at most 64 of them,
    take the one-launch kernel (``leaf_split`` programs per leaf of ``leaf_warps`` warps each; False: the row
    pass, then the chains and the roots in a second launch). On an H100 the fused copy at 1 program of 2 / 4 / 8
    warps ran 0.921 / 0.921 / 0.899 × the unverified copy over 512 MiB and 0.741 / 0.763 / 0.678 × for 16 blocks;
    2 programs of 4 warps 0.912 / 0.736 (docs/benchmarks/2026-12-06-gpu-one-launch-h100.md). ``inline_ids``:
    up to 16 one-block units whose ids the caller holds on the host pass them to the one-launch kernel as launch
    parameters, as the block copy does (False: uploaded through pinned memory, 2.4 µs of the 16-block request's
    37.1 on that H100). ``loads_first``: the wide kernels issue a tile's loads before its stores (False: step by
    step, as before)."""

    def __init__(self, layout: KVLayout, *, rows_per_program: int = 32, num_warps: int = 4,
                 chain_units: int = 4, wide: bool = True, wide_rows: int = 16, wide_warps: int = 4,
                 deep_chain: bool = True, wide_cache: int = 1, one_launch: bool = True,
                 leaf_warps: int = 4, leaf_split: int = 1, inline_ids: bool = True,
                 loads_first: bool = True) -> None:
        if layout.kind is not MemoryKind.VRAM:
            raise ValueError(f"GPU digests need a VRAM layout, got {layout.kind}: use HostDigester")
        import torch

        # Triton's interpreter runs the kernels on the CPU over host memory (how CI checks them without a GPU)
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
        if not HAVE_TRITON or not (interpreted or torch.cuda.is_available()):
            raise ValueError("GPU digests need Triton and a CUDA device")
        self._torch = torch
        self.device = torch.device("cpu") if interpreted else torch.device("cuda", layout.device_id)
        self._groups: list[_Group] = []
        first = region = 0
        for group, kind in zip(layout.region_groups, layout.group_kinds, strict=True):
            sl = slice(region, region + group.regions)
            self._groups.append(_Group(kind, first, group.num_blocks, layout.base_addrs[sl], layout.block_bytes[sl]))
            first, region = first + group.num_blocks, region + group.regions
        self._starts = np.array([g.first for g in self._groups] + [first], dtype=np.int64)
        self._anchor = torch.empty(64, dtype=torch.uint8, device=self.device)
        self._anchor64 = self._anchor.view(torch.int64)
        self._secret = torch.from_numpy(SECRET_TABLE.view(np.int64).copy()).to(self.device)
        self._primes = torch.from_numpy(XXH64_TABLE.view(np.int64).copy()).to(self.device)
        self._rows, self._warps = rows_per_program, num_warps
        self._wide, self._wide_rows, self._wide_warps = wide, wide_rows, wide_warps
        self._chain_units, self._deep_chain, self._wide_cache = chain_units, deep_chain, wide_cache
        self._one_launch, self._leaf_warps, self._leaf_split = one_launch, leaf_warps, leaf_split
        self._inline_ids, self._loads_first = inline_ids, loads_first
        self._arrived: dict[int, torch.Tensor] = {}  # per stream: the one-launch kernel's counts, left zero
        self._host: dict[int, list[np.ndarray]] = {}
        self._region_offsets: dict[tuple[int, ...], torch.Tensor] = {}
        self._lock = threading.Lock()  # one launch sequence at a time (P's side-channel and D's service threads)

    def digests(self, units: np.ndarray, *, offset: int = 0, length: int = 0,
                only: Sequence[int] | None = None) -> np.ndarray:
        ids = np.asarray(units, dtype=np.int64)
        ids = ids.reshape(-1, 1) if ids.ndim == 1 else ids
        out = np.empty(ids.shape[0], dtype=DIGEST_DTYPE)
        if ids.shape[0] == 0:
            return out
        group_of = np.searchsorted(self._starts, ids[:, 0], side="right") - 1
        known = np.clip(group_of, 0, len(self._groups) - 1)
        inside = (ids >= self._starts[known][:, None]) & (ids < self._starts[known + 1][:, None])
        bad = np.flatnonzero((group_of != known) | ~inside.all(axis=1))
        if bad.size:
            raise DigestError(f"unit {ids[bad[0]].tolist()} is not within one region group of "
                              f"{int(self._starts[-1])} blocks")
        if only is not None and (group_of != 0).any():
            raise DigestError(f"unit {ids[np.flatnonzero(group_of)[0]].tolist()}: a region subset is of the first "
                              f"group's blocks only")
        for g in np.unique(group_of):
            rows = np.flatnonzero(group_of == g)
            group = self._groups[int(g)]
            local = ids[rows] - group.first
            picked = range(len(group.bases)) if only is None else list(only)
            if g == 0:
                out[rows] = self._group_digests(int(g), group, local, picked, offset, length)
            else:
                out[rows] = self._group_digests(int(g), group, local, picked, 0, 0)
        return out

    def _group_digests(self, g: int, group: _Group, local: np.ndarray, picked: Sequence[int], offset: int,
                       length: int) -> np.ndarray:
        bases = [group.bases[r] for r in picked]
        widths = [group.block_bytes[r] for r in picked]
        segs = [length or w - offset for w in widths]
        if offset < 0 or any(s <= 0 or offset + s > w for s, w in zip(segs, widths, strict=True)):
            raise DigestError(f"slice {offset}+{length} does not fit blocks of {sorted(set(widths))} bytes")
        if group.kind is not MemoryKind.VRAM:  # host rows of a mixed layout: read in place, as HostDigester does
            views = self._host.setdefault(g, [np.ctypeslib.as_array((ctypes.c_uint8 * (w * group.blocks))
                                                                    .from_address(b)).reshape(group.blocks, w)
                                              for b, w in zip(group.bases, group.block_bytes, strict=True)])
            return digest_units([[views[r] for r in picked]], local, offset=offset, length=length)
        leaf = local.shape[1] * segs[0]
        if not bases or len(set(widths)) != 1 or len(set(segs)) != 1 or leaf <= SHORT_MAX:
            return self._gathered(bases, widths, group.blocks, local, offset, segs)
        with self._lock, self._on_device():
            result: np.ndarray = self._launch(bases, widths[0], local, offset, segs[0]).cpu().numpy()
        return result.view(DIGEST_DTYPE)

    def enqueue(self, units: np.ndarray, *, offset: int = 0, length: int = 0) -> torch.Tensor:
        """The kernels' digests of ``units`` (blocks of a one-group layout whose regions share one block size, more
        than 240 bytes a region) as an int64 device tensor, launched on the current stream and not waited for: for a
        caller that overlaps the pass with other work (and for timing the device pass alone)."""
        ids, width, seg = self._one_group(units, offset, length)
        with self._lock, self._on_device():
            return self._launch(list(self._groups[0].bases), width, ids, offset, seg)

    def copy_and_digest(self, units: np.ndarray, dst_bases: Sequence[int], dst_units: np.ndarray, *,
                        device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Copy whole blocks ``units`` of every region to blocks ``dst_units`` of the regions at ``dst_bases`` (the
        same block bytes, on this device or mapped into it) and digest the words as they are moved: one pass over
        the bytes, the digests (int64, on the device, not waited for) those of what was written. For units of whole
        1024-byte multiples; a fused check for a copy path that is ours (CUDA IPC). ``device_ids``: the same two id
        arrays already on this device as int64 (a caller that keeps them there: no upload); checked here on the
        host copies."""
        ids, width, seg = self._one_group(units, 0, 0)
        dst = np.asarray(dst_units, dtype=np.int64).reshape(ids.shape)
        if seg % ROW_BYTES or len(dst_bases) != len(self._groups[0].bases):
            raise DigestError(f"a fused copy takes blocks of whole 1024-byte rows in every region, got {seg} bytes")
        if device_ids is not None:
            if any(t.numel() != ids.size or t.dtype != self._torch.int64 or t.device != self.device
                   for t in device_ids):
                raise DigestError(f"device ids: {ids.size} int64 on {self.device} each expected")
            device_ids = (device_ids[0].reshape(ids.shape), device_ids[1].reshape(ids.shape))
        with self._lock, self._on_device():
            return self._launch(list(self._groups[0].bases), width, ids, 0, seg, list(dst_bases), dst, device_ids)

    def _one_group(self, units: np.ndarray, offset: int, length: int) -> tuple[np.ndarray, int, int]:
        group = self._groups[0]
        ids = np.asarray(units, dtype=np.int64)
        ids = ids.reshape(-1, 1) if ids.ndim == 1 else ids
        width = group.block_bytes[0]
        seg = length or width - offset
        if len(self._groups) != 1 or len(set(group.block_bytes)) != 1 or ids.shape[1] * seg <= SHORT_MAX or \
                not 0 <= offset < offset + seg <= width or ids.min(initial=0) < 0 or \
                ids.max(initial=0) >= group.blocks:
            raise DigestError(f"the kernels' direct calls take one group of equal blocks and units within it of "
                              f"over {SHORT_MAX} bytes a region")
        return ids, width, seg

    def _launch(self, bases: list[int], stride: int, local: np.ndarray, lo: int, seg: int,
                dst_bases: list[int] | None = None, dst_local: np.ndarray | None = None,
                device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The row pass over every leaf's rows (every (unit, region) at once; with ``dst_*``, the fused copy), then
        each unit's chains and root in one launch (leaves past 64 rows or units past 256 regions: the chains, then
        the roots)."""
        torch = self._torch
        anchor = self._anchor.data_ptr()
        aligned_to = _alignment((anchor, stride, lo, seg, *bases, *(dst_bases or ())))
        mode = (0 if seg % ROW_BYTES == 0 else 1) if aligned_to >= 8 else 2
        align = 2 if aligned_to >= 16 else 1
        copy = dst_bases is not None and dst_local is not None
        if copy and mode != 0:
            raise DigestError("a fused copy needs 8-byte aligned regions of whole 1024-byte rows")
        n, pieces, regions = local.shape[0], local.shape[1], len(bases)
        leaf_bytes = pieces * seg
        nrows, last_stripes = row_shape(leaf_bytes)
        bases_t = self._offsets(bases)
        dst_t = self._offsets(dst_bases) if dst_bases is not None else bases_t
        leaves = n * regions
        adds = torch.empty((leaves, nrows, 8), dtype=torch.int64, device=self.device)
        leaf_digests = torch.empty(leaves, dtype=torch.int64, device=self.device)
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        one_launch = mode == 0 and self._wide and self._one_launch and nrows <= SHORT_CHAIN_ROWS and \
            regions <= MERGED_ROOT_REGIONS
        split = min(self._leaf_split, nrows)
        shape = {"ROWS": triton.next_power_of_2(triton.cdiv(nrows, split)), "NROWS": nrows, "REGIONS": regions,
                 "SPLIT": split, "ALIGN": align, "COPY": copy, "CACHE": self._wide_cache,
                 "LOADS_FIRST": self._loads_first, "num_warps": self._leaf_warps}
        if one_launch and self._inline_ids and device_ids is None and pieces == 1 and n <= INLINE_IDS:
            src_ids = [int(b) for b in local[:, 0]] + [0] * (INLINE_IDS - n)
            dst_ids = [int(b) for b in np.asarray(dst_local).reshape(-1)] + [0] * (INLINE_IDS - n) if copy \
                else src_ids
            _xxh3_one_launch_inline_kernel[(leaves * split,)](
                self._anchor64, bases_t, dst_t, self._secret, self._primes, adds, leaf_digests,
                self._arrived_counts(n + leaves), out, *src_ids, *dst_ids, stride, lo, leaf_bytes, n, **shape)
            return out
        if device_ids is not None:
            ids_t, dst_ids_t = device_ids
        elif dst_local is not None:  # both id sets in one copy
            pair = self._upload(np.stack([local, np.asarray(dst_local, dtype=np.int64).reshape(local.shape)]))
            ids_t, dst_ids_t = pair[0], pair[1]
        else:
            ids_t = dst_ids_t = self._upload(local)
        if one_launch:
            _xxh3_one_launch_kernel[(leaves * split,)](
                self._anchor64, bases_t, ids_t, dst_t, dst_ids_t, self._secret, self._primes, adds, leaf_digests,
                self._arrived_counts(n + leaves), out, seg, pieces, stride, lo, leaf_bytes, n, **shape)
            return out
        if mode == 0 and self._wide:
            _xxh3_rows_wide_kernel[(leaves, triton.cdiv(nrows, self._wide_rows))](
                self._anchor64, bases_t, ids_t, dst_t, dst_ids_t, self._secret, adds, seg, pieces, stride, lo, nrows,
                regions, ROWS=self._wide_rows, ALIGN=align, COPY=copy, CACHE=self._wide_cache,
                LOADS_FIRST=self._loads_first, num_warps=self._wide_warps)
        else:
            _xxh3_rows_kernel[(leaves, triton.cdiv(nrows, self._rows))](
                self._anchor64, self._anchor, bases_t, ids_t, dst_t, dst_ids_t, self._secret, adds, seg, pieces,
                stride, lo, leaf_bytes, nrows, last_stripes, regions, ROWS=self._rows, MODE=mode, ALIGN=align,
                COPY=copy, num_warps=self._warps)
        if nrows <= SHORT_CHAIN_ROWS and regions <= MERGED_ROOT_REGIONS:
            rp2 = triton.next_power_of_2(regions)
            _xxh3_leaves_root_kernel[(n,)](adds, self._secret, self._primes, leaf_digests, out, leaf_bytes,
                                           NROWS=nrows, REGIONS=regions, RP2=rp2,
                                           num_warps=min(16, max(1, rp2 // 4)))  # a (leaf, lane) a thread
            return out
        grid = (triton.cdiv(leaves, self._chain_units),)
        if nrows <= SHORT_CHAIN_ROWS:
            _xxh3_chain_short_kernel[grid](adds, self._secret, leaf_digests, leaves, leaf_bytes, NROWS=nrows,
                                           UNITS=self._chain_units, num_warps=1)
        else:
            chain = _xxh3_chain_deep_kernel if self._deep_chain else _xxh3_chain_kernel
            chain[grid](adds, self._secret, leaf_digests, leaves, nrows, leaf_bytes, UNITS=self._chain_units,
                        num_warps=1)
        _xxh64_root_kernel[(triton.cdiv(n, ROOT_UNITS),)](leaf_digests, self._primes, out, n, REGIONS=regions,
                                                          UNITS=ROOT_UNITS, num_warps=1)
        return out

    def _arrived_counts(self, units: int) -> torch.Tensor:
        """The one-launch kernel's per-unit counts for the current stream: zeroed once, left zero by every launch
        (launches on one stream run in order; another stream has its own)."""
        torch = self._torch
        stream = 0 if self.device.type == "cpu" else torch.cuda.current_stream(self.device).cuda_stream
        counts = self._arrived.get(stream)
        if counts is None or counts.numel() < units:
            counts = torch.zeros(max(units, 1024), dtype=torch.int32, device=self.device)
            self._arrived[stream] = counts
        return counts

    def _on_device(self) -> AbstractContextManager[object]:
        return contextlib.nullcontext() if self.device.type == "cpu" else self._torch.cuda.device(self.device)

    def _offsets(self, bases: Sequence[int]) -> torch.Tensor:
        """Regions' byte offsets from the anchor, on the device, made once per region list (an upload is a
        synchronous copy: kept out of every launch)."""
        key = tuple(bases)
        cached = self._region_offsets.get(key)
        if cached is None:
            anchor = self._anchor.data_ptr()
            cached = self._torch.tensor([b - anchor for b in key], dtype=self._torch.int64, device=self.device)
            self._region_offsets[key] = cached
        return cached

    def _upload(self, ids: np.ndarray) -> torch.Tensor:
        """Block ids to the device through pinned memory, not waited for: the kernels follow on the same stream."""
        host = self._torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
        if self.device.type == "cpu":  # interpreted
            return host
        host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _gathered(self, bases: list[int], widths: list[int], blocks: int, local: np.ndarray, lo: int,
                  segs: list[int]) -> np.ndarray:
        """The slices gathered on the device, copied to the host and hashed there: XXH3's short inputs and
        regions of mixed block sizes (rare: a slow path, never a wrong one)."""
        torch = self._torch
        from .cuda_ipc.triton_copy import _RawCudaArray

        ids = torch.from_numpy(np.ascontiguousarray(local)).to(self.device)
        leaves = np.empty((local.shape[0], len(bases)), dtype=DIGEST_DTYPE)
        for r, (base, width, seg) in enumerate(zip(bases, widths, segs, strict=True)):
            if self.device.type == "cpu":  # interpreted: the regions are host memory
                view = torch.from_numpy(np.ctypeslib.as_array((ctypes.c_uint8 * (blocks * width)).from_address(base))
                                        .reshape(blocks, width))
            else:
                view = torch.as_tensor(_RawCudaArray(base, (blocks, width), (width, 1)), device=self.device)
            rows = view[ids][:, :, lo:lo + seg].reshape(ids.shape[0], -1).cpu().numpy()
            leaves[:, r] = [xxhash.xxh3_64_intdigest(row.data) for row in rows]
        return np.array([root_digest(unit) for unit in leaves], dtype=DIGEST_DTYPE)



def reference_digests(regions: list[torch.Tensor], units: np.ndarray, offset: int = 0,
                      length: int = 0) -> np.ndarray:
    """The contract computed on the host from ``[blocks, block bytes]`` uint8 device tensors (one group): for tests
    and the benchmark's exactness check."""
    host = [r.cpu().numpy() for r in regions]
    return digest_units([host], units, offset=offset, length=length)
