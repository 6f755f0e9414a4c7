"""How a path choice is reported: the :class:`Selection` record, the listeners observability hooks in with
(:func:`add_listener`, ``fn(selection, probe)``: the OTel event goes there), and the connect-time probe's report
(a slow path below the floor is a warning, so it is never silent).

A leaf: it imports no selector and no transport, so the selector (:mod:`kvlifecycle.transports.select`) and every
fast path (:mod:`kvlifecycle.transports.cuda_ipc.selection`) report through it without importing each other.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvlifecycle.transport import Locality, MemoryKind, ProbeResult, TransportError

log = logging.getLogger("kvlifecycle.transports.select")

DEFAULT_FLOOR_GBPS = 1.0


@dataclass(frozen=True, slots=True)
class Selection:
    transport: str  # "loopback" | "nixl" | "cuda_ipc" | "cuda_ipc+nixl"
    backend: str | None  # the NIXL backend or the CUDA IPC kernel, None for loopback
    local: MemoryKind
    remote: MemoryKind
    locality: Locality
    reason: str


Listener = Callable[[Selection, "ProbeResult | None"], None]
_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    """Called with every selection (and its probe, once measured): observability emits its OTel event here."""
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
