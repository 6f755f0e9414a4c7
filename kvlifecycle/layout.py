"""Descriptor math, numpy only (core-safe): descriptor arrays, descriptor ids, heterogeneous TP and block-size
mapping, and the HND ↔ NHD permute.

Descriptor ids follow vLLM's NixlConnector: the prepared list is region-major, ``id = region * blocks + block``
(with ``blocks = num_blocks * split`` in a split view), so one request's ids for every region are a single
broadcast ``regions[:, None] * blocks + block_ids[None, :]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from kvlifecycle.transport import WHOLE_BLOCK, BlockView, KVLayout

_BlocksT = TypeVar("_BlocksT")  # a numpy array or a torch tensor: the core cannot name torch's type

DESC_ID_DTYPE = np.int32


class UnsupportedMappingError(ValueError):
    """A P/D combination this library refuses (at handshake, never at the first request)."""


def view_block_bytes(layout: KVLayout, view: BlockView) -> np.ndarray:
    """Bytes per descriptor in each region under ``view``."""
    block = np.asarray(layout.block_bytes, dtype=np.uint64)
    length = block - np.uint64(view.offset) if view.length == 0 else np.full_like(block, view.length)
    if view.offset < 0 or (np.uint64(view.offset) + length > block).any():
        raise UnsupportedMappingError(f"view {view} does not fit in blocks of {layout.block_bytes} bytes")
    if view.split < 1 or (length % np.uint64(view.split)).any():
        raise UnsupportedMappingError(f"view length {length.tolist()} does not split into {view.split}")
    per_descriptor: np.ndarray = length // np.uint64(view.split)
    return per_descriptor


def block_descs(layout: KVLayout, view: BlockView = WHOLE_BLOCK) -> np.ndarray:
    """The Nx3 uint64 ``(address, length, device)`` array for every (region, block, sub-block), region-major."""
    sub_len = view_block_bytes(layout, view)  # per region
    base = np.asarray(layout.base_addrs, dtype=np.uint64)
    stride = np.asarray(layout.block_bytes, dtype=np.uint64)
    blocks = np.arange(layout.num_blocks, dtype=np.uint64)
    subs = np.arange(view.split, dtype=np.uint64)
    addr = (
        base[:, None, None]
        + blocks[None, :, None] * stride[:, None, None]
        + np.uint64(view.offset)
        + subs[None, None, :] * sub_len[:, None, None]
    ).reshape(-1)
    length = np.repeat(sub_len, layout.num_blocks * view.split)
    device = np.full(addr.shape, layout.device_id, dtype=np.uint64)
    return np.stack([addr, length, device], axis=1)


def block_descs_strided(layout: KVLayout, view: BlockView = WHOLE_BLOCK) -> np.ndarray | None:
    """The same descriptor list as :func:`block_descs`, compressed to one Nx5 ``(address, length, device, stride,
    count)`` row per region (NIXL >= 1.5 expands it to ``count`` descriptors), or ``None`` when a view splits a
    block into several pieces (that order, block-major within a region, has no strided form). One row instead of
    ``num_blocks`` per region keeps descriptor preparation off the first request's path (vLLM #55434, #55157)."""
    if view.split != 1:
        return None
    sub_len = view_block_bytes(layout, view)
    rows = len(layout.base_addrs)
    out = np.empty((rows, 5), dtype=np.uint64)
    out[:, 0] = np.asarray(layout.base_addrs, dtype=np.uint64) + np.uint64(view.offset)
    out[:, 1] = sub_len
    out[:, 2] = layout.device_id
    out[:, 3] = np.asarray(layout.block_bytes, dtype=np.uint64)
    out[:, 4] = layout.num_blocks
    return out


def desc_ids(block_ids: np.ndarray | Sequence[int], blocks_per_region: int,
             regions: np.ndarray | Sequence[int] | int) -> np.ndarray:
    """``region * blocks_per_region + block`` for every region (outer) and block (inner), as int32."""
    ids = np.asarray(block_ids, dtype=np.int64)
    regs = np.arange(regions, dtype=np.int64) if isinstance(regions, int) else np.asarray(regions, dtype=np.int64)
    out = regs[:, None] * blocks_per_region + ids[None, :]
    return out.reshape(-1).astype(DESC_ID_DTYPE, copy=False)


def check_block_ids(block_ids: np.ndarray | Sequence[int], limit: int, what: str) -> np.ndarray:
    ids = np.asarray(block_ids, dtype=np.int64)
    if ids.ndim != 1:
        raise ValueError(f"{what} block ids must be 1-D")
    if ids.size and (ids.min() < 0 or ids.max() >= limit):
        raise ValueError(f"{what} block ids must be in [0, {limit}), got [{ids.min()}, {ids.max()}]")
    return ids


# --- heterogeneous TP ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TPRead:
    """One read a D rank performs: which P rank, which slice of each P block, which slice of each D block."""

    p_rank: int
    remote_view: BlockView
    local_view: BlockView


@dataclass(frozen=True, slots=True)
class TPPlan:
    """What a D rank reads (``reads``; ``len(reads)`` = the parts its load expects) and how many consumers each
    P rank's lease must count (``consumers_per_p_rank``)."""

    reads: tuple[TPRead, ...]
    consumers_per_p_rank: int

    @property
    def parts(self) -> int:
        return len(self.reads)


def tp_plan(*, p_tp: int, d_tp: int, d_rank: int, p_block_bytes: int, d_block_bytes: int,
            num_kv_heads: int, kv_layout: str) -> TPPlan:
    """Plan the reads of D rank ``d_rank`` under TP sizes ``p_tp`` (producer) and ``d_tp`` (consumer).

    Blocks must be head-major (``HND``) when the TP sizes differ, so a rank's heads are one contiguous slice.
    - ``d_tp == p_tp``: rank i reads rank i, whole blocks.
    - ``d_tp > p_tp``: ``r = d_tp // p_tp`` D ranks share one P rank; D rank reads its ``1/r`` slice of heads at
      offset ``(d_rank % r) * p_block_bytes / r``. The P lease counts ``r`` consumer notifications.
    - ``p_tp > d_tp``: one D rank reads ``r = p_tp // d_tp`` P ranks, each into its slice of the D block.
    """
    if p_tp < 1 or d_tp < 1 or not 0 <= d_rank < d_tp:
        raise UnsupportedMappingError(f"bad TP sizes/rank: p_tp={p_tp} d_tp={d_tp} d_rank={d_rank}")
    if p_tp == d_tp:
        if p_block_bytes != d_block_bytes:
            raise UnsupportedMappingError(
                f"equal TP but block bytes differ: P {p_block_bytes} vs D {d_block_bytes} (block size mapping "
                "goes through block_size_views)")
        return TPPlan((TPRead(d_rank, BlockView(), BlockView()),), 1)
    if kv_layout != "HND":
        raise UnsupportedMappingError(
            f"heterogeneous TP (P {p_tp} ↔ D {d_tp}) needs the HND KV layout; got {kv_layout}")
    big, small = max(p_tp, d_tp), min(p_tp, d_tp)
    if big % small:
        raise UnsupportedMappingError(f"TP sizes must divide: P {p_tp}, D {d_tp}")
    ratio = big // small
    if num_kv_heads % big:
        raise UnsupportedMappingError(f"{num_kv_heads} KV heads cannot be split over TP {big}")
    if d_tp > p_tp:
        if p_block_bytes != d_block_bytes * ratio:
            raise UnsupportedMappingError(
                f"D TP {d_tp} > P TP {p_tp}: expected P block bytes = {ratio} × D ({d_block_bytes}), "
                f"got {p_block_bytes}")
        slice_len = p_block_bytes // ratio
        view = BlockView(offset=(d_rank % ratio) * slice_len, length=slice_len)
        return TPPlan((TPRead(d_rank // ratio, view, BlockView()),), ratio)
    if d_block_bytes != p_block_bytes * ratio:
        raise UnsupportedMappingError(
            f"P TP {p_tp} > D TP {d_tp}: expected D block bytes = {ratio} × P ({p_block_bytes}), got {d_block_bytes}")
    reads = tuple(
        TPRead(d_rank * ratio + i, BlockView(), BlockView(offset=i * p_block_bytes, length=p_block_bytes))
        for i in range(ratio)
    )
    return TPPlan(reads, 1)


# --- block size mapping ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BlockSizeMap:
    """Views that make P and D blocks the same size: the bigger blocks are split into ``ratio`` sub-blocks."""

    local_view: BlockView
    remote_view: BlockView
    local_split: int
    remote_split: int


def block_size_views(*, local_block_size: int, remote_block_size: int, kv_layout: str) -> BlockSizeMap:
    """Token-major (``NHD``) blocks of different sizes map onto each other by splitting the bigger ones."""
    if local_block_size == remote_block_size:
        return BlockSizeMap(BlockView(), BlockView(), 1, 1)
    if kv_layout != "NHD":
        raise UnsupportedMappingError(
            f"block sizes differ (local {local_block_size}, remote {remote_block_size}): needs the NHD layout, "
            f"got {kv_layout}")
    big, small = max(local_block_size, remote_block_size), min(local_block_size, remote_block_size)
    if big % small:
        raise UnsupportedMappingError(f"block sizes must divide: {local_block_size} vs {remote_block_size}")
    ratio = big // small
    if local_block_size > remote_block_size:
        return BlockSizeMap(BlockView(split=ratio), BlockView(), ratio, 1)
    return BlockSizeMap(BlockView(), BlockView(split=ratio), 1, ratio)


def sub_block_ids(block_ids: np.ndarray | Sequence[int], split: int,
                  num_tokens_blocks: int | None = None) -> np.ndarray:
    """Sub-block ids ``block * split + s`` in token order, cut to ``num_tokens_blocks`` sub-blocks if given."""
    ids = np.asarray(block_ids, dtype=np.int64)
    out = (ids[:, None] * split + np.arange(split, dtype=np.int64)[None, :]).reshape(-1)
    return out if num_tokens_blocks is None else out[:num_tokens_blocks]


# --- HND <-> NHD -----------------------------------------------------------------------------------------------


def permute_blocks(blocks: _BlocksT, *, num_heads: int, block_size: int, head_dim: int, src: str,
                   dst: str) -> _BlocksT:
    """Permute blocks between ``HND`` ([heads, tokens, dim]) and ``NHD`` ([tokens, heads, dim]) per block.

    ``blocks`` is an array of shape ``(n, block_elems)`` or ``(n, ...)`` with the same element count; numpy arrays
    and torch tensors both work (torch through ``permute``). Returns a new contiguous array of the input's shape.
    """
    if src == dst:
        return blocks
    if {src, dst} != {"HND", "NHD"}:
        raise UnsupportedMappingError(f"unknown layouts {src} -> {dst}")
    array: Any = blocks  # numpy's and torch's methods alike, which no type the core can import describes
    shape = tuple(array.shape)
    n = shape[0]
    if src == "HND":
        view = array.reshape(n, num_heads, block_size, head_dim)
    else:
        view = array.reshape(n, block_size, num_heads, head_dim)
    if hasattr(view, "permute"):
        permuted: _BlocksT = view.permute(0, 2, 1, 3).contiguous().reshape(shape)
        return permuted
    return cast(_BlocksT, np.ascontiguousarray(view.transpose(0, 2, 1, 3)).reshape(shape))  # blocks was an array


def check_views_match(local: KVLayout, local_view: BlockView, remote: KVLayout, remote_view: BlockView) -> None:
    """Refuse a (local, remote) pairing whose descriptors would not line up one to one."""
    if local.num_regions != remote.num_regions:
        raise UnsupportedMappingError(f"region counts differ: local {local.num_regions}, remote {remote.num_regions}")
    a = view_block_bytes(local, local_view)
    b = view_block_bytes(remote, remote_view)
    if not np.array_equal(a, b):
        r = int(np.argmax(a != b))
        raise UnsupportedMappingError(
            f"descriptor sizes differ in region {r}: local {int(a[r])} bytes, remote {int(b[r])} bytes")
