"""Copy plans: a prepared plan's regions grouped by shape, each group a pair of block copiers (one launch per
direction), and the launch a post of every region (or of a region subset) needs, computed once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle.transport import BlockView, KVLayout, PreparedPlan, RemoteMismatchError

from .triton_copy import BlockCopier, RegionSpec


@dataclass(slots=True)
class Group:
    """Regions that share unit size and strides on both sides: one copier (one launch) per direction."""

    regions: np.ndarray  # region indices, ascending
    read: BlockCopier  # peer -> local
    write: BlockCopier  # local -> peer
    unit_bytes: int


@dataclass(slots=True)
class Launch:
    """What ``post`` needs for one set of groups, computed once (plan) or once per region subset."""

    read: list[BlockCopier]  # one per group, peer -> local
    write: list[BlockCopier]  # one per group, local -> peer
    bytes_per_block: int  # bytes moved per block id over every region
    regions: int  # regions (descriptors per block id)
    backend: str
    native_read: Any = None  # native_post.KernelList of ``read`` once every copier is warm (the compiled post)
    native_write: Any = None
    inline_read: Any = None  # the same with the inline-ids kernels (requests of at most inline_count blocks)
    inline_write: Any = None


def launch_of(groups: list[Group]) -> Launch:
    return Launch([g.read for g in groups], [g.write for g in groups],
                  sum(g.unit_bytes * len(g.regions) for g in groups), sum(len(g.regions) for g in groups),
                  groups[0].read.backend if groups else "")


@dataclass(slots=True)
class Plan:
    plan: PreparedPlan
    groups: list[Group]
    subsets: dict[tuple[int, tuple[int, ...]], Group] = field(default_factory=dict)
    whole: Launch | None = None  # the launch over every region (regions=None), built with the plan
    # the launch of each region list posted so far (a layer's K and V, for layer-wise posts): built once, so a
    # post of a subset neither regroups its regions nor rebinds its kernels (both cost more than the post itself)
    launches: dict[tuple[int, ...], Launch] = field(default_factory=dict)


def region_specs(layout: KVLayout, view: BlockView) -> list[RegionSpec]:
    """Per-region :class:`RegionSpec` of ``layout`` under ``view`` (offset, length and split of every block)."""
    out = []
    for base, block in zip(layout.base_addrs, layout.block_bytes, strict=True):
        length = block - view.offset if view.length == 0 else view.length
        unit = length // view.split
        out.append(RegionSpec(base + view.offset, block, layout.num_blocks, unit, view.split, unit))
    return out


def groups_of(local_specs: list[RegionSpec], remote_specs: list[RegionSpec], regions: np.ndarray, device: Any,
              copier_kwargs: dict[str, Any]) -> list[Group]:
    """Group ``regions`` by shape on both sides and build each group's two copiers."""
    by_shape: dict[tuple[Any, ...], list[int]] = {}
    for r in regions.tolist():
        ls, rs = local_specs[r], remote_specs[r]
        key = (ls.stride, ls.unit_bytes, ls.split, ls.sub_stride, rs.stride, rs.split, rs.sub_stride)
        by_shape.setdefault(key, []).append(r)
    groups = []
    for regs in by_shape.values():
        loc = [local_specs[r] for r in regs]
        rem = [remote_specs[r] for r in regs]
        groups.append(Group(np.asarray(regs, dtype=np.int64), BlockCopier(rem, loc, device, **copier_kwargs),
                            BlockCopier(loc, rem, device, **copier_kwargs), loc[0].unit_bytes))
    return groups


MAX_SUBSET_LAUNCHES = 1024  # distinct region lists a plan keeps launches for (then it starts over)


def subset_launch(prepared: Plan, regions: np.ndarray | Sequence[int]) -> Launch:
    """The launch of a post of ``regions``, built on the first post of that exact list and kept on the plan."""
    key = tuple(int(r) for r in regions)
    launch = prepared.launches.get(key)
    if launch is None:
        launch = launch_of(plan_groups(prepared, regions))  # checks the regions
        if len(prepared.launches) >= MAX_SUBSET_LAUNCHES:
            prepared.launches.clear()
        prepared.launches[key] = launch
    return launch


def plan_groups(prepared: Plan, regions: np.ndarray | Sequence[int] | None) -> list[Group]:
    """The groups a post of ``regions`` (every region when ``None``) launches; a region subset's copiers are built
    once and cached on the plan."""
    if regions is None:
        return prepared.groups
    regs = np.unique(np.asarray(regions, dtype=np.int64))
    if regs.size != len(regions) or (regs.size and (regs[0] < 0 or regs[-1] >= prepared.plan.num_regions)):
        raise RemoteMismatchError(f"regions must be distinct indices in [0, {prepared.plan.num_regions})")
    out = []
    for i, group in enumerate(prepared.groups):
        mine = np.intersect1d(group.regions, regs)
        if mine.size == group.regions.size:
            out.append(group)
        elif mine.size:
            key = (i, tuple(mine.tolist()))
            sub = prepared.subsets.get(key)
            if sub is None:
                pick = np.searchsorted(group.regions, mine)
                sub = Group(mine, _subset(group.read, pick), _subset(group.write, pick), group.unit_bytes)
                prepared.subsets[key] = sub
            out.append(sub)
    return out


def _subset(copier: BlockCopier, pick: np.ndarray) -> BlockCopier:
    return BlockCopier([copier.src[i] for i in pick.tolist()], [copier.dst[i] for i in pick.tolist()], copier.device,
                       chunk_bytes=copier.chunk * copier.word, num_warps=copier.num_warps,
                       region_group=copier.region_group, use_triton=copier.use_triton, cache=copier.cache,
                       inline_ids=copier.inline_ids, fast_launch=copier.fast_launch,
                       compiled_post=copier.compiled_post)
