"""The same-node selection policy: CUDA IPC for a peer when both sides hold VRAM on one node and the connect-time
self-test passes, else the fallback (NIXL). :class:`kvlifecycle.transports.select.SameNodeSelector` is the
Consumer's path selector built on it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from kvlifecycle.path_selection import PathChoice
from kvlifecycle.transport import KVLayout, Locality, MemoryKind, PeerMetadata, ProbeResult, Transport, TransportError

from .wire import NAME, PROBE_BYTES, blob_decoder, node_identity

if TYPE_CHECKING:
    from .transport import CudaIpcTransport

log = logging.getLogger("kvlifecycle.transports.cuda_ipc")

Choice = PathChoice  # which path a connection took, why, and what the self-test measured (the older name)


def cuda_ipc_possible(local: KVLayout, remote: PeerMetadata | None) -> tuple[bool, str]:
    """Cheap checks before any mapping: both sides VRAM, the peer offers cuda_ipc metadata, same node."""
    if local.kind is not MemoryKind.VRAM:
        return False, f"local KV is {local.kind.value}, not VRAM"
    if remote is None or remote.transport != NAME:
        return False, "the peer offers no cuda_ipc metadata"
    if remote.layout.kind != MemoryKind.VRAM.value:
        return False, f"the peer's KV is {remote.layout.kind}, not VRAM"
    try:
        blob = blob_decoder.decode(remote.blob)
    except msgspec.DecodeError as exc:
        return False, f"malformed cuda_ipc metadata: {exc}"
    if blob.host != node_identity():
        return False, f"the peer is on another node ({blob.host})"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device here"
    return True, "same node, VRAM on both sides"


def select_same_node(
    local: KVLayout,
    cuda_transport: CudaIpcTransport | None,
    remote_cuda_meta: PeerMetadata | None,
    fallback: Callable[[], Transport],
    *,
    fallback_name: str = "nixl",
) -> tuple[Transport, str, PathChoice]:
    """Pick the transport for one peer: CUDA IPC when both sides hold VRAM on one node and the connect-time
    self-test (a kernel copy of the peer's probe buffer through the mapping, bytes checked) passes, else
    ``fallback()`` (NIXL). Returns (transport, peer name or "", choice); logs the choice and what it measured and,
    for CUDA IPC, tells :mod:`kvlifecycle.transports.select`'s listeners (the fallback's caller reports its own
    probe through ``select.probe_and_report``). ``cuda_transport`` must be registered already.
    """
    from .. import select

    ok, reason = cuda_ipc_possible(local, remote_cuda_meta)
    if ok and cuda_transport is None:
        ok, reason = False, "no local cuda_ipc transport"
    if ok:
        assert cuda_transport is not None and remote_cuda_meta is not None
        try:
            peer = cuda_transport.add_peer(remote_cuda_meta)
        except TransportError as exc:
            reason = f"connect-time self-test failed: {exc}"
        else:
            info = cuda_transport.peer_info(peer)
            kernel = cuda_transport.kernel_backend
            report = select.Selection(NAME, kernel, MemoryKind.VRAM, MemoryKind.VRAM, Locality.SAME_NODE,
                                      f"{reason}; self-test passed")
            probe = ProbeResult(peer, PROBE_BYTES, max(info["self_test_us"], 1e-3) / 1e6, f"{NAME}/{kernel}")
            log.info("transport selected: %s for %s (%s; measured %s)", NAME, peer, reason, info)
            select.on_selected(report, probe)
            return cuda_transport, peer, PathChoice(NAME, reason, info, report, probe)
    log.info("transport selected: %s (cuda_ipc not used: %s)", fallback_name, reason)
    return fallback(), "", PathChoice(fallback_name, reason, {})
