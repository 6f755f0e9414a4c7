"""Replay an event log into a ledger — to the end, to an event index, or to a point in time — and check it.

A log written by several incarnations of one worker (it restarted and kept its log directory) replays each
incarnation from a fresh ledger; what the previous one left pinned or loading at its crash is reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlifecycle import events as ev
from kvlifecycle.clock import hlc_wall_seconds
from kvlifecycle.eventlog import LogHeader, LogReader, TailRecovery, decode_payloads
from kvlifecycle.invariants import (
    Violation,
    check_merged,
    check_quiescent,
    check_source,
    check_target,
    check_target_events,
)
from kvlifecycle.ledger import SourceLedger, TargetLedger, ledger_from_header


@dataclass
class ReplayResult:
    path: str
    header: LogHeader
    ledger: SourceLedger | TargetLedger
    events: list[ev.Event]
    tail: TailRecovery | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def side(self) -> str:
        return self.ledger.side


def replay(
    path: str | os.PathLike[str],
    *,
    until_index: int | None = None,
    until_time: float | None = None,
    request: str | None = None,
) -> ReplayResult:
    """Fold the log at ``path`` up to (not including) event ``until_index`` or up to wall time ``until_time``
    (seconds since the epoch, compared with the events' HLC). ``request`` keeps only that request's events in
    :attr:`ReplayResult.events` (the ledger still folds everything, so its state is exact)."""
    reader = LogReader(path)
    ledger: SourceLedger | TargetLedger | None = None
    kept: list[ev.Event] = []
    restarts: list[dict[str, Any]] = []
    incarnation: int | None = None
    transfers_of_request: set[str] = set()
    index = 0
    done = False
    for scan in reader.scans():
        scan_incarnation = int(scan.header.get("incarnation", 0))
        events = decode_payloads(scan)
        if until_index is not None and index + len(events) > until_index:
            events = events[: max(0, until_index - index)]
            done = True
        if until_time is not None:
            cut = next((i for i, e in enumerate(events) if hlc_wall_seconds(e.hlc) > until_time), None)
            if cut is not None:
                events = events[:cut]
                done = True
        if events:
            if ledger is None or scan_incarnation != incarnation:
                if ledger is not None:
                    ledger.end_replay()
                    restarts.append(_crash_report(ledger, index, scan.path))
                ledger = ledger_from_header(scan.header)
                ledger.begin_replay()
                incarnation = scan_incarnation
            ledger.apply_all(events)
            if request is None:
                kept += events
            else:
                kept += [e for e in events if _mentions(e, request, transfers_of_request)]
        index += len(events)
        if done:
            break
    if ledger is None:
        ledger = ledger_from_header(reader.header or reader.read_header())
    ledger.end_replay()
    return ReplayResult(str(path), reader.header, ledger, kept, reader.tail, restarts)


def _mentions(event: ev.Event, request: str, transfers: set[str]) -> bool:
    if getattr(event, "request", None) == request:
        transfer = getattr(event, "transfer", "")
        if transfer:
            transfers.add(transfer)
        return True
    return getattr(event, "transfer", None) in transfers


def _crash_report(ledger: SourceLedger | TargetLedger, index: int, segment: Path) -> dict[str, Any]:
    left: dict[str, Any] = {"at_index": index, "segment": str(segment)}
    if isinstance(ledger, SourceLedger):
        left.update(leases=len(ledger.leases), pinned_blocks=int((ledger.pins > 0).sum()))
    else:
        left.update(loads=len(ledger.loads))
    return left


def check(result: ReplayResult, *, quiescent: bool = False) -> list[Violation]:
    ledger = result.ledger
    out = check_source(ledger) if isinstance(ledger, SourceLedger) else check_target(ledger)
    if ledger.side == "target":
        out += check_target_events(result.events)
    if quiescent:
        out += check_quiescent(ledger)
    return out


def check_pair(results: Iterable[ReplayResult]) -> list[Violation]:
    """Cross-side checks over every (source, target) pair among ``results``."""
    results = list(results)
    sources = [r for r in results if r.side == "source"]
    targets = [r for r in results if r.side == "target"]
    out: list[Violation] = []
    for s in sources:
        for t in targets:
            out += [
                Violation(v.rule, f"{s.header.get('worker')} / {t.header.get('worker')}: {v.detail}")
                for v in check_merged(s.events, t.events)
            ]
    return out


def summary(result: ReplayResult) -> dict[str, Any]:
    ledger = result.ledger
    out: dict[str, Any] = {
        "path": result.path,
        "side": ledger.side,
        "worker": result.header.get("worker"),
        "events": len(result.events),
        "blocks": ledger.counts(),
        "requests": len(ledger.requests),
        "stats": dict(ledger.stats),
        "refusals": dict(ledger.refusals),
    }
    if isinstance(ledger, SourceLedger):
        out["leases"] = {
            t: {
                "request": lease.request,
                "blocks": int(lease.blocks.size),
                "consumers_done": sorted(lease.done),
                "expires_at": lease.expires_at,
            }
            for t, lease in ledger.leases.items()
        }
    else:
        out["loads"] = {
            t: {"request": load.request, "parts_done": sorted(load.done), "parts": load.parts}
            for t, load in ledger.loads.items()
        }
    if result.tail is not None:
        out["torn_tail"] = {
            "segment": str(result.tail.segment),
            "offset": result.tail.offset,
            "dropped_bytes": result.tail.dropped_bytes,
            "reason": result.tail.reason,
        }
    if result.restarts:
        out["restarts"] = result.restarts
    return out
