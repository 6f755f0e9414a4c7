"""Descriptor math, numpy only (core-safe): descriptor arrays, descriptor ids, row groups and region groups,
heterogeneous TP and block-size mapping, and the HND ↔ NHD permute.

Descriptor ids follow vLLM's NixlConnector: the prepared list is region-major, ``id = region * blocks + block``
(with ``blocks = num_blocks * split`` in a split view), so one request's ids for every region are a single
broadcast ``regions[:, None] * blocks + block_ids[None, :]``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from kvlifecycle.transport import WHOLE_BLOCK, BlockView, KVLayout, MemoryKind, RegionGroup

_BlocksT = TypeVar("_BlocksT")  # a numpy array or a torch tensor: the core cannot name torch's type

DESC_ID_DTYPE = np.int32


class UnsupportedMappingError(ValueError):
    """A P/D combination this library refuses (at handshake, never at the first request)."""


def _view_offsets(layout: KVLayout, view: BlockView) -> np.ndarray:
    """Where each region's descriptors start in its blocks: ``view.offset`` in the first group, 0 in the others."""
    offsets = np.full(layout.num_regions, view.offset, dtype=np.uint64)
    offsets[layout.region_groups[0].regions:] = 0
    return offsets


def view_block_bytes(layout: KVLayout, view: BlockView) -> np.ndarray:
    """Bytes per descriptor in each region under ``view``.

    A view slices the blocks of a layout's first region group (the KV pages, whose heads a TP rank holds a share
    of); the rows of its other groups (SGLang's aux rows, the same on every rank) always move whole."""
    block = np.asarray(layout.block_bytes, dtype=np.uint64)
    first = layout.region_groups[0].regions
    if view.split > 1 and len(layout.region_groups) > 1:
        raise UnsupportedMappingError(f"view {view} splits blocks: region groups of their own block counts have no "
                                      "sub-block id space")
    head = block[:first]
    length = head - np.uint64(view.offset) if view.length == 0 else np.full_like(head, view.length)
    if view.offset < 0 or (np.uint64(view.offset) + length > head).any():
        raise UnsupportedMappingError(f"view {view} does not fit in blocks of {layout.block_bytes} bytes")
    if view.split < 1 or (length % np.uint64(view.split)).any():
        raise UnsupportedMappingError(f"view length {length.tolist()} does not split into {view.split}")
    per_descriptor: np.ndarray = np.concatenate([length // np.uint64(view.split), block[first:]])
    return per_descriptor


def block_descs(layout: KVLayout, view: BlockView = WHOLE_BLOCK) -> np.ndarray:
    """The Nx3 uint64 ``(address, length, device)`` array for every (region, block, sub-block), region-major; a
    region of a :class:`~kvlifecycle.transport.RegionGroup` lists its group's blocks."""
    sub_len = view_block_bytes(layout, view)  # per region
    if not layout.groups:
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
    else:  # split is 1 here (view_block_bytes refused the rest): one descriptor per (region, block of its group)
        counts = np.asarray(layout.region_blocks, dtype=np.int64)
        region = np.repeat(np.arange(layout.num_regions), counts)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        block = np.arange(region.size, dtype=np.uint64) - np.repeat(starts, counts).astype(np.uint64)
        addr = (np.asarray(layout.base_addrs, dtype=np.uint64)[region] + _view_offsets(layout, view)[region]
                + block * np.asarray(layout.block_bytes, dtype=np.uint64)[region])
        length = sub_len[region]
    if layout.kinds_per_group:
        device = region_devices(layout)[region]
    else:
        device = np.full(addr.shape, layout.device_id, dtype=np.uint64)
    return np.stack([addr, length, device], axis=1)


def region_devices(layout: KVLayout) -> np.ndarray:
    """Each region's device id: its group's (host-memory groups of a VRAM layout are device 0, as NIXL names host
    memory)."""
    return np.asarray([layout.group_device(g) for g, group in enumerate(layout.region_groups)
                       for _ in range(group.regions)], dtype=np.uint64)


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
    out[:, 0] = np.asarray(layout.base_addrs, dtype=np.uint64) + _view_offsets(layout, view)
    out[:, 1] = sub_len
    out[:, 2] = region_devices(layout)
    out[:, 3] = np.asarray(layout.block_bytes, dtype=np.uint64)
    out[:, 4] = np.asarray(layout.region_blocks, dtype=np.uint64)
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


def group_desc_ids(local_groups: Sequence[RegionGroup], remote_groups: Sequence[RegionGroup],
                   local_blocks: np.ndarray, remote_blocks: np.ndarray,
                   regions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor ids of one post over layouts with region groups (checked block ids in the one id space of
    :class:`~kvlifecycle.transport.KVLayout`): block ``i`` pairs ``local_blocks[i]`` with ``remote_blocks[i]``,
    both in the same group, and moves in the selected ``regions`` of that group only. Region-major, as
    :func:`desc_ids`; each region's descriptors start after those of the regions before it (its group's count
    each). Raises :class:`UnsupportedMappingError` for a pair in different groups. Vectorised: it runs on every
    post (a loop over regions cost 20 times :func:`desc_ids`)."""
    local, remote = _GroupIndex.of(tuple(local_groups)), _GroupIndex.of(tuple(remote_groups))
    local_of, remote_of = local.group_of(local_blocks), remote.group_of(remote_blocks)
    if not np.array_equal(local_of, remote_of):
        i = int(np.argmax(local_of != remote_of))
        raise UnsupportedMappingError(f"block {int(local_blocks[i])} (group {int(local_of[i])}) cannot pair with "
                                      f"block {int(remote_blocks[i])} (group {int(remote_of[i])})")
    order = np.argsort(local_of, kind="stable")  # the blocks of each group, in their given order
    per_group = np.bincount(local_of, minlength=local.region_group.max() + 1)
    group_first = np.concatenate([[0], np.cumsum(per_group)[:-1]])
    regs = np.asarray(regions, dtype=np.int64)
    reg_group = local.region_group[regs]
    repeats = per_group[reg_group]  # each selected region moves the blocks of its group
    region = np.repeat(regs, repeats)
    group = np.repeat(reg_group, repeats)
    position = np.arange(region.size) - np.repeat(np.cumsum(repeats) - repeats, repeats)
    block = order[group_first[group] + position]
    local_ids = local.desc_start[region] + local_blocks[block] - local.block_start[group]
    remote_ids = remote.desc_start[region] + remote_blocks[block] - remote.block_start[group]
    return local_ids.astype(DESC_ID_DTYPE, copy=False), remote_ids.astype(DESC_ID_DTYPE, copy=False)


@dataclass(frozen=True, slots=True)
class _GroupIndex:
    """Per region group and region: where its block ids and its descriptors start (built once per groups)."""

    block_end: np.ndarray  # per group: one past its last block id
    block_start: np.ndarray  # per group
    region_group: np.ndarray  # per region: its group
    desc_start: np.ndarray  # per region: its first descriptor id

    @staticmethod
    @functools.lru_cache(maxsize=64)
    def of(groups: tuple[RegionGroup, ...]) -> _GroupIndex:
        counts = np.asarray([g.num_blocks for g in groups], dtype=np.int64)
        regions = [g.regions for g in groups]
        per_region = np.repeat(counts, regions)
        return _GroupIndex(np.cumsum(counts), np.cumsum(counts) - counts, np.repeat(np.arange(len(groups)), regions),
                           np.cumsum(per_region) - per_region)

    def group_of(self, blocks: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.block_end, blocks, side="right")


def group_post_bytes(groups: Sequence[RegionGroup], desc_bytes: np.ndarray, ids: np.ndarray) -> int:
    """Bytes a post of descriptor ``ids`` (from :func:`group_desc_ids`) moves, ``desc_bytes`` per region."""
    region = np.searchsorted(_GroupIndex.of(tuple(groups)).desc_start, ids, side="right") - 1
    return int(np.asarray(desc_bytes, dtype=np.int64)[region].sum())


# --- row groups ------------------------------------------------------------------------------------------------


def rows_layout(kind: MemoryKind | str, device_id: int, ptrs: Sequence[int], data_lens: Sequence[int],
                item_lens: Sequence[int]) -> KVLayout:
    """One region group as a :class:`KVLayout`: region ``i`` holds ``data_lens[i] // item_lens[i]`` rows of
    ``item_lens[i]`` bytes from ``ptrs[i]`` (SGLang's ``KVArgs`` form). A group's block count is the fewest rows
    any of its regions holds, so no descriptor reaches past a buffer. Engines whose rows come in groups of
    different counts (SGLang: KV pages, and aux rows sized by the running requests) join one layout per group
    with :func:`grouped_layout`."""
    if not (len(ptrs) == len(data_lens) == len(item_lens)) or not ptrs:
        raise ValueError(f"a row group needs one ptr, length and row size per region, got {len(ptrs)}, "
                         f"{len(data_lens)} and {len(item_lens)}")
    rows = min(int(n) // int(i) for n, i in zip(data_lens, item_lens, strict=True))
    if rows < 1:
        raise ValueError(f"a region of the group holds no whole row (lengths {list(data_lens)}, rows of "
                         f"{list(item_lens)} bytes)")
    return KVLayout(MemoryKind(kind), device_id, rows, tuple(int(p) for p in ptrs), tuple(int(i) for i in item_lens))


def grouped_layout(*parts: KVLayout) -> KVLayout:
    """One layout of several region groups, one per part, in order (e.g. :func:`rows_layout` of SGLang's KV pages
    then of its aux rows): part ``g``'s block ``b`` is block ``sum(n_0..n_{g-1}) + b`` of the result. Parts are
    single groups. Parts of one memory kind make a layout of that kind; parts of several (SGLang on a GPU: VRAM
    pages, host-memory aux rows) make a layout of the first part's kind and device whose groups name their kinds,
    all VRAM parts on that one device."""
    if not parts:
        raise ValueError("a grouped layout needs at least one part")
    if any(p.groups for p in parts):
        raise ValueError("grouped_layout takes single-group layouts")
    mixed = len({p.kind for p in parts}) > 1
    if len({p.device_id for p in parts if p.kind is MemoryKind.VRAM or not mixed}) > 1:
        raise ValueError("grouped_layout takes parts on one device: got devices "
                         f"{sorted({p.device_id for p in parts})}")
    device = next((p.device_id for p in parts if p.kind is MemoryKind.VRAM), parts[0].device_id)
    return KVLayout(parts[0].kind, device, sum(p.num_blocks for p in parts),
                    tuple(a for p in parts for a in p.base_addrs), tuple(b for p in parts for b in p.block_bytes),
                    tuple(RegionGroup(p.num_regions, p.num_blocks, p.kind if mixed else None) for p in parts))


def group_start(layout: KVLayout, group: int) -> int:
    """The first block id of region group ``group`` in ``layout``'s one id space."""
    return sum(g.num_blocks for g in layout.region_groups[:group])


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
            num_kv_heads: int, kv_layout: str, block_size: int | None = None) -> TPPlan:
    """Plan the reads of D rank ``d_rank`` under TP sizes ``p_tp`` (producer) and ``d_tp`` (consumer).

    Blocks must be head-major when the TP sizes differ, so a rank's heads are one contiguous slice: ``HND``, or
    token-major (``NHD``) blocks of one token (``block_size`` 1, SGLang's ``--page-size 1``), which are both.
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
    if kv_layout != "HND" and not (kv_layout == "NHD" and block_size == 1):
        got = f"NHD blocks of {block_size} tokens" if kv_layout == "NHD" and block_size else kv_layout
        raise UnsupportedMappingError(
            f"heterogeneous TP (P {p_tp} ↔ D {d_tp}) needs the HND layout, or NHD blocks of one token (SGLang "
            f"--page-size 1); got {got}")
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


def tp_source_ranks(*, p_tp: int, d_tp: int, d_rank: int) -> tuple[int, ...]:
    """The P ranks D rank ``d_rank`` reads (the ``p_rank`` of :func:`tp_plan`'s reads, known before any byte size):
    an engine connects to these before it knows P's block bytes."""
    if p_tp < 1 or d_tp < 1 or not 0 <= d_rank < d_tp:
        raise UnsupportedMappingError(f"bad TP sizes/rank: p_tp={p_tp} d_tp={d_tp} d_rank={d_rank}")
    big, small = max(p_tp, d_tp), min(p_tp, d_tp)
    if big % small:
        raise UnsupportedMappingError(f"TP sizes must divide: P {p_tp}, D {d_tp}")
    if d_tp >= p_tp:
        return (d_rank // (d_tp // p_tp),)
    ratio = p_tp // d_tp
    return tuple(range(d_rank * ratio, (d_rank + 1) * ratio))


def tp_consumers(*, p_tp: int, d_tp: int) -> int:
    """How many D ranks read each P rank's blocks: the ``consumers`` of P's lease
    (:attr:`TPPlan.consumers_per_p_rank`)."""
    return max(d_tp // p_tp, 1)


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
    mine, theirs = [g.regions for g in local.region_groups], [g.regions for g in remote.region_groups]
    if mine != theirs:
        raise UnsupportedMappingError(f"region groups differ: local {mine} regions, remote {theirs}")
    a = view_block_bytes(local, local_view)
    b = view_block_bytes(remote, remote_view)
    if not np.array_equal(a, b):
        r = int(np.argmax(a != b))
        raise UnsupportedMappingError(
            f"descriptor sizes differ in region {r}: local {int(a[r])} bytes, remote {int(b[r])} bytes")


def groups_layout(layout: KVLayout, groups: Sequence[int]) -> KVLayout:
    """The layout of region groups ``groups`` of ``layout`` alone (ascending, each once), in their order: their
    regions, their block counts, their kind(s). A transport that moves some groups of a layout (CUDA IPC over the
    VRAM groups of SGLang's pages and host aux rows) registers this; its block ids are the groups' ids in
    ``layout`` minus what the groups left out before them."""
    all_groups = layout.region_groups
    chosen = list(groups)
    if not chosen or chosen != sorted(set(chosen)) or chosen[0] < 0 or chosen[-1] >= len(all_groups):
        raise ValueError(f"groups must be ascending distinct indices in [0, {len(all_groups)}), got {chosen}")
    kinds = [layout.group_kinds[g] for g in chosen]
    mixed = len(set(kinds)) > 1
    first_region = np.concatenate([[0], np.cumsum([g.regions for g in all_groups])]).astype(int)
    regions = [r for g in chosen for r in range(first_region[g], first_region[g + 1])]
    picked = [all_groups[g] for g in chosen]
    vram = [g for g in chosen if layout.group_kinds[g] is MemoryKind.VRAM]
    return KVLayout(kinds[0], layout.device_id if vram else 0, sum(g.num_blocks for g in picked),
                    tuple(layout.base_addrs[r] for r in regions), tuple(layout.block_bytes[r] for r in regions),
                    tuple(RegionGroup(g.regions, g.num_blocks, kind if mixed else None)
                          for g, kind in zip(picked, kinds, strict=True)) if len(picked) > 1 else ())


def groups_by_kind(layout: KVLayout) -> dict[MemoryKind, tuple[int, ...]]:
    """``layout``'s region groups by memory kind, in the order the kinds first appear."""
    out: dict[MemoryKind, list[int]] = {}
    for g, kind in enumerate(layout.group_kinds):
        out.setdefault(kind, []).append(g)
    return {kind: tuple(gs) for kind, gs in out.items()}
