"""kvlifecycle: make the KV-cache handoff of prefill/decode disaggregated serving correct by construction and
debuggable after the fact.

The core (this package) imports no torch, NIXL or engine: ledgers, the event log, replay and checks.
Transports live in :mod:`kvlifecycle.transports`, engine adapters in :mod:`kvlifecycle.adapters`.
"""

from kvlifecycle.clock import HybridLogicalClock, ManualClock, MonotonicClock
from kvlifecycle.eventlog import CorruptLogError, EventLog, FsyncPolicy, LogError, LogReader
from kvlifecycle.ledger import (
    BlockBusyError,
    Grant,
    InvalidTransitionError,
    LedgerError,
    Released,
    SourceLedger,
    TargetLedger,
    UnknownRequestError,
    open_ledger,
)
from kvlifecycle.machines import SOURCE_MACHINE, TARGET_MACHINE, SourceState, TargetState
from kvlifecycle.replay import check, check_pair
from kvlifecycle.replay import replay as replay_log  # not "replay": that name is the module kvlifecycle.replay

__version__ = "0.1.0"

__all__ = [
    "SOURCE_MACHINE",
    "TARGET_MACHINE",
    "BlockBusyError",
    "CorruptLogError",
    "EventLog",
    "FsyncPolicy",
    "Grant",
    "HybridLogicalClock",
    "InvalidTransitionError",
    "LedgerError",
    "LogError",
    "LogReader",
    "ManualClock",
    "MonotonicClock",
    "Released",
    "SourceLedger",
    "SourceState",
    "TargetLedger",
    "TargetState",
    "UnknownRequestError",
    "check",
    "check_pair",
    "open_ledger",
    "replay_log",
]
