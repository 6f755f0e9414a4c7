"""Invariant checks of the host staging tier: the pool's ledger, its log, and its log merged with P's and D's.

Independent of the ledger code (they recompute from the events), like :mod:`kvlifecycle.invariants`:

- ``staged-before-copy``: P released a GPU lease as ``staged`` before the staging log recorded its copy complete;
- ``staged-while-claimed``: P released as ``staged`` a lease a consumer had claimed (it may be reading the GPU
  copy) or completed;
- ``staged-under-reader``: P released as ``staged`` a lease while D's pull of it, started before, had not ended;
- ``served-half-written``: a staged copy served before its copy completed (in the same incarnation of P);
- ``served-expired``: a staged copy served (or its lease renewed) at or after its lease's expiry;
- ``slot-reused``: a slot staged into while another copy still held it (its lease not ended);
- ``staged-read-unserved``: D started reading a transfer after P handed its GPU lease over, with no claim of the
  staged copy before (D read GPU blocks P had given back);
- ``staged-read-outlived-lease``: a staged copy's lease expired while D's read of it had not ended.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.invariants import Violation
from kvlifecycle.machines import HostSlotState
from kvlifecycle.staging_ledger import StagingLedger

STAGED = "staged"  # the reason P's source ledger releases a GPU lease with when its staged copy took it over


def check_staging(ledger: StagingLedger) -> list[Violation]:
    """The pool's ledger agrees with itself: each copy's slots are in its state, held by it alone; no slot is
    held by no copy; a copy is SERVING exactly while a read is in flight."""
    state = ledger.state
    out: list[Violation] = []
    holders = np.zeros(ledger.num_blocks, dtype=np.int64)
    for transfer, copy in ledger.requests.items():
        holders[copy.blocks] += 1
        wrong = state[copy.blocks] != copy.state
        if wrong.any():
            out.append(Violation("slot-state", f"copy {transfer}: slot {int(copy.blocks[int(np.argmax(wrong))])} "
                                               f"is not {HostSlotState(copy.state).name}"))
        if (copy.state == HostSlotState.SERVING) != (copy.readers > 0):
            out.append(Violation("serving-readers", f"copy {transfer} is {HostSlotState(copy.state).name} with "
                                                    f"{copy.readers} read(s) in flight"))
    if (holders > 1).any():
        out.append(Violation("slot-two-copies", f"slot {int(np.argmax(holders > 1))} held by two copies"))
    stray = (state != HostSlotState.FREE) & (holders == 0)
    if stray.any():
        out.append(Violation("held-without-owner", f"slot {int(np.argmax(stray))} is not FREE and no copy holds it"))
    return out


def check_staging_quiescent(ledger: StagingLedger) -> list[Violation]:
    """At quiescence the pool is empty."""
    if ledger.requests:
        return [Violation("quiescent-staged", f"{len(ledger.requests)} staged cop(ies) left: "
                                              f"{sorted(ledger.requests)[:5]}")]
    return []


@dataclass
class _Copy:
    slots: frozenset[int]
    expires_at: float
    whole: bool = False
    ended: bool = False


def check_staging_events(events: Iterable[ev.Event], *, restarts: Sequence[int] = ()) -> list[Violation]:
    """One staging log, event by event: nothing served half-written or past its expiry, no slot reused while
    held. ``restarts``: positions where a new incarnation of P begins (its pool starts empty)."""
    out: list[Violation] = []
    copies: dict[str, _Copy] = {}
    held: dict[int, str] = {}  # slot -> the transfer whose copy holds it
    boundaries = set(restarts)
    for i, e in enumerate(events):
        if i in boundaries:
            copies, held = {}, {}
        if isinstance(e, ev.StgStarted):
            slots = frozenset(ev.unpack_blocks(e.blocks).tolist())
            taken = sorted(s for s in slots if s in held)
            if taken:
                out.append(Violation("slot-reused", f"copy {e.transfer} staged into slot {taken[0]}, still held by "
                                                    f"copy {held[taken[0]]}"))
            copies[e.transfer] = _Copy(slots, e.expires_at)
            held.update(dict.fromkeys(slots, e.transfer))
        elif isinstance(e, ev.StgCompleted) and e.transfer in copies:
            copies[e.transfer].whole = True
        elif isinstance(e, ev.StgServed):
            copy = copies.get(e.transfer)
            if copy is None or not copy.whole:
                out.append(Violation("served-half-written", f"copy {e.transfer} served before its copy completed"))
            elif e.at >= copy.expires_at:
                out.append(Violation("served-expired", f"copy {e.transfer} served at {e.at:.3f}, its lease expired "
                                                       f"at {copy.expires_at:.3f}"))
            if copy is not None:
                copy.expires_at = max(copy.expires_at, e.expires_at)
        elif isinstance(e, ev.StgRenewed) and e.transfer in copies:
            copy = copies[e.transfer]
            if e.at >= copy.expires_at:
                out.append(Violation("served-expired", f"copy {e.transfer} renewed at {e.at:.3f}, its lease "
                                                       f"expired at {copy.expires_at:.3f}"))
            copy.expires_at = max(copy.expires_at, e.expires_at)
        elif isinstance(e, ev.StgAborted | ev.StgReleased):
            copy = copies.pop(e.transfer, None)
            if copy is not None:
                for slot in copy.slots:
                    if held.get(slot) == e.transfer:
                        del held[slot]
    return out


@dataclass
class _Handover:
    hlc: int
    claimed: bool


@dataclass
class _StagedLife:
    completed_hlc: int | None = None
    served_hlc: list[int] = field(default_factory=list)
    released: tuple[int, str] | None = None


def check_staging_merged(
    source_events: Iterable[ev.Event],
    staging_events: Iterable[ev.Event],
    target_events: Iterable[ev.Event] = (),
) -> list[Violation]:
    """P's source log with its staging log (same worker), and D's log when given (HLC-ordered stamps)."""
    out: list[Violation] = []
    claimed: set[str] = set()
    handovers: dict[str, _Handover] = {}
    for e in source_events:
        if (isinstance(e, ev.SrcLeaseRenewed) and e.claims) or isinstance(e, ev.SrcConsumerDone):
            claimed.add(e.transfer)
        elif isinstance(e, ev.SrcLeaseReleased) and e.reason == STAGED:
            handovers[e.transfer] = _Handover(e.hlc, e.transfer in claimed)
    lives: dict[str, _StagedLife] = {}
    for e in staging_events:
        if isinstance(e, ev.StgStarted):
            lives[e.transfer] = _StagedLife()
        elif isinstance(e, ev.StgCompleted) and e.transfer in lives:
            lives[e.transfer].completed_hlc = e.hlc
        elif isinstance(e, ev.StgServed) and e.transfer in lives:
            lives[e.transfer].served_hlc.append(e.hlc)
        elif isinstance(e, ev.StgAborted | ev.StgReleased) and e.transfer in lives:
            lives[e.transfer].released = (e.hlc, e.reason)
    for transfer, handover in handovers.items():
        life = lives.get(transfer)
        if life is None or life.completed_hlc is None or life.completed_hlc > handover.hlc:
            out.append(Violation("staged-before-copy", f"P released the GPU blocks of {transfer} as staged before "
                                                       "its copy to host completed"))
        if handover.claimed:
            out.append(Violation("staged-while-claimed", f"P released the GPU blocks of {transfer} as staged after "
                                                         "a consumer claimed them"))
    out += _against_reads(handovers, lives, list(target_events))
    return out


def _against_reads(handovers: dict[str, _Handover], lives: dict[str, _StagedLife],
                   target_events: list[ev.Event]) -> list[Violation]:
    out: list[Violation] = []
    started: dict[str, int] = {}
    ended: dict[str, int] = {}
    for e in target_events:
        if isinstance(e, ev.TgtLoadStarted) and e.mode == "pull":
            started[e.transfer] = e.hlc
            ended.pop(e.transfer, None)
        elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed | ev.TgtLoadDeclined) and e.transfer in started:
            ended.setdefault(e.transfer, e.hlc)
    for transfer, start in started.items():
        handover = handovers.get(transfer)
        if handover is None:
            continue
        end = ended.get(transfer)
        if start < handover.hlc and (end is None or end > handover.hlc):
            out.append(Violation("staged-under-reader", f"P released the GPU blocks of {transfer} as staged while "
                                                        "D's read of them was in flight"))
        life = lives.get(transfer)
        if start > handover.hlc:
            if life is None or not any(hlc < start for hlc in life.served_hlc):
                out.append(Violation("staged-read-unserved", f"D started reading {transfer} after P handed its GPU "
                                                             "blocks over, without a claim of the staged copy"))
            elif (life.released is not None and life.released[1] == "expired" and life.released[0] > start
                  and end is not None and end > life.released[0]):
                out.append(Violation("staged-read-outlived-lease", f"the staged copy of {transfer} expired while "
                                                                   "D was reading it"))
    return out
