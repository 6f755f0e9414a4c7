"""kvlifecycle: make the KV-cache handoff of prefill/decode disaggregated serving correct by construction and
debuggable after the fact.

The core (this package) imports no torch, NIXL or engine. What an embedder uses is exported here: the ledgers and
their event log, the handoff (:class:`Producer`, :class:`Consumer` and their :class:`HandoffOptions`), the
:class:`Transport` protocol and its value types, the OpenTelemetry instrumentation, logging setup, and replay.
Transports live in :mod:`kvlifecycle.transports`, engine adapters in :mod:`kvlifecycle.adapters`.

The handoff (which needs pyzmq), the instrumentation (OpenTelemetry) and the logging setup (structlog) load on
first use, so ``import kvlifecycle.ledger`` stays as cheap as the ledger.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvlifecycle._version import __version__ as __version__  # the one place it is written
from kvlifecycle.choices import LoadFailurePolicy, Side, TransferMode
from kvlifecycle.clock import HybridLogicalClock, ManualClock, MonotonicClock
from kvlifecycle.eventlog import (
    CorruptLogError,
    EventLog,
    FsyncMode,
    FsyncPolicy,
    LogError,
    LogFullError,
    LogLockedError,
    LogReader,
    LogWriteError,
)
from kvlifecycle.invariants import Violation
from kvlifecycle.ledger import (
    BlockBusyError,
    Grant,
    InvalidTransitionError,
    LedgerError,
    Released,
    ReplayError,
    SourceLedger,
    TargetLedger,
    UnknownRequestError,
    open_ledger,
)
from kvlifecycle.machines import SOURCE_MACHINE, TARGET_MACHINE, SourceState, TargetState
from kvlifecycle.replay import ReplayResult, check, check_pair
from kvlifecycle.replay import replay as replay_log  # not "replay": that name is the module kvlifecycle.replay
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BackendUnavailableError,
    BlockView,
    HandleReleasedError,
    KVLayout,
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

if TYPE_CHECKING:
    from kvlifecycle.handoff import Consumer, GrantReply, HandoffOptions, PeerLink, Producer
    from kvlifecycle.handshake import CompatInfo, CompatMismatchError
    from kvlifecycle.logs import configure as configure_logging
    from kvlifecycle.logs import get_logger, log_events
    from kvlifecycle.logs import unconfigure as unconfigure_logging
    from kvlifecycle.telemetry import Instrumentation, instrument, instrument_from_env, instrument_to_files

# name -> (module, attribute): loaded on first use
_LAZY: dict[str, tuple[str, str]] = {
    "Consumer": ("kvlifecycle.handoff", "Consumer"),
    "GrantReply": ("kvlifecycle.handoff", "GrantReply"),
    "HandoffOptions": ("kvlifecycle.handoff", "HandoffOptions"),
    "PeerLink": ("kvlifecycle.handoff", "PeerLink"),
    "Producer": ("kvlifecycle.handoff", "Producer"),
    "CompatInfo": ("kvlifecycle.handshake", "CompatInfo"),
    "CompatMismatchError": ("kvlifecycle.handshake", "CompatMismatchError"),
    "configure_logging": ("kvlifecycle.logs", "configure"),
    "unconfigure_logging": ("kvlifecycle.logs", "unconfigure"),
    "get_logger": ("kvlifecycle.logs", "get_logger"),
    "log_events": ("kvlifecycle.logs", "log_events"),
    "Instrumentation": ("kvlifecycle.telemetry", "Instrumentation"),
    "instrument": ("kvlifecycle.telemetry", "instrument"),
    "instrument_from_env": ("kvlifecycle.telemetry", "instrument_from_env"),
    "instrument_to_files": ("kvlifecycle.telemetry", "instrument_to_files"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(importlib.import_module(module), attribute)
        globals()[name] = value  # once loaded, an ordinary module attribute
        return value
    raise AttributeError(f"module 'kvlifecycle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "SOURCE_MACHINE",
    "TARGET_MACHINE",
    "WHOLE_BLOCK",
    "BackendUnavailableError",
    "BlockBusyError",
    "BlockView",
    "CompatInfo",
    "CompatMismatchError",
    "Consumer",
    "CorruptLogError",
    "EventLog",
    "FsyncMode",
    "FsyncPolicy",
    "Grant",
    "GrantReply",
    "HandleReleasedError",
    "HandoffOptions",
    "HybridLogicalClock",
    "Instrumentation",
    "InvalidTransitionError",
    "KVLayout",
    "LedgerError",
    "LoadFailurePolicy",
    "Locality",
    "LogError",
    "LogFullError",
    "LogLockedError",
    "LogReader",
    "LogWriteError",
    "MalformedNotificationError",
    "ManualClock",
    "MemoryKind",
    "MonotonicClock",
    "Notification",
    "PeerEpochError",
    "PeerLink",
    "PeerMetadata",
    "PreparedPlan",
    "ProbeResult",
    "Producer",
    "RegistrationError",
    "Released",
    "RemoteMismatchError",
    "ReplayError",
    "ReplayResult",
    "Side",
    "SourceLedger",
    "SourceState",
    "TargetLedger",
    "TargetState",
    "TransferFailedError",
    "TransferHandle",
    "TransferMode",
    "Transport",
    "TransportError",
    "UnknownPeerError",
    "UnknownRequestError",
    "Violation",
    "XferOp",
    "XferStats",
    "XferStatus",
    "check",
    "check_pair",
    "configure_logging",
    "get_logger",
    "instrument",
    "instrument_from_env",
    "instrument_to_files",
    "log_events",
    "open_ledger",
    "replay_log",
    "unconfigure_logging",
]
