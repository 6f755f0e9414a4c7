"""Transport implementations (import name ``kvlifecycle.transports``) and a re-export of the core protocol.

Implementations import torch / nixl, so they are loaded lazily: ``from kvlifecycle.transports import
NixlTransport`` imports NIXL only then.
"""

from __future__ import annotations

from typing import Any

from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BackendUnavailableError,
    BlockView,
    HandleReleasedError,
    KVLayout,
    LayoutWire,
    Locality,
    MalformedNotificationError,
    MemoryKind,
    Notification,
    PeerEpochError,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    RegistrationError,
    RemoteMismatchError,
    TransferFailedError,
    TransferHandle,
    Transport,
    TransportError,
    UnknownPeerError,
    XferOp,
    XferStats,
    XferStatus,
)

__all__ = [
    "WHOLE_BLOCK",
    "BackendUnavailableError",
    "BlockView",
    "CudaIpcTransport",
    "HandleReleasedError",
    "KVLayout",
    "LayoutWire",
    "Locality",
    "LoopbackTransport",
    "MalformedNotificationError",
    "MemoryKind",
    "NixlTransport",
    "Notification",
    "PeerEpochError",
    "PeerMetadata",
    "PreparedPlan",
    "ProbeResult",
    "RegistrationError",
    "RemoteMismatchError",
    "TransferFailedError",
    "TransferHandle",
    "Transport",
    "TransportError",
    "UnknownPeerError",
    "XferOp",
    "XferStats",
    "XferStatus",
]

_LAZY = {"LoopbackTransport": ".loopback", "NixlTransport": ".nixl", "CudaIpcTransport": ".cuda_ipc.transport"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
