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
    check_shared_leases,
    check_source,
    check_target,
    check_target_events,
)
from kvlifecycle.ledger import SourceLedger, TargetLedger, ledger_from_header
from kvlifecycle.machines import HostSlotState
from kvlifecycle.staging_checks import (
    STAGED,
    check_staging,
    check_staging_events,
    check_staging_merged,
    check_staging_quiescent,
)
from kvlifecycle.staging_ledger import StagingLedger

AnyLedger = SourceLedger | TargetLedger | StagingLedger


@dataclass
class ReplayResult:
    path: str
    header: LogHeader
    ledger: AnyLedger
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
    ledger: AnyLedger | None = None
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
                ledger = _ledger_for(scan.header)
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
        ledger = _ledger_for(reader.header or reader.read_header())
    ledger.end_replay()
    return ReplayResult(str(path), reader.header, ledger, kept, reader.tail, restarts)


def _ledger_for(header: LogHeader) -> AnyLedger:
    """The empty ledger a log's header describes: P's or D's, or P's host staging pool."""
    if isinstance(header, dict) and header.get("side") == StagingLedger.side:
        return StagingLedger.from_header(header)
    return ledger_from_header(header)


def _mentions(event: ev.Event, request: str, transfers: set[str]) -> bool:
    if getattr(event, "request", None) == request:
        transfer = getattr(event, "transfer", "")
        if transfer:
            transfers.add(transfer)
        return True
    return getattr(event, "transfer", None) in transfers


def _crash_report(ledger: AnyLedger, index: int, segment: Path) -> dict[str, Any]:
    left: dict[str, Any] = {"at_index": index, "segment": str(segment)}
    if isinstance(ledger, StagingLedger):  # a copy left STAGING died with the process: never served
        left.update(staged_copies=len(ledger.requests), slots_held=ledger.occupancy())
    elif isinstance(ledger, SourceLedger):
        left.update(leases=len(ledger.leases), pinned_blocks=int((ledger.pins > 0).sum()))
    else:
        left.update(loads=len(ledger.loads))
    return left


def check(result: ReplayResult, *, quiescent: bool = False) -> list[Violation]:
    ledger = result.ledger
    if isinstance(ledger, StagingLedger):
        out = check_staging(ledger) + check_staging_events(
            result.events, restarts=[int(r["at_index"]) for r in result.restarts])
        return out + (check_staging_quiescent(ledger) if quiescent else [])
    out = check_source(ledger) if isinstance(ledger, SourceLedger) else check_target(ledger)
    if ledger.side == "target":
        out += check_target_events(result.events)
    if quiescent:
        out += check_quiescent(ledger)
    return out


def check_pair(results: Iterable[ReplayResult]) -> list[Violation]:
    """Cross-side checks over every (source, target) pair among ``results``, and over each source with every target
    at once (a lease several D ranks read: :func:`~kvlifecycle.invariants.check_shared_leases`)."""
    results = list(results)
    sources = [r for r in results if r.side == "source"]
    targets = [r for r in results if r.side == "target"]
    out: list[Violation] = []
    for s in sources:
        for t in targets:
            out += [
                Violation(v.rule, f"{s.header.get('worker')} / {t.header.get('worker')}: {v.detail}")
                for v in check_merged(s.events, t.events,
                                      target_restarts=[int(r["at_index"]) for r in t.restarts])
            ]
        logs = [(str(t.header.get("worker")), t.events, [int(r["at_index"]) for r in t.restarts]) for t in targets]
        out += [Violation(v.rule, f"{s.header.get('worker')}: {v.detail}") for v in check_shared_leases(s.events, logs)]
    return out + _check_staged(sources, [r for r in results if r.side == StagingLedger.side], targets)


def _check_staged(sources: list[ReplayResult], pools: list[ReplayResult],
                  targets: list[ReplayResult]) -> list[Violation]:
    """Each P that handed leases to its host pool, against that pool's log (none given: every hand-over is
    unaccounted for) and every D."""
    out: list[Violation] = []
    for s in sources:
        if not any(isinstance(e, ev.SrcLeaseReleased) and e.reason == STAGED for e in s.events):
            continue
        worker = s.header.get("worker")
        staged = [e for p in pools if p.header.get("source_worker") == worker for e in p.events]
        reads = [e for t in targets for e in t.events]
        out += [Violation(v.rule, f"{worker}: {v.detail}") for v in check_staging_merged(s.events, staged, reads)]
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
    if isinstance(ledger, StagingLedger):
        out["staged"] = {
            t: {"request": c.request, "slots": int(c.blocks.size), "state": HostSlotState(c.state).name,
                "readers": c.readers, "expires_at": c.expires_at}
            for t, c in ledger.requests.items()
        }
    elif isinstance(ledger, SourceLedger):
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
