"""The ledgers: block state, epochs, ownership tokens and leases for each side of a handoff.

Each command validates against the compiled machine (:mod:`kvlifecycle.machines`), then records exactly one event:
the change itself, or a :class:`~kvlifecycle.events.Refused` saying why nothing changed. State is a fold over the
events (:meth:`SourceLedger.fold`), so a log replays to the very state the live ledger had.

Tokens: every (re)allocation of a block gives it a new, larger epoch; a lease (transfer) records the epoch of the
blocks it pins and a ledger-wide ``generation``. Completions, heartbeats and failures name ``(transfer,
generation)``; anything stale — an unknown or released transfer, an old generation — is refused, never applied.
A lease lives only while its blocks are pinned, and a pinned block cannot be reallocated, so a token that names a
live lease names the blocks' current epochs too (``invariants.check_source`` verifies exactly that).

Hot path: while a request holds its blocks exclusively its state is one scalar checked against the compiled table;
the block array records ownership at allocation and the final state at release, and :attr:`state` derives the exact
per-block view. Blocks shared by several requests (prefix hits) take the vectorised per-block path.

This module is the ledgers' public face: the shared base is :mod:`kvlifecycle.ledger_base`, each side its own
module (:mod:`kvlifecycle.source_ledger`, :mod:`kvlifecycle.target_ledger`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Literal, overload

from kvlifecycle.blockids import MAX_BLOCKS
from kvlifecycle.choices import Side, SideName

if TYPE_CHECKING:
    from kvlifecycle.eventlog import FsyncPolicy, LogHeader

from kvlifecycle.ledger_base import (
    BLOCK_DTYPE,
    DEFAULT_TTL_S,
    BlockBusyError,
    Grant,
    InvalidBlockIdsError,
    InvalidTransitionError,
    Lease,
    LedgerError,
    Load,
    Released,
    ReplayError,
    UnknownRequestError,
)
from kvlifecycle.source_ledger import SourceLedger
from kvlifecycle.target_ledger import TargetLedger

__all__ = [
    "BLOCK_DTYPE", "DEFAULT_TTL_S", "BlockBusyError", "Grant", "InvalidBlockIdsError", "InvalidTransitionError",
    "Lease", "LedgerError", "Load", "Released", "ReplayError", "SourceLedger", "TargetLedger",
    "UnknownRequestError", "ledger_from_header", "open_ledger",
]


# The side, when the caller names it, fixes the class: open_ledger("target", ...) is a TargetLedger.
@overload
def open_ledger(side: Literal[Side.SOURCE, "source"], num_blocks: int, log_dir: str | os.PathLike[str] | None = ...,
                *, fsync: FsyncPolicy | str = ..., **kwargs: Any) -> SourceLedger: ...
@overload
def open_ledger(side: Literal[Side.TARGET, "target"], num_blocks: int, log_dir: str | os.PathLike[str] | None = ...,
                *, fsync: FsyncPolicy | str = ..., **kwargs: Any) -> TargetLedger: ...
@overload
def open_ledger(side: Side | SideName, num_blocks: int, log_dir: str | os.PathLike[str] | None = ...,
                *, fsync: FsyncPolicy | str = ..., **kwargs: Any) -> SourceLedger | TargetLedger: ...


def open_ledger(
    side: Side | SideName,
    num_blocks: int,
    log_dir: str | os.PathLike[str] | None = None,
    *,
    fsync: FsyncPolicy | str = "10ms",
    **kwargs: Any,
) -> SourceLedger | TargetLedger:
    """A ledger for ``side`` (``"source"`` or ``"target"``; anything else is a ``ValueError``) with an event log in
    ``log_dir`` (or none). The log header records what replay needs."""
    from kvlifecycle.eventlog import EventLog

    cls: type[SourceLedger] | type[TargetLedger] = (
        SourceLedger if Side.parse(side, "side") is Side.SOURCE else TargetLedger
    )
    ledger = cls(num_blocks, **kwargs)
    if log_dir is not None:
        ledger.log = EventLog(log_dir, header=ledger.header(), fsync=fsync)
    return ledger


def ledger_from_header(header: LogHeader) -> SourceLedger | TargetLedger:
    """The empty ledger a log's header describes. A header no ledger could have written (no side, no or a
    non-positive block count, a worker that is not a name, an unknown failure policy) is a :class:`ReplayError`."""
    if not isinstance(header, dict):
        raise ReplayError(f"log header is not a map: {type(header).__name__}")
    side = header.get("side")
    if side not in ("source", "target"):
        raise ReplayError(f"log header names no known side: {side!r}")
    num_blocks = header.get("num_blocks")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
        raise ReplayError(f"log header's num_blocks is not an integer: {num_blocks!r}")
    if not 0 < num_blocks <= MAX_BLOCKS:
        raise ReplayError(f"log header's num_blocks {num_blocks} is not in [1, {MAX_BLOCKS}]")
    worker = header.get("worker", "")
    if not isinstance(worker, str):
        raise ReplayError(f"log header's worker is not a name: {worker!r}")
    try:
        if side == "source":
            return SourceLedger(num_blocks, worker=worker)
        return TargetLedger(num_blocks, worker=worker, failure_policy=header.get("failure_policy", "fail"))
    except (ValueError, TypeError) as exc:
        raise ReplayError(f"log header describes no ledger: {exc}") from exc
    except MemoryError:
        raise ReplayError(f"log header's pool of {num_blocks} blocks does not fit in memory") from None
