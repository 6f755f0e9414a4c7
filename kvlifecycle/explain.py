"""Explanations: for everything wrong in a set of logs, the shortest chain of events that leads to it and one
sentence that says what happened.

What counts as wrong:

* a lease P let go of while D was still reading under it (released as failed or cancelled under a pull, or freed
  after an expiry and then completed by D anyway: the bytes D kept may belong to the blocks' next owner, vLLM
  #21570), a lease P expired before D's read under it ended (D must cancel a read before P's expiry can free its
  blocks: a read never outlives its lease), and a load D started after P had already released the lease it reads;
* a load that never completed (no last part and no failure by the end of D's log, or D restarted with it in
  flight);
* a load whose landed bytes failed their digest (:mod:`kvlifecycle.digest`): refused before attention read them,
  but the data plane moved wrong bytes, wrote into the wrong slot or the wrong heads;
* a block still pinned by a lease whose deadline had passed when P's log ends (no sweep released it);
* a request that did not end: P still holds its blocks, or D holds them short of READY_FOR_ATTENTION;
* any other violation ``replay --check`` finds (:mod:`kvlifecycle.invariants`), with the events it names.

A log torn at its tail (the worker died in the middle of a write) is the first finding: what it did after the tear
is unknown. Work a torn log, or a log cut by ``until``, leaves open at its end is reported as in flight
(:data:`IN_FLIGHT`, not a finding): a request that did not end there may well have ended a moment later.

Refusals are not findings: a refused late completion is the ledger doing its job. They appear in the chains, where
they are part of what happened. Every time in a sentence is milliseconds since the first event of all the logs, on
the axis ``kvlifecycle timeline`` draws.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, TypedDict

from kvlifecycle import events as ev
from kvlifecycle.invariants import READ_OUTLIVED_LEASE as READ_OUTLIVED_LEASE
from kvlifecycle.invariants import Violation
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.replay import ReplayResult, check, check_pair
from kvlifecycle.story import (
    LeaseSummary,
    Step,
    Trace,
    block_ranges,
    digest_words,
    request_story,
    requests_of,
    step_view,
    trace_logs,
)
from kvlifecycle.transfer_ids import source_transfers

# rules this module derives from the events itself; ``replay --check`` reports the first two and the expiry under a
# read (READ_OUTLIVED_LEASE, which a completion after the blocks were let go explains as COMPLETED_AFTER_RELEASE)
RELEASED_UNDER_READER = "released-under-reader"
READ_AFTER_RELEASE = "read-after-release"
COMPLETED_AFTER_RELEASE = "completed-after-release"
LOAD_NEVER_COMPLETED = "load-never-completed"
PINNED_PAST_LEASE = "pinned-past-lease"
REQUEST_DID_NOT_END = "request-did-not-end"
LOG_TORN = "log-torn"
DIGEST_MISMATCH = "digest-mismatch"
IN_FLIGHT = "in-flight"  # open at the end of a torn or cut log: what became of it is not in the log


@dataclass(frozen=True)
class Finding:
    rule: str
    sentence: str
    chain: tuple[Step, ...]  # in causal (merged) order
    worker: str = ""
    request: str = ""
    transfer: str = ""


@dataclass
class _Lease:
    """One P lease and what became of it and its blocks."""

    worker: str
    grant: Step
    claim: Step | None = None
    renewals: list[Step] = field(default_factory=list)
    completions: int = 0  # consumer_done records: all of them, and the lease ended under no reader
    release: Step | None = None
    let_go: Step | None = None  # the first free or reallocation of any of its blocks after the release
    reused: Step | None = None  # the first reallocation of any of its blocks after the release


@dataclass
class _Load:
    """One D load and how it settled."""

    worker: str
    start: Step
    reserve: Step | None = None
    cancel: Step | None = None
    settle: Step | None = None  # the last part, or the failure


def _ms(trace: Trace, step: Step) -> str:
    return f"+{trace.ms(step.wall):.3f} ms"


def _span(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if abs(seconds) < 1 else f"{seconds:.2f} s"


def _blocks(step: Step) -> str:
    n = step.blocks.size
    return f"block{'s' if n != 1 else ''} {block_ranges(step.blocks)}"


class _Index:
    """Leases, loads and frees of a trace, by transfer."""

    def __init__(self, trace: Trace) -> None:
        self.leases: dict[str, _Lease] = {}
        self.loads: dict[str, _Load] = {}
        self.refusals: dict[str, list[Step]] = {}
        self.mismatches: list[Step] = []
        reserved: dict[tuple[str, str], Step] = {}
        # (P worker, block) -> released leases that pinned it and whose blocks are not reused yet
        waiting: dict[tuple[str, int], list[_Lease]] = {}
        for s in trace.steps:
            e = s.event
            if isinstance(e, ev.SrcGranted):
                self.leases[e.transfer] = _Lease(s.worker, s)
            elif isinstance(e, ev.SrcLeaseRenewed) and e.transfer in self.leases:
                lease = self.leases[e.transfer]
                lease.renewals.append(s)
                lease.claim = lease.claim or s
            elif isinstance(e, ev.SrcConsumerDone) and e.transfer in self.leases:
                self.leases[e.transfer].completions += 1
            elif isinstance(e, ev.SrcLeaseReleased) and e.transfer in self.leases:
                lease = self.leases[e.transfer]
                lease.release = s
                for block in lease.grant.blocks.tolist():
                    waiting.setdefault((s.worker, block), []).append(lease)
            elif isinstance(e, ev.SrcFreed | ev.SrcAllocated) and waiting:
                reused = isinstance(e, ev.SrcAllocated)
                for block in s.blocks.tolist():
                    leases = waiting.pop((s.worker, block), []) if reused else waiting.get((s.worker, block), [])
                    for lease in leases:
                        lease.let_go = lease.let_go or s
                        if reused:
                            lease.reused = lease.reused or s
            elif isinstance(e, ev.TgtReserved):
                reserved[(s.worker, e.request)] = s
            elif isinstance(e, ev.TgtLoadStarted):
                self.loads[e.transfer] = _Load(s.worker, s, reserved.get((s.worker, e.request)))
            elif isinstance(e, ev.TgtCancelled):
                for load in self.loads.values():
                    if load.worker == s.worker and load.start.request == e.request and load.settle is None:
                        load.cancel = s
            elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed) and e.transfer in self.loads:
                load = self.loads[e.transfer]
                last_part = bool(s.transitions) and all(t.after != "LOADING" for t in s.transitions)
                if load.settle is None and (isinstance(e, ev.TgtLoadFailed) or last_part):
                    load.settle = s
            elif isinstance(e, ev.TgtDigestMismatch):
                self.mismatches.append(s)
            elif isinstance(e, ev.Refused) and e.transfer:
                self.refusals.setdefault(e.transfer, []).append(s)


def _reader_findings(trace: Trace, index: _Index) -> list[Finding]:
    out: list[Finding] = []
    for load_id, load in index.loads.items():
        start = load.start
        mode = start.event.mode if isinstance(start.event, ev.TgtLoadStarted) else ""  # a load starts with one
        for transfer in source_transfers(load_id):
            lease = index.leases.get(transfer)
            if lease is None or lease.release is None:
                continue
            rel = lease.release
            grant = lease.grant.event
            done = isinstance(grant, ev.SrcGranted) and lease.completions >= grant.consumers
            reason = "completed" if done else rel.reason  # a deferred cancel releases at the last completion
            what = f"transfer {transfer} (generation {lease.grant.generation}) of {start.worker}"
            # a lease handed over to P's host pool (staged) is read from there: the staging checks tell that read
            if rel.index < start.index and reason not in ("completed", "staged"):
                gone = [x for x in (lease.let_go, lease.reused) if x is not None and x.index < start.index]
                chain = [lease.grant, rel, *gone, start]
                sentence = (f"{start.worker} started loading {start.request}'s transfer {transfer} (generation "
                            f"{lease.grant.generation}) at {_ms(trace, start)}, {_span(start.wall - rel.wall)} after "
                            f"{rel.worker} had released its lease ({reason})")
                for x in gone:
                    sentence += f"; {x.worker} had {_let_go_words(x)} {_blocks(lease.grant)} at {_ms(trace, x)}"
                out.append(Finding(READ_AFTER_RELEASE, sentence, _ordered(chain), start.worker, start.request,
                                   transfer))
                continue
            settle = load.settle
            if reason == "completed":
                continue  # the reader said it was done with these blocks (a multi-rank load settles after each rank)
            if isinstance(grant, ev.SrcGranted) and grant.consumers > 1 and lease.completions:
                continue  # some of the D ranks sharing it completed: check_shared_leases judges it over every D log
            if not (start.index <= rel.index and (settle is None or rel.index < settle.index)):
                continue
            if mode == "push":
                continue  # P itself was the reader: releasing before D hears of a failed write is the right order
            let_go = lease.let_go if lease.let_go and (settle is None or lease.let_go.index < settle.index) else None
            if reason in ("failed", "cancelled"):
                rule = RELEASED_UNDER_READER
            elif let_go is not None and settle is not None and isinstance(settle.event, ev.TgtPartDone):
                rule = COMPLETED_AFTER_RELEASE
            elif reason == "expired" and (settle is not None or _alive_after(trace, start, rel)):
                rule = READ_OUTLIVED_LEASE  # D should have cancelled its read before P's expiry
            else:
                continue  # a peer restart under a reader (its agent is gone), or a reader whose log stops first
            late = [r for r in index.refusals.get(transfer, []) if r.worker == rel.worker and r.index > rel.index]
            reused = lease.reused if lease.reused and (settle is None or lease.reused.index < settle.index) else None
            chain = [lease.grant, start, *([lease.claim] if lease.claim else []), rel,
                     *([let_go] if let_go else []), *([reused] if reused else []), *([settle] if settle else []),
                     *late[:1]]
            subject = let_go if let_go is not None else rel
            verb = _let_go_words(let_go) if let_go is not None else f"released ({reason})"
            were = "was" if lease.grant.blocks.size == 1 else "were"
            sentence = (f"{_blocks(lease.grant)} of {lease.grant.request} {were} {verb} at {_ms(trace, subject)} "
                        f"on {rel.worker} while {what} was still reading them")
            if let_go is not None and reason:
                sentence += f" (its lease ended: {reason})"
            if reused is not None and reused is not let_go:
                sentence += f", and {_let_go_words(reused)} at {_ms(trace, reused)}"
            if settle is None:
                sentence += f"; the load never settled by the end of {start.worker}'s log"
            else:
                ending = ("completed" if isinstance(settle.event, ev.TgtPartDone)
                          else f"failed ({settle.reason})")
                sentence += f"; its load {ending} {_span(settle.wall - subject.wall)} later"
                if late:
                    refusal = late[0].event
                    command = refusal.command if isinstance(refusal, ev.Refused) else "command"  # refusals only
                    sentence += f" and {rel.worker} refused its {command}"
            out.append(Finding(rule, sentence, _ordered(chain), rel.worker, lease.grant.request, transfer))
    return out


def _alive_after(trace: Trace, start: Step, rel: Step) -> bool:
    """Whether the worker of the load that began at ``start`` logged anything after ``rel`` in the same incarnation:
    proof that its unsettled read was still in flight then."""
    return any(s.worker == start.worker and s.incarnation == start.incarnation for s in trace.steps[rel.index + 1:])


def _let_go_words(step: Step) -> str:
    e = step.event
    if isinstance(e, ev.SrcAllocated):
        return f"given to {e.request}"
    return "cached" if isinstance(e, ev.SrcFreed) and e.cached else "freed"


def _ordered(chain: Iterable[Step]) -> tuple[Step, ...]:
    return tuple(sorted({s.index: s for s in chain}.values(), key=lambda s: s.index))


def _load_findings(trace: Trace, index: _Index) -> list[Finding]:
    out: list[Finding] = []
    lost = {(r.worker, load.transfer): (r, load) for r in trace.restarts for load in r.loads}
    for load_id, load in index.loads.items():
        if load.settle is not None:
            continue
        start = load.start
        parts = start.event.parts if isinstance(start.event, ev.TgtLoadStarted) else 1  # a load starts with one
        restart, left = lost.get((load.worker, load_id), (None, None))
        ledger = trace.logs[load.worker].ledger
        if isinstance(ledger, TargetLedger):
            left = ledger.loads.get(load_id) or left
        if left is None:
            continue  # settled by a path this index does not follow (cannot happen on a ledger's own log)
        done = sorted(left.done)
        unknown = _log_stops(trace, load.worker) if restart is None else ""
        sentence = (f"{load.worker}'s load of {start.request} (transfer {load_id}, generation {start.generation}) "
                    f"started at {_ms(trace, start)} and "
                    f"{'was in flight, ' if unknown else 'never completed: '}"
                    f"{len(done)} of {parts} part(s) done")
        if unknown:
            sentence += f", {unknown}"
        elif restart is not None:
            sentence += f" when {load.worker} restarted at {_ms(trace, trace.steps[restart.step_index])}"
        else:
            sentence += f" by the end of {load.worker}'s log"
        chain = [*([load.reserve] if load.reserve else []), start, *([load.cancel] if load.cancel else [])]
        peer_words = []
        for transfer in source_transfers(load_id):
            lease = index.leases.get(transfer)
            if lease is None:
                continue
            chain.append(lease.grant)
            if lease.renewals:
                chain.append(lease.renewals[-1])
            if lease.release is not None:
                chain.append(lease.release)
                peer_words.append(f"{lease.worker} released {transfer} at {_ms(trace, lease.release)} "
                                  f"({lease.release.reason})")
            else:
                peer_words.append(f"{lease.worker} still holds its lease")
        if peer_words:
            sentence += "; " + ", ".join(peer_words)
        out.append(Finding(IN_FLIGHT if unknown else LOAD_NEVER_COMPLETED, sentence, _ordered(chain), load.worker,
                           start.request, load_id))
    return out


def _digest_findings(trace: Trace, index: _Index) -> list[Finding]:
    """A load whose landed bytes failed their digest: corruption, a wrong slot or wrong heads on the data plane,
    caught before attention read them."""
    out: list[Finding] = []
    for step in index.mismatches:
        e = step.event
        assert isinstance(e, ev.TgtDigestMismatch)
        load = index.loads.get(e.transfer)
        chain = [*([load.start] if load else []), step, *([load.settle] if load and load.settle else [])]
        for transfer in source_transfers(e.transfer):
            lease = index.leases.get(transfer)
            if lease is not None:
                chain.append(lease.grant)
        settled = load.settle.event if load and load.settle else None
        verdict = ("the load failed and the request recomputes its KV" if isinstance(settled, ev.TgtLoadFailed)
                   and settled.recompute else "the load failed" if settled is not None else "the load did not settle")
        until = f", quarantined for {_span(e.quarantine_until - e.at)}" if e.quarantine_until > e.at else ""
        what = (f"a layer batch of {len(e.blocks) // 4} block(s)" if e.num_layers
                else f"{len(e.expected) // 8} block(s)")
        sentence = (f"{step.worker}'s load of {step.request} (transfer {e.transfer}) received "
                    f"{what} whose bytes differ from what P sent, {digest_words(e)}; "
                    f"refused at {_ms(trace, step)} before attention read them: {verdict}{until}")
        out.append(Finding(DIGEST_MISMATCH, sentence, _ordered(chain), step.worker, step.request, e.transfer))
    return out


def _pinned_findings(trace: Trace, index: _Index) -> list[Finding]:
    out: list[Finding] = []
    for worker, log in trace.logs.items():
        if not isinstance(log.ledger, SourceLedger) or log.end_at is None:
            continue
        for transfer, lease in log.ledger.leases.items():
            if lease.expires_at >= log.end_at:
                continue
            info = index.leases.get(transfer)
            if info is None:
                continue
            grant = info.grant
            deadline_wall = grant.wall + (lease.expires_at - grant.event.at)
            torn = worker in trace.tails
            sentence = (f"{_blocks(grant)} of {lease.request} are still pinned on {worker} by lease {transfer} "
                        f"(generation {lease.generation}), which expired at +{trace.ms(deadline_wall):.3f} ms, "
                        f"{_span(log.end_at - lease.expires_at)} before {worker}'s log ends: "
                        + (_log_stops(trace, worker) if torn else "no sweep released it"))
            chain = [grant, *info.renewals[-1:]]
            readers = [load for load_id, load in index.loads.items() if transfer in source_transfers(load_id)]
            for load in readers:
                chain.append(load.start)
                if load.settle is not None:
                    chain.append(load.settle)
            if readers and all(load.settle is not None for load in readers):
                sentence += f" (its reader{'s' if len(readers) > 1 else ''} had settled)"
            elif not readers:
                sentence += " (no reader ever started loading it)"
            out.append(Finding(IN_FLIGHT if torn else PINNED_PAST_LEASE, sentence, _ordered(chain), worker,
                               lease.request, transfer))
    return out


def _unended_findings(trace: Trace, covered: set[tuple[str, str]]) -> list[Finding]:
    out: list[Finding] = []
    for request, steps in requests_of(trace).items():
        story = request_story(trace, request, steps)
        for part in story.parts:
            if part.settled or (part.worker, request) in covered:
                continue
            mine = [s for s in steps if s.worker == part.worker]
            first = next((s for s in mine if isinstance(s.event, ev.SrcAllocated | ev.SrcShared | ev.TgtReserved)),
                         mine[0])
            last = next((s for s in reversed(mine) if s.transitions and any(t.before != t.after
                                                                             for t in s.transitions)), mine[-1])
            since = f" since {_ms(trace, last)} ({last.label})" if last is not first else ""
            sentence = f"{request} still holds {_blocks(first)} on {part.worker} in {part.state}{since}"
            unknown = _log_stops(trace, part.worker)
            sentence += f", {unknown}" if unknown else _why_unended(part.side, part.state, part.leases)
            out.append(Finding(IN_FLIGHT if unknown else REQUEST_DID_NOT_END, sentence, _ordered([first, last]),
                               part.worker, request))
    return out


def _log_stops(trace: Trace, worker: str) -> str:
    """Why nothing after ``worker``'s last event is known (its log is torn, or cut by ``until``), or ""."""
    tail = trace.tails.get(worker)
    if tail is not None:
        return f"when {worker}'s log tears at offset {tail.offset} of {tail.segment.name}: what came after is unknown"
    if worker in trace.cut:
        return f"when {worker}'s log was cut at +{trace.ms(trace.cut[worker]):.3f} ms: what came after is unknown"
    return ""


def _torn_findings(trace: Trace) -> list[Finding]:
    """A torn tail first: the worker died mid-write, and every other finding on its log is read in that light."""
    out: list[Finding] = []
    for worker, tail in trace.tails.items():
        mine = [s for s in trace.steps if s.worker == worker]
        ends = f"at {_ms(trace, mine[-1])} ({mine[-1].label})" if mine else "before its first event"
        sentence = (f"{worker}'s log ends {ends}, torn at offset {tail.offset} of {tail.segment} ({tail.reason}, "
                    f"{tail.dropped_bytes} bytes after it cannot be read): {worker} stopped in the middle of a write "
                    "(a crash or a lost disk), and everything after the tear is unknown")
        out.append(Finding(LOG_TORN, sentence, tuple(mine[-1:]), worker))
    return out


def _why_unended(side: str, state: str, leases: list[LeaseSummary]) -> str:
    if side == "source":
        if state.startswith("RELEASABLE") and leases:
            return f": its lease ended ({leases[-1].ended}) but the engine never freed them"
        if state.startswith("READY"):
            return ": prefill finished but no lease was granted and nothing freed them"
        if state.startswith("ALLOCATED"):
            return ": prefill never finished"
        return ""
    if state.startswith("RESERVED"):
        return ": no load was started (or, after a failed one, nothing filled them)"
    return ""


def _invariant_findings(trace: Trace, found: list[Finding]) -> list[Finding]:
    """What ``replay --check`` reports that the findings above do not already explain."""
    results = [ReplayResult(log.path, log.header, log.ledger, log.events, restarts=_restarts(trace, worker))
               for worker, log in trace.logs.items()]
    violations: list[tuple[str, Violation]] = []
    for result in results:
        violations += [(str(result.header.get("worker", "")), v) for v in check(result)]
    violations += [("", v) for v in check_pair(results)]
    explained = {(f.rule, f.transfer) for f in found}
    explained |= {(READ_OUTLIVED_LEASE, f.transfer) for f in found if f.rule == COMPLETED_AFTER_RELEASE}
    transfers = {s.transfer for s in trace.steps if s.transfer}
    out: list[Finding] = []
    for worker, violation in violations:
        named = [t for t in transfers if t in violation.detail.split()]
        if any((violation.rule, t) in explained for t in named):
            continue
        chain = [s for s in trace.steps if s.transfer in named]
        out.append(Finding(violation.rule, f"{worker + ': ' if worker else ''}{violation.detail}",
                           _ordered(chain[:1] + chain[-1:]), worker, "", named[0] if named else ""))
    return out


def _restarts(trace: Trace, worker: str) -> list[dict[str, Any]]:
    """Where each new incarnation of ``worker`` begins in its own events, as :func:`~kvlifecycle.replay.replay`
    reports it (``at_index``)."""
    mine = [s for s in trace.steps if s.worker == worker]
    return [{"at_index": i} for i in range(1, len(mine)) if mine[i].incarnation != mine[i - 1].incarnation]


def _covered(found: list[Finding], index: _Index) -> set[tuple[str, str]]:
    """(worker, request) pairs a finding already explains: its own, and both ends of the transfer it names."""
    out: set[tuple[str, str]] = set()
    for f in found:
        out.add((f.worker, f.request))
        for load_id, load in index.loads.items():
            if f.transfer == load_id or f.transfer in source_transfers(load_id):
                out.add((load.worker, load.start.request))
                for transfer in source_transfers(load_id):
                    lease = index.leases.get(transfer)
                    if lease is not None:
                        out.add((lease.worker, lease.grant.request))
        lease = index.leases.get(f.transfer)
        if lease is not None:
            out.add((lease.worker, lease.grant.request))
    return out


def explain_trace(trace: Trace) -> list[Finding]:
    """Every finding of ``trace``, in the order their chains begin."""
    index = _Index(trace)
    found = _reader_findings(trace, index) + _load_findings(trace, index) + _pinned_findings(trace, index)
    found += _digest_findings(trace, index)
    found += _unended_findings(trace, _covered(found, index))
    found += _invariant_findings(trace, found)
    found += _torn_findings(trace)
    return sorted(found, key=lambda f: (f.rule != LOG_TORN, f.chain[0].index if f.chain else -1, f.rule))


def split_in_flight(found: Iterable[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(findings, work in flight at the end of a torn or cut log): only the first are faults."""
    found = list(found)
    return [f for f in found if f.rule != IN_FLIGHT], [f for f in found if f.rule == IN_FLIGHT]


def explain_logs(
    paths: Iterable[str | os.PathLike[str]],
    *,
    until_time: float | None = None,
    until_offset_s: float | None = None,
    until_index: int | None = None,
) -> tuple[Trace, list[Finding]]:
    """Read the logs at ``paths`` and explain them (``until_*``: as :func:`~kvlifecycle.story.trace_logs`)."""
    trace = trace_logs(paths, until_time=until_time, until_offset_s=until_offset_s, until_index=until_index)
    return trace, explain_trace(trace)


def digest_tally(trace: Trace) -> dict[str, dict[str, int]]:
    """Per D worker whose loads checked digests, what its check found: ``verified_parts`` and ``verified_blocks``
    (parts whose landed bytes matched P's digests before they completed, and their units), ``mismatches`` and
    ``mismatched_blocks`` (failed checks, each a ``digest-mismatch`` finding). Workers that checked nothing are
    left out: an empty tally is a deployment without verification."""
    out: dict[str, dict[str, int]] = {}
    for step in trace.steps:
        e = step.event
        if isinstance(e, ev.TgtPartDone) and e.verified:
            tally = out.setdefault(step.worker, dict.fromkeys(_TALLY_KEYS, 0))
            tally["verified_parts"] += 1
            tally["verified_blocks"] += e.verified
        elif isinstance(e, ev.TgtDigestMismatch):
            tally = out.setdefault(step.worker, dict.fromkeys(_TALLY_KEYS, 0))
            tally["mismatches"] += 1
            tally["mismatched_blocks"] += len(e.expected) // 8
    return out


_TALLY_KEYS = ("verified_parts", "verified_blocks", "mismatches", "mismatched_blocks")


class FindingView(TypedDict):
    """A finding as ``explain --json`` prints it."""

    rule: str
    sentence: str
    worker: str
    request: str
    transfer: str
    chain: list[dict[str, Any]]  # step_view of each step


def finding_view(trace: Trace, finding: Finding) -> FindingView:
    return {"rule": finding.rule, "sentence": finding.sentence, "worker": finding.worker,
            "request": finding.request, "transfer": finding.transfer,
            "chain": [step_view(trace, s) for s in finding.chain]}
