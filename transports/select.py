"""Backend selection: which transport and NIXL backend for a pair of memory kinds and a locality (:func:`choose`);
verify the plugin really loaded (:func:`verify_backend`). :class:`SameNodeSelector` is the path selector
(:class:`kvlifecycle.path_selection.PathSelector`) for a same-node fast path, a Consumer's for its reads, a
Producer's for its pushes: it walks the fast paths (:mod:`kvlifecycle.transports.cuda_ipc.selection`), each of
which takes the peer or refuses it. :func:`cuda_ipc_fast_path` builds that fast path for an engine adapter (vLLM,
SGLang).

Reporting (the :class:`Selection` record, the listeners observability hooks in with :func:`add_listener`, the
connect-time probe's report) lives in the leaf :mod:`kvlifecycle.transports.selection_report`; its names are
re-exported here.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Sequence
from typing import Any

from kvlifecycle import layout as L
from kvlifecycle.path_selection import DataPath, PathChoice
from kvlifecycle.transport import (
    BackendUnavailableError,
    KVLayout,
    Locality,
    MemoryKind,
    PeerMetadata,
    Transport,
    TransportError,
)

from .cuda_ipc.selection import CudaIpcPath, SplitCudaIpcPath
from .fast_path import FastPath
from .selection_report import (
    DEFAULT_FLOOR_GBPS,
    Listener,
    Selection,
    add_listener,
    on_selected,
    probe_and_report,
    remove_listener,
)
from .split import SplitTransport

__all__ = [
    "DEFAULT_FLOOR_GBPS",
    "Listener",
    "SameNodeSelector",
    "Selection",
    "add_listener",
    "choose",
    "cuda_ipc_fast_path",
    "fast_paths",
    "on_selected",
    "probe_and_report",
    "remove_listener",
    "verify_backend",
]

log = logging.getLogger("kvlifecycle.transports.select")


def choose(
    local: MemoryKind | str,
    remote: MemoryKind | str,
    locality: Locality | str,
    *,
    prefer: Sequence[str] = ("UCX",),
    available: Sequence[str] | None = None,
    cuda_ipc: bool = True,
) -> Selection:
    """Pick the transport and backend.

    - same process: ``loopback`` (torch copies; VRAM regions need their tensors registered);
    - VRAM on both sides of one node: ``cuda_ipc`` (one batched copy kernel over mapped peer memory; measured on an
      H200 at ~0.9x a device copy where NIXL/UCX got ~0.4 GB/s). Its connect-time self-test decides for real:
      :class:`~kvlifecycle.transports.cuda_ipc.selection.CudaIpcPath` (walked by :class:`SameNodeSelector`)
      refuses the peer when it fails, and NIXL moves the bytes;
    - otherwise: ``nixl`` with the first of ``prefer`` that is ``available`` (default UCX, which picks cma/sm on
      one node and rc/tcp across nodes).
    """
    local, remote, locality = MemoryKind(local), MemoryKind(remote), Locality(locality)
    if locality is Locality.SAME_PROCESS:
        return Selection("loopback", None, local, remote, locality, "same process: in-process torch copies")
    if cuda_ipc and locality is Locality.SAME_NODE and local is MemoryKind.VRAM and remote is MemoryKind.VRAM:
        return Selection(
            "cuda_ipc",
            "triton",
            local,
            remote,
            locality,
            "VRAM->VRAM on one node through CUDA IPC (NIXL if the connect-time self-test fails)",
        )
    candidates = [b for b in prefer if available is None or b in available]
    if not candidates:
        raise BackendUnavailableError(
            f"none of the preferred NIXL backends {list(prefer)} is available (plugins: {list(available or [])})"
        )
    backend = candidates[0]
    kinds = f"{local.value}->{remote.value}"
    where = "one node" if locality is Locality.SAME_NODE else "across nodes"
    return Selection("nixl", backend, local, remote, locality, f"{kinds} {where} through NIXL/{backend}")


def verify_backend(transport: Any, selection: Selection) -> None:
    """Raise :class:`BackendUnavailableError` unless the selected backend loaded and handles both memory kinds."""
    if selection.transport != "nixl":
        return
    loaded = transport.loaded_backends()
    if selection.backend not in loaded:
        raise BackendUnavailableError(f"NIXL backend {selection.backend} did not load (loaded: {loaded})")
    kinds = {k.removesuffix("_SEG") for k in transport.backend_mem_types(selection.backend)}
    for kind in {selection.local.value, selection.remote.value}:
        if kind not in kinds:
            raise BackendUnavailableError(f"NIXL backend {selection.backend} does not handle {kind} (it does {kinds})")


class SameNodeSelector:
    """The path selector for a same-node fast path: at each handshake it walks the side's fast paths
    (:func:`fast_paths`), and the first that takes the peer carries the link (it logged and reported its choice);
    when all refuse, the side's own transport (NIXL) does, the refusals kept as the choice's reason. A Consumer asks
    it for its reads of each P rank, a Producer for its pushes into each D. Without a registered fast path it
    selects nothing (the choice stays ``None``)."""

    def select(self, primary: Transport, fast: Transport | None, offer: PeerMetadata | None) -> DataPath:
        paths = fast_paths(fast)
        if not paths:
            return DataPath(primary)
        refusals = []
        for path in paths:
            taken = path.try_peer(offer)
            if isinstance(taken, DataPath):
                return taken
            refusals.append((path.name, taken.reason))
        log.info("transport selected: %s (%s)", primary.name,
                 "; ".join(f"{name} not used: {reason}" for name, reason in refusals))
        return DataPath(primary, "", PathChoice(primary.name, "; ".join(reason for _, reason in refusals), {}))


def fast_paths(fast: Transport | None) -> list[FastPath]:
    """The fast paths over ``fast`` (the side's same-node transport, registered over the same KV regions as its own
    one), in the order they are tried: none while it is absent or not registered."""
    if fast is None or getattr(fast, "layout", None) is None:
        return []
    if isinstance(fast, SplitTransport):  # CUDA IPC over the VRAM groups, NIXL over the host ones
        return [SplitCudaIpcPath(fast)]
    # the CUDA IPC transport (the only other one with a layout attribute); loaded lazily, so not named here
    return [CudaIpcPath(fast)]  # type: ignore[arg-type]


def cuda_ipc_fast_path(layout: KVLayout, agent: str, *, logger: logging.Logger, who: str) -> Transport | None:
    """A CUDA IPC transport named ``agent``, registered over ``layout`` (the regions the engine's NIXL transport
    registered), when the KV lives in VRAM; else ``None``. A layout with host-memory groups beside its VRAM ones
    (SGLang's aux rows) gets a :class:`~kvlifecycle.transports.split.SplitTransport`: CUDA IPC over the VRAM
    groups, a NIXL agent of its own (``agent-host``) over the others. Any reason it cannot be built (no torch or
    CUDA, memory that cannot be exported for IPC) is one warning on ``logger``, prefixed ``who``, and leaves NIXL
    alone: a missing fast path must never stop the engine, nor go unnoticed."""
    if layout.kind is not MemoryKind.VRAM:
        return None
    by_kind = L.groups_by_kind(layout)
    try:
        # lazily (it needs torch and CUDA), through the package, which resolves the class on first use
        cuda_ipc = importlib.import_module("kvlifecycle.transports.cuda_ipc")
        fast: Transport = cuda_ipc.CudaIpcTransport(agent)
        if len(by_kind) > 1:  # SGLang's aux rows: CUDA IPC cannot map host memory; one post moves every group
            from .nixl import NixlTransport

            vram = by_kind.pop(MemoryKind.VRAM)
            host = tuple(sorted(g for gs in by_kind.values() for g in gs))
            try:
                fast = SplitTransport(agent, [(fast, vram), (NixlTransport(f"{agent}-host", probe_bytes=0), host)],
                                      epoch=fast.epoch)
            except BaseException:
                fast.close()
                raise
    except (ImportError, RuntimeError, TransportError) as exc:
        logger.warning("%s: no CUDA IPC fast path, NIXL only: %s", who, exc)
        return None
    try:
        fast.register(layout)
    except (RuntimeError, TransportError) as exc:  # e.g. memory that cannot be exported for IPC
        logger.warning("%s: no CUDA IPC fast path, NIXL only: %s", who, exc)
        with contextlib.suppress(RuntimeError, TransportError):  # the failure that matters is logged above
            fast.close()
        return None
    return fast
