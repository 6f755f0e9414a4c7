"""Bookkeeping shared by the transport implementations (handles, plans, validation)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle import layout as L
from kvlifecycle.transport import (
    HandleReleasedError,
    KVLayout,
    PreparedPlan,
    RemoteMismatchError,
    TransferHandle,
    TransportError,
    XferOp,
    XferStats,
    XferStatus,
)


def new_epoch() -> int:
    """A fresh agent epoch: grows across restarts on one host (µs wall clock), random low bits break ties."""
    return (time.time_ns() // 1000) << 8 | (os.urandom(1)[0])


@dataclass(slots=True)
class XferRecord:
    handle: TransferHandle
    status: XferStatus = XferStatus.PENDING
    error: TransportError | None = None
    stats: XferStats | None = None
    native: Any = None  # the backend's own handle
    nbytes: int = 0
    ndesc: int = 0
    t_submit: float = 0.0
    t_post_start: float = 0.0
    t_post_end: float = 0.0
    t_done: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


class HandleTable:
    """Live handles by id; an id below ``next_id`` that is not live was released."""

    def __init__(self) -> None:
        self.live: dict[int, XferRecord] = {}
        self.next_id = 1

    def new(self, op: XferOp, peer: str, peer_epoch: int, transfer: str) -> XferRecord:
        handle = TransferHandle(self.next_id, op, peer, peer_epoch, transfer)
        self.next_id += 1
        rec = XferRecord(handle, t_submit=time.perf_counter())
        self.live[handle.id] = rec
        return rec

    def get(self, handle: TransferHandle) -> XferRecord:
        rec = self.live.get(handle.id)
        if rec is None or rec.handle != handle:
            if 0 < handle.id < self.next_id:
                raise HandleReleasedError(f"transfer handle {handle.id} was released")
            raise TransportError(f"transfer handle {handle.id} is not from this transport")
        return rec

    def pop(self, handle: TransferHandle) -> XferRecord:
        rec = self.get(handle)
        del self.live[handle.id]
        return rec


class HandleQueries:
    """``poll``, ``error`` and ``stats`` of the :class:`~kvlifecycle.transport.Transport` protocol for a transport
    whose handles live in a :class:`HandleTable` (``_handles``) guarded by ``_lock``: one lookup under the lock each.
    (The CUDA IPC transport answers them from its completion ring first, so it has its own.)"""

    _handles: HandleTable
    _lock: AbstractContextManager[object]

    def poll(self, handle: TransferHandle) -> XferStatus:
        with self._lock:
            return self._handles.get(handle).status

    def error(self, handle: TransferHandle) -> TransportError | None:
        with self._lock:
            return self._handles.get(handle).error

    def stats(self, handle: TransferHandle) -> XferStats | None:
        with self._lock:
            return self._handles.get(handle).stats


def check_post(
    plan: PreparedPlan,
    local_blocks: np.ndarray | Sequence[int],
    remote_blocks: np.ndarray | Sequence[int],
    regions: np.ndarray | Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """One post's (local block ids, remote block ids, regions or None for all), checked against ``plan``: bounds,
    equal lengths, regions a 1-D subset. :class:`RemoteMismatchError` otherwise."""
    try:
        local = L.check_block_ids(local_blocks, plan.local_blocks, "local")
        remote = L.check_block_ids(remote_blocks, plan.remote_blocks, "remote")
    except ValueError as exc:
        raise RemoteMismatchError(str(exc)) from exc
    if local.size != remote.size:
        raise RemoteMismatchError(f"{local.size} local blocks vs {remote.size} remote blocks")
    if regions is None:
        return local, remote, None
    regs = np.asarray(regions, dtype=np.int64)
    if regs.ndim != 1 or (regs.size and (regs.min() < 0 or regs.max() >= plan.num_regions)):
        raise RemoteMismatchError(f"regions must be a 1-D subset of [0, {plan.num_regions})")
    return local, remote, regs


def plan_descs(
    plan: PreparedPlan,
    local_blocks: np.ndarray | Sequence[int],
    remote_blocks: np.ndarray | Sequence[int],
    regions: np.ndarray | Sequence[int] | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorised (local desc ids, remote desc ids, regions) for one post; validates shapes and bounds."""
    local, remote, given = check_post(plan, local_blocks, remote_blocks, regions)
    regs = np.arange(plan.num_regions, dtype=np.int64) if given is None else given
    if len(plan.local_groups) > 1:  # region groups of their own block counts: each block moves in its group's regions
        try:
            return (*L.group_desc_ids(plan.local_groups, plan.remote_groups, local, remote, regs), regs)
        except L.UnsupportedMappingError as exc:
            raise RemoteMismatchError(str(exc)) from exc
    return (L.desc_ids(local, plan.local_blocks, regs), L.desc_ids(remote, plan.remote_blocks, regs), regs)


def check_pairing(local: KVLayout, plan_views: tuple[Any, Any], remote: KVLayout, *,
                  groups: bool = False) -> tuple[int, int]:
    """Validate a (local view, remote view) pairing; returns the addressable blocks on each side. ``groups``: the
    transport posts region groups (its plans carry them); otherwise a layout with several is refused here."""
    local_view, remote_view = plan_views
    if not groups and (len(local.region_groups) > 1 or len(remote.region_groups) > 1):
        raise RemoteMismatchError("this transport does not post layouts with several region groups")
    try:
        L.check_views_match(local, local_view, remote, remote_view)
    except L.UnsupportedMappingError as exc:
        raise RemoteMismatchError(str(exc)) from exc
    return local.num_blocks * local_view.split, remote.num_blocks * remote_view.split
