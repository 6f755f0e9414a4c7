"""Layouts of several memory kinds on NIXL: one descriptor list per region group, one transfer per list.

NIXL keeps one memory kind per registration call, per descriptor list and so per transfer. SGLang on a GPU holds
its KV pages in VRAM and its aux rows in host memory, and moves both in one handoff: a layout whose region groups
name their kinds (:attr:`~kvlifecycle.transport.KVLayout.kinds_per_group`) is registered one kind at a time, gets
one descriptor list per group, and a post over blocks of several groups becomes one NIXL transfer per (local list,
remote list) pair. The notification then goes out on its own once every part is DONE: attached to one part, it
could reach the peer while another part's bytes were still landing. A layout of one kind keeps one list, one
transfer and the notification attached to it.

Descriptor ids stay those of the whole layout (:func:`kvlifecycle.layout.group_desc_ids`); a list's ids are
them minus the list's first id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle import layout as L
from kvlifecycle.transport import BlockView, KVLayout, MemoryKind


@dataclass(frozen=True, slots=True)
class DescLists:
    """The prepared descriptor lists of one layout under one view: ``handles[i]`` holds the layout's descriptor
    ids ``[first_ids[i], first_ids[i + 1])``."""

    handles: tuple[Any, ...]
    first_ids: np.ndarray  # int64, one per handle

    def index_of(self, ids: np.ndarray) -> np.ndarray:
        if len(self.handles) == 1:
            return np.zeros(ids.shape, dtype=np.int64)
        return np.searchsorted(self.first_ids, ids, side="right") - 1


def group_rows(layout: KVLayout) -> list[tuple[int, int, int, int, MemoryKind]]:
    """Per region group: (first region, end region, first descriptor id, end descriptor id, memory kind)."""
    out, region, desc = [], 0, 0
    for group, kind in zip(layout.region_groups, layout.group_kinds, strict=True):
        descs = group.regions * group.num_blocks
        out.append((region, region + group.regions, desc, desc + descs, kind))
        region, desc = region + group.regions, desc + descs
    return out


def prepare_lists(layout: KVLayout, view: BlockView, prep: Callable[[np.ndarray | None, np.ndarray, MemoryKind], Any],
                  strided: bool) -> DescLists:
    """Prepare ``layout``'s lists with ``prep(strided rows or None, descriptor rows, kind)``: one list for a layout
    of one kind, else one per group (regions sliced from the layout's strided rows, descriptors from its long
    form, so the ids match the layout's)."""
    rows = L.block_descs_strided(layout, view) if strided else None
    if not layout.kinds_per_group:
        return DescLists((prep(rows, L.block_descs(layout, view), layout.kind),), np.zeros(1, dtype=np.int64))
    descs = L.block_descs(layout, view)
    handles, firsts = [], []
    for r0, r1, d0, d1, kind in group_rows(layout):
        handles.append(prep(None if rows is None else rows[r0:r1], descs[d0:d1], kind))
        firsts.append(d0)
    return DescLists(tuple(handles), np.asarray(firsts, dtype=np.int64))


def split_post(local: DescLists, remote: DescLists, local_ids: np.ndarray,
               remote_ids: np.ndarray) -> Iterator[tuple[Any, np.ndarray, Any, np.ndarray]]:
    """The transfers of one post: (local list, its ids, remote list, its ids) per pair of lists the post
    touches, in list order."""
    li, ri = local.index_of(local_ids), remote.index_of(remote_ids)
    key = li * len(remote.handles) + ri
    for k in np.unique(key):
        sel = key == k
        i, j = divmod(int(k), len(remote.handles))
        yield (local.handles[i], (local_ids[sel] - local.first_ids[i]).astype(L.DESC_ID_DTYPE, copy=False),
               remote.handles[j], (remote_ids[sel] - remote.first_ids[j]).astype(L.DESC_ID_DTYPE, copy=False))
