"""The data plane of the SGLang backend: kvlifecycle's own NIXL transport over SGLang's KV pages and aux rows.

SGLang moves two groups of rows in one handoff: KV pages (``num_pages`` per KV buffer) and metadata rows (one row
per running request in each aux buffer, a different count, a different size per buffer). Both are region groups
of one :class:`~kvlifecycle.transport.KVLayout` (:func:`~kvlifecycle.layout.grouped_layout` of two
:func:`~kvlifecycle.layout.rows_layout`), registered on one
:class:`~kvlifecycle.transports.nixl.NixlTransport`: a page is a block of the first group, an aux row a block of
the second, in one block id space (:attr:`DataPlane.aux_start`). The handoff's stream posts through that transport
(one post per chunk, the last with the aux row) exactly as vLLM's does; every NIXL call is the transport's, covered
by the transport conformance suite, and the peers' metadata is the handshake's.

KV in VRAM: the pages are VRAM on the engine's GPU and the aux rows where SGLang put them (host memory, unless its
metadata buffers are on the GPU); NIXL registers each kind and moves the groups of one post in one transfer each.
A same-node fast path over the same regions is offered beside NIXL
(:func:`kvlifecycle.transports.select.cuda_ipc_fast_path`): CUDA IPC where every group is VRAM, else a split
transport, CUDA IPC over the pages and a NIXL agent of its own over the host rows (any reason it cannot be built is
one log line, and NIXL alone moves the bytes). The handoff's path selector picks it per peer at the handshake, for
P's writes as for D's reads.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence

from kvlifecycle.transports.nixl import NixlTransport
from kvlifecycle.transports.select import cuda_ipc_fast_path

from kvlifecycle.layout import group_start, grouped_layout, rows_layout
from kvlifecycle.transport import KVLayout, MemoryKind, Transport, TransportError

log = logging.getLogger("kvlifecycle.adapters.sglang")


class DataPlaneError(RuntimeError):
    """The transport could not be made or registered: the manager is not made, with this message."""


def layouts(kv_ptrs: Sequence[int], kv_lens: Sequence[int], kv_item_lens: Sequence[int], aux_ptrs: Sequence[int],
            aux_lens: Sequence[int], aux_item_lens: Sequence[int], *, kind: MemoryKind = MemoryKind.DRAM,
            device_id: int = 0, aux_kind: MemoryKind | None = None) -> KVLayout:
    """An SGLang ``KVArgs``' KV pages (the first group) and aux rows (the second; none without aux buffers) as one
    layout: pages of memory ``kind`` (VRAM: on GPU ``device_id``, ``KVArgs.gpu_id``), aux rows of ``aux_kind``
    (default ``kind``). SGLang on a GPU keeps its aux rows in host memory: the groups then name their kinds and
    NIXL moves each group in its own transfer of one post (transports/nixl_kinds.py)."""
    aux_kind = kind if aux_kind is None else aux_kind
    kv = rows_layout(kind, device_id if kind is MemoryKind.VRAM else 0, kv_ptrs, kv_lens, kv_item_lens)
    if not aux_ptrs:
        return kv
    aux = rows_layout(aux_kind, device_id if aux_kind is MemoryKind.VRAM else 0, aux_ptrs, aux_lens, aux_item_lens)
    return grouped_layout(kv, aux)


def _aux_start(layout: KVLayout) -> int | None:
    return group_start(layout, 1) if len(layout.region_groups) > 1 else None


class DataPlane:
    """One SGLang KV manager's transport, registered over its KV pages and aux rows, and its same-node fast path
    (``fast_transport``: CUDA IPC over the same regions when the pages are VRAM and it could be built, split with a
    NIXL agent over the aux rows when they are in host memory; else None)."""

    backend_name = "nixl-ucx"

    def __init__(self, agent: str, epoch: int, layout: KVLayout) -> None:
        self.layout = layout
        self.num_pages = layout.region_groups[0].num_blocks
        self._aux_start = _aux_start(layout)
        try:
            self.transport = NixlTransport(agent, epoch=epoch, probe_bytes=0)
        except TransportError as exc:  # NIXL missing, or the backend did not load
            raise DataPlaneError(str(exc)) from exc
        try:
            self.transport.register(layout)
        except TransportError as exc:
            self.transport.close()
            raise DataPlaneError(f"NIXL refused to register the {layout.num_regions} regions: {exc}") from exc
        self.fast_transport: Transport | None = cuda_ipc_fast_path(layout, f"{agent}-ipc", logger=log,
                                                                   who="kvlifecycle SGLang backend")

    @property
    def aux_start(self) -> int | None:
        """The block id of aux row 0 (None: no aux rows): a room's aux row is block ``aux_start + aux_index``."""
        return self._aux_start

    @property
    def aux_rows(self) -> int:
        return 0 if self._aux_start is None else self.layout.num_blocks - self._aux_start

    def close(self) -> None:
        with contextlib.suppress(TransportError):
            self.transport.close()
        if self.fast_transport is not None:
            with contextlib.suppress(TransportError):
                self.fast_transport.close()
