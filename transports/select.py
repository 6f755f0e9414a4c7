"""Backend selection: which transport and NIXL backend for a pair of memory kinds and a locality; verify the plugin
really loaded; at connect time move a small test payload, record its bandwidth, and warn below a floor so a silent
slow path is never silent. :class:`SameNodeSelector` is the path selector
(:class:`kvlifecycle.path_selection.PathSelector`) for a same-node fast path: a Consumer's for its reads, a
Producer's for its pushes. :func:`cuda_ipc_fast_path` builds that fast path for an engine adapter (vLLM, SGLang).

Observability hooks in with :func:`add_listener` (``fn(selection, probe)``): the OTel event goes there.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvlifecycle import layout as L
from kvlifecycle.path_selection import DataPath, PathChoice
from kvlifecycle.transport import (
    BackendUnavailableError,
    KVLayout,
    Locality,
    MemoryKind,
    PeerMetadata,
    ProbeResult,
    Transport,
    TransportError,
)

log = logging.getLogger("kvlifecycle.transports.select")

DEFAULT_FLOOR_GBPS = 1.0


@dataclass(frozen=True, slots=True)
class Selection:
    transport: str  # "loopback" | "nixl"
    backend: str | None  # the NIXL backend, None for loopback
    local: MemoryKind
    remote: MemoryKind
    locality: Locality
    reason: str


Listener = Callable[[Selection, "ProbeResult | None"], None]
_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    """Called with every selection (and its probe, once measured): the observability issue emits OTel here."""
    _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def on_selected(
    selection: Selection, probe: ProbeResult | None, *, peer: str = "", floor_gbps: float = DEFAULT_FLOOR_GBPS
) -> None:
    """Report a choice: an OpenTelemetry span/metrics (see ``kvlifecycle.telemetry.record_path_selection``), then
    every registered listener."""
    from kvlifecycle.telemetry import record_path_selection

    try:
        record_path_selection(
            peer=peer or (probe.peer if probe is not None else ""),
            transport=selection.transport,
            backend=probe.backend if probe is not None else selection.backend,
            reason=selection.reason,
            gbps=probe.gbps if probe is not None else None,
            probe_bytes=probe.bytes if probe is not None else 0,
            floor_gbps=floor_gbps,
        )
    except Exception:  # observability must never break a connection
        log.exception("recording the path selection failed")
    for fn in list(_listeners):
        try:
            fn(selection, probe)
        except Exception:  # an observer must never break a connection
            log.exception("on_selected listener failed")


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
      :func:`kvlifecycle.transports.cuda_ipc.select_same_node` (behind :class:`SameNodeSelector`) falls back to
      NIXL when it fails;
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


def probe_and_report(
    transport: Any,
    peer: str,
    selection: Selection,
    *,
    floor_gbps: float = DEFAULT_FLOOR_GBPS,
    timeout_s: float = 5.0,
) -> ProbeResult | None:
    """Move the connect-time test payload, log it, warn below ``floor_gbps``, and tell the listeners.

    A probe that cannot run is logged and reported as ``None``: it never blocks a connection."""
    try:
        result = transport.probe(peer, timeout_s=timeout_s)
    except TransportError as exc:
        log.warning("connect-time probe of %s failed: %s", peer, exc)
        on_selected(selection, None, peer=peer, floor_gbps=floor_gbps)
        return None
    if selection.backend and result.backend not in (selection.backend, "?"):
        log.warning("NIXL chose backend %s for %s, selection said %s", result.backend, peer, selection.backend)
    if result.gbps < floor_gbps:
        log.warning(
            "slow path to %s: %.3f GB/s over %s (%d bytes) is below the floor of %.3f GB/s (%s)",
            peer,
            result.gbps,
            result.backend,
            result.bytes,
            floor_gbps,
            selection.reason,
        )
    else:
        log.info("path to %s: %.3f GB/s over %s", peer, result.gbps, result.backend)
    on_selected(selection, result, peer=peer, floor_gbps=floor_gbps)
    return result


class SameNodeSelector:
    """The path selector for a same-node fast path: at each handshake, CUDA IPC for a peer that offers it when both
    sides hold VRAM on one node and the connect-time self-test passes
    (:func:`kvlifecycle.transports.cuda_ipc.select_same_node`, which logs the choice and tells the listeners); else
    the side's own transport (NIXL). A Consumer asks it for its reads of each P rank, a Producer for its pushes into
    each D. Without a registered fast path it selects nothing (the choice stays ``None``)."""

    def select(self, primary: Transport, fast: Transport | None, offer: PeerMetadata | None) -> DataPath:
        layout = getattr(fast, "layout", None)
        if fast is None or layout is None:
            return DataPath(primary)
        from .cuda_ipc.selection import select_same_node
        from .split import SplitTransport

        if isinstance(fast, SplitTransport):  # CUDA IPC over the VRAM groups, NIXL over the host ones
            return _select_split(primary, fast, offer)

        # fast is the CUDA IPC transport (the only one with a layout attribute); imported lazily, so not named here
        chosen, peer, choice = select_same_node(layout, fast, offer, lambda: primary,  # type: ignore[arg-type]
                                                fallback_name=primary.name)
        return DataPath(chosen, peer, choice)


def _select_split(primary: Transport, fast: Any, offer: PeerMetadata | None) -> DataPath:
    """The split fast path (:func:`cuda_ipc_fast_path` over VRAM pages and host rows) for a peer whose offer is
    split the same way, when its VRAM part passes CUDA IPC's checks and, adding the peer, its self-test; else
    ``primary``. Logged and reported as CUDA IPC's own choice is."""
    from .cuda_ipc.selection import cuda_ipc_possible
    from .cuda_ipc.wire import NAME as CUDA_IPC
    from .cuda_ipc.wire import PROBE_BYTES
    from .split import part_offers

    backend = f"{CUDA_IPC}+{'+'.join(p.name for p in fast.parts[1:])}"
    try:
        ok, reason = cuda_ipc_possible(fast.parts[0].layout, part_offers(offer).parts[0]) if offer is not None \
            else (False, "the peer offers no fast-path metadata")
    except (TransportError, IndexError) as exc:
        ok, reason = False, str(exc) or "the peer's split metadata has no parts"
    if ok:
        assert offer is not None
        try:
            peer = fast.add_peer(offer)
        except TransportError as exc:
            reason = f"connect-time self-test failed: {exc}"
        else:
            info = fast.parts[0].peer_info(fast.peer_part(peer, 0))
            kernel = fast.parts[0].kernel_backend
            report = Selection(backend, kernel, MemoryKind.VRAM, MemoryKind.VRAM, Locality.SAME_NODE,
                               f"{reason}; VRAM groups through CUDA IPC, host groups through NIXL; self-test passed")
            probe = ProbeResult(peer, PROBE_BYTES, max(info["self_test_us"], 1e-3) / 1e6, f"{CUDA_IPC}/{kernel}")
            log.info("transport selected: %s for %s (%s; measured %s)", backend, peer, reason, info)
            on_selected(report, probe)
            return DataPath(fast, peer, PathChoice(backend, reason, info, report, probe))
    log.info("transport selected: %s (%s not used: %s)", primary.name, backend, reason)
    return DataPath(primary, "", PathChoice(primary.name, reason, {}))


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
            from .split import SplitTransport

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
