"""The same-node fast paths over CUDA IPC, each answering one question per peer (:meth:`CudaIpcPath.try_peer`):
CUDA IPC when both sides hold VRAM on one node and the connect-time self-test passes. :class:`CudaIpcPath` is the
plain CUDA IPC transport; :class:`SplitCudaIpcPath` a :class:`~kvlifecycle.transports.split.SplitTransport` whose
part 0 is CUDA IPC over the VRAM groups (NIXL moving the host groups). Both take a peer and report it the same way;
:class:`kvlifecycle.transports.select.SameNodeSelector` walks them and keeps the side's own transport (NIXL) when
they refuse."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec

from kvlifecycle.path_selection import DataPath, PathChoice
from kvlifecycle.transport import KVLayout, Locality, MemoryKind, PeerMetadata, ProbeResult, Transport, TransportError

from ..fast_path import Refusal
from ..selection_report import Selection, on_selected
from ..split import part_offers
from .wire import NAME, PROBE_BYTES, blob_decoder, node_identity

if TYPE_CHECKING:
    from ..split import SplitTransport
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


class CudaIpcPath:
    """CUDA IPC for a peer that offers it, over ``layout`` (the transport's own when not given): the cheap checks
    (:func:`cuda_ipc_possible`), then :meth:`add_peer`'s self-test (a kernel copy of the peer's probe buffer
    through the mapping, bytes checked). A path it takes is logged with what the self-test measured and reported to
    :mod:`~kvlifecycle.transports.selection_report`'s listeners. ``transport`` must be registered already."""

    name = NAME
    how = ""  # what the reported reason adds about the parts

    def __init__(self, transport: CudaIpcTransport | None, layout: KVLayout | None = None) -> None:
        self.transport: Any = transport
        self.layout = layout if layout is not None else getattr(transport, "layout", None)

    def try_peer(self, offer: PeerMetadata | None) -> DataPath | Refusal:
        try:
            ok, reason = self._possible(offer)
        except (TransportError, IndexError) as exc:  # a split offer that does not decode or has no parts
            return Refusal(str(exc) or "the peer's split metadata has no parts")
        if not ok:
            return Refusal(reason)
        assert offer is not None
        if self.transport is None:
            return Refusal("no local cuda_ipc transport")
        try:
            peer: str = self.transport.add_peer(offer)
        except TransportError as exc:
            return Refusal(f"connect-time self-test failed: {exc}")
        ipc, ipc_peer = self._cuda_ipc_part(peer)
        info = ipc.peer_info(ipc_peer)
        kernel = ipc.kernel_backend
        report = Selection(
            self.name,
            kernel,
            MemoryKind.VRAM,
            MemoryKind.VRAM,
            Locality.SAME_NODE,
            f"{reason}; {self.how}self-test passed",
        )
        probe = ProbeResult(peer, PROBE_BYTES, max(info["self_test_us"], 1e-3) / 1e6, f"{NAME}/{kernel}")
        log.info("transport selected: %s for %s (%s; measured %s)", self.name, peer, reason, info)
        on_selected(report, probe)
        return DataPath(self.transport, peer, PathChoice(self.name, reason, info, report, probe))

    def _possible(self, offer: PeerMetadata | None) -> tuple[bool, str]:
        if self.layout is None:
            return False, "the fast path has no registered layout"
        return cuda_ipc_possible(self.layout, offer)

    def _cuda_ipc_part(self, peer: str) -> tuple[CudaIpcTransport, str]:
        """The CUDA IPC transport that maps the peer, and the peer's name on it."""
        return self.transport, peer


class SplitCudaIpcPath(CudaIpcPath):
    """The split fast path (CUDA IPC over the VRAM groups, NIXL over the host ones) for a peer whose offer is split
    the same way, when its CUDA IPC part passes :func:`cuda_ipc_possible` and, adding the peer, its self-test."""

    how = "VRAM groups through CUDA IPC, host groups through NIXL; "

    def __init__(self, transport: SplitTransport) -> None:
        super().__init__(None)
        self.transport = transport
        self.layout = getattr(transport.parts[0], "layout", None)  # CUDA IPC's, registered with the split
        self.name = f"{NAME}+{'+'.join(p.name for p in transport.parts[1:])}"

    def _possible(self, offer: PeerMetadata | None) -> tuple[bool, str]:
        if offer is None:
            return False, "the peer offers no fast-path metadata"
        return super()._possible(part_offers(offer).parts[0])

    def _cuda_ipc_part(self, peer: str) -> tuple[CudaIpcTransport, str]:
        return self.transport.parts[0], self.transport.peer_part(peer, 0)


def select_same_node(
    local: KVLayout,
    cuda_transport: CudaIpcTransport | None,
    remote_cuda_meta: PeerMetadata | None,
    fallback: Callable[[], Transport],
    *,
    fallback_name: str = "nixl",
) -> tuple[Transport, str, PathChoice]:
    """:class:`CudaIpcPath`'s answer for one peer as (transport, peer name or "", choice): CUDA IPC when it takes
    the peer, else ``fallback()`` (NIXL), the refusal logged (the fallback's caller reports its own probe through
    ``selection_report.probe_and_report``)."""
    taken = CudaIpcPath(cuda_transport, local).try_peer(remote_cuda_meta)
    if isinstance(taken, DataPath):
        assert taken.choice is not None
        return taken.transport, taken.peer, taken.choice
    log.info("transport selected: %s (cuda_ipc not used: %s)", fallback_name, taken.reason)
    return fallback(), "", PathChoice(fallback_name, taken.reason, {})
