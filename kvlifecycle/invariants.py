"""Invariant checks over ledgers and over event streams (one side, or P and D merged).

The ledgers enforce these by construction; the checks are an independent second opinion used by
``kvlifecycle replay --check`` and by the tests after every step. They recompute what they need from scratch
rather than trusting the ledger's own counters.
"""

from __future__ import annotations

import datetime as dt
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.clock import hlc_wall_seconds
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.source_ledger import SourceLedger
from kvlifecycle.story import block_ranges
from kvlifecycle.transfer_ids import source_transfers

if TYPE_CHECKING:
    from kvlifecycle.target_ledger import TargetLedger


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


def check_source(ledger: SourceLedger) -> list[Violation]:
    state, pins = ledger.state, ledger.pins  # derived views: build each once
    out: list[Violation] = []
    n = ledger.num_blocks
    expected_pins = np.zeros(n, dtype=np.int64)
    pinned_epoch = np.full(n, -1, dtype=np.int64)
    for lease in ledger.leases.values():
        expected_pins[lease.blocks] += 1
        stale = lease.epochs != ledger.epoch[lease.blocks]
        if stale.any():
            block = int(lease.blocks[int(np.argmax(stale))])
            out.append(
                Violation(
                    "pinned-under-two-epochs",
                    f"lease {lease.transfer} pins block {block} at epoch {int(lease.epochs[stale][0])}, "
                    f"block is at epoch {int(ledger.epoch[block])}",
                )
            )
        prior = pinned_epoch[lease.blocks]
        clash = (prior >= 0) & (prior != lease.epochs)
        if clash.any():
            out.append(
                Violation(
                    "pinned-under-two-epochs",
                    f"block {int(lease.blocks[int(np.argmax(clash))])} pinned by leases of different epochs",
                )
            )
        pinned_epoch[lease.blocks] = lease.epochs
        not_pinned = state[lease.blocks] != SourceState.PINNED_FOR_TRANSFER
        if not_pinned.any():
            block = int(lease.blocks[int(np.argmax(not_pinned))])
            out.append(
                Violation(
                    "left-pinned-while-leased",
                    f"block {block} is {SourceState(int(state[block])).name} "
                    f"while lease {lease.transfer} is live",
                )
            )
    if not np.array_equal(expected_pins, pins):
        block = int(np.argmax(expected_pins != pins))
        out.append(
            Violation(
                "pin-count",
                f"block {block}: {int(pins[block])} pins recorded, {int(expected_pins[block])} live leases",
            )
        )
    pinned = state == SourceState.PINNED_FOR_TRANSFER
    orphan = pinned & (expected_pins == 0)
    if orphan.any():
        out.append(Violation("pinned-without-lease", f"{int(orphan.sum())} block(s), first {int(np.argmax(orphan))}"))
    refs = np.zeros(n, dtype=np.int64)
    for req in ledger.requests.values():
        refs[req.blocks] += 1
    held = (state == SourceState.ALLOCATED) | (state == SourceState.READY)
    unowned = held & (refs == 0)
    if unowned.any():
        out.append(Violation("held-without-owner", f"{int(unowned.sum())} ALLOCATED/READY block(s) no request holds"))
    free_but_held = (state == SourceState.FREE) & (refs > 0)
    if free_but_held.any():
        out.append(Violation("free-but-owned", f"block {int(np.argmax(free_but_held))} is FREE but a request holds it"))
    return out


def check_target(ledger: TargetLedger) -> list[Violation]:
    state = ledger.state  # a derived view: build it once
    out: list[Violation] = []
    owner = np.zeros(ledger.num_blocks, dtype=np.int64)
    for name, req in ledger.requests.items():
        owner[req.blocks] += 1
        states = state[req.blocks]
        loading = states == TargetState.LOADING
        if loading.any() and req.transfer is None:
            out.append(Violation("loading-without-transfer", f"request {name} has LOADING blocks and no live load"))
        if req.transfer is not None and not loading.all():
            out.append(Violation("load-state", f"request {name} has a live load but blocks not all LOADING"))
    if (owner > 1).any():
        out.append(Violation("block-two-owners", f"block {int(np.argmax(owner > 1))} held by two requests"))
    stray = (state != TargetState.FREE) & (owner == 0)
    if stray.any():
        out.append(
            Violation("held-without-owner", f"block {int(np.argmax(stray))} is not FREE and no request holds it")
        )
    return out


def check_quiescent(ledger: SourceLedger | TargetLedger) -> list[Violation]:
    """At quiescence: no pins, no leases, no in-flight transfers."""
    state = ledger.state  # a derived view: build it once
    out: list[Violation] = []
    if isinstance(ledger, SourceLedger):
        pins = ledger.pins
        if ledger.leases:
            out.append(
                Violation("quiescent-leases", f"{len(ledger.leases)} lease(s) left: {sorted(ledger.leases)[:5]}")
            )
        pinned = int((state == SourceState.PINNED_FOR_TRANSFER).sum())
        if pinned or int(pins.sum()):
            out.append(Violation("quiescent-pins", f"{pinned} PINNED block(s), {int(pins.sum())} pins"))
    else:
        if ledger.loads:
            out.append(
                Violation("quiescent-loads", f"{len(ledger.loads)} load(s) in flight: {sorted(ledger.loads)[:5]}")
            )
        loading = int((state == TargetState.LOADING).sum())
        if loading:
            out.append(Violation("quiescent-loading", f"{loading} LOADING block(s)"))
    return out


def check_target_events(events: Iterable[ev.Event]) -> list[Violation]:
    """Independent of the ledger code: no request is READY_FOR_ATTENTION without a completion for every expected
    part of its load, no part completes twice, and a streaming part completes only after each layer of each of the
    request's blocks landed, each once."""
    out: list[Violation] = []
    expected: dict[str, int] = {}
    done: dict[str, set[int]] = {}
    blocks_of: dict[str, frozenset[int]] = {}  # request -> its reserved blocks
    layers_of: dict[str, tuple[int, frozenset[int]]] = {}  # streaming transfer -> (layers, the request's blocks)
    landed: dict[tuple[str, int], set[tuple[int, int]]] = {}  # (transfer, part) -> {(block, layer)}
    for e in events:
        if isinstance(e, ev.TgtReserved):
            blocks_of[e.request] = frozenset(ev.unpack_blocks(e.blocks).tolist())
        elif isinstance(e, ev.TgtLoadStarted):
            expected[e.transfer] = e.parts
            done[e.transfer] = set()
            if e.layers:
                layers_of[e.transfer] = (e.layers, blocks_of.get(e.request, frozenset()))
        elif isinstance(e, ev.TgtLayersLanded):
            pairs = {(b, layer) for b in ev.unpack_blocks(e.blocks).tolist()
                     for layer in range(e.first_layer, e.first_layer + e.num_layers)}
            seen = landed.setdefault((e.transfer, e.part), set())
            if pairs & seen:
                out.append(Violation("duplicate-layer", f"transfer {e.transfer} part {e.part}: a layer landed twice"))
            seen |= pairs
        elif isinstance(e, ev.TgtPartDone):
            if e.transfer in layers_of:
                layers, blocks = layers_of[e.transfer]
                if len(landed.get((e.transfer, e.part), set())) < layers * len(blocks):
                    out.append(Violation("part-before-its-layers",
                                         f"transfer {e.transfer} part {e.part} done with layers missing"))
            parts = done.get(e.transfer)
            if parts is None:
                out.append(Violation("part-without-load", f"transfer {e.transfer} part {e.part} with no live load"))
                continue
            if e.part in parts:
                out.append(Violation("duplicate-part", f"transfer {e.transfer} part {e.part} applied twice"))
            parts.add(e.part)
            if len(parts) == expected[e.transfer]:
                del done[e.transfer]
        elif isinstance(e, ev.TgtLoadFailed | ev.TgtLoadDeclined):
            done.pop(e.transfer, None)
        elif isinstance(e, ev.TgtLocalFilled):
            pass
    return out


# how the cross-log checks name a release recorded as ``completed`` before every consumer of the lease completed
EARLY_COMPLETION = "completed before every consumer"


def check_merged(
    source_events: Iterable[ev.Event],
    target_events: Iterable[ev.Event],
    *,
    target_restarts: Sequence[int] = (),
) -> list[Violation]:
    """Cross-side rules on P's and D's logs (HLC-ordered): P must not release a lease under a reader.

    - a load D started after P had already released that transfer's lease (D read blocks P may have reused);
    - P released a lease as failed or cancelled while D's pull of it was still in flight (completion and expiry
      are the only ways a lease may end under a reader). In push mode P is the one reading its blocks (to write
      them into D's): once its write failed, releasing before D has heard of it is the right order. A lease that
      every consumer completed ended under no reader, whatever its reason says: a cancel deferred under a claim
      releases as ``cancelled`` at the last completion, and D may record its own DONE after that (it polls). A
      lease released as ``completed`` (or ``cancelled``) before all its consumers completed (two D ranks reading
      their head slices of one P rank's blocks, released at the first one's completion) ended under the other.
      A lease of several consumers that some completed is left to :func:`check_shared_leases` (one D's log cannot
      tell whether its read was one of those completed, whose end D may record after P's release).
    - a lease P expired while D's read under it had not ended (:func:`check_read_outlived_lease`).

    ``target_restarts``: the positions in ``target_events`` where a new incarnation of D's worker begins.
    """
    source_events, target_events = list(source_events), list(target_events)
    out: list[Violation] = []
    released: dict[str, tuple[int, str, bool]] = {}  # transfer -> (stamp, reason, whether a sibling may excuse it)
    consumers: dict[str, int] = {}
    completions: dict[str, int] = {}
    for e in source_events:
        if isinstance(e, ev.SrcGranted):
            consumers[e.transfer] = e.consumers
        elif isinstance(e, ev.SrcConsumerDone):
            completions[e.transfer] = completions.get(e.transfer, 0) + 1
        elif isinstance(e, ev.SrcLeaseReleased):
            n, done = consumers.get(e.transfer, 1), completions.get(e.transfer, 0)
            reason = "completed" if done >= n else EARLY_COMPLETION if e.reason == "completed" else e.reason
            released[e.transfer] = (e.hlc, reason, n > 1 and done > 0)
    started: dict[str, int] = {}
    settled: dict[str, int] = {}
    pushed: set[str] = set()
    for e in target_events:
        if isinstance(e, ev.TgtLoadStarted):
            started[e.transfer] = e.hlc
            if e.mode == "push":
                pushed.add(e.transfer)
        elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed):
            settled[e.transfer] = e.hlc
    for transfer, start in started.items():
        if transfer not in released:
            continue
        rel_hlc, reason, shared = released[transfer]
        # a lease handed over to P's host staging pool is read from there: staging_checks verifies that read
        if rel_hlc < start and reason not in ("completed", "staged"):
            out.append(Violation("read-after-release", f"D started loading {transfer} after P released it ({reason})"))
        end = settled.get(transfer)
        under_reader = transfer not in pushed and start <= rel_hlc and (end is None or rel_hlc < end)
        if (reason == EARLY_COMPLETION or (reason in ("failed", "cancelled") and not shared)) and under_reader:
            out.append(
                Violation("released-under-reader", f"P released {transfer} ({reason}) while D's load was in flight")
            )
    return out + check_read_outlived_lease(source_events, target_events, target_restarts=target_restarts)


READ_OUTLIVED_LEASE = "read-outlived-lease"


@dataclass
class _PLease:
    """What P's log says of one lease: its blocks, its end, and the first reallocation of its blocks after it."""

    request: str
    blocks: np.ndarray
    consumers: int
    completions: int = 0
    end_hlc: int | None = None
    reason: str = ""
    reused_hlc: int | None = None
    reused_by: str = ""
    reused_blocks: list[int] = field(default_factory=list)


@dataclass
class _DRead:
    """One pull load on D: when it started, when each part's read ended, and the last stamp its incarnation wrote
    (the latest moment D's log proves its process alive)."""

    transfer: str
    start_hlc: int
    parts: int
    part_end: dict[int, tuple[int, str]] = field(default_factory=dict)  # part -> (stamp, how it ended)
    alive_until: int = 0


def check_read_outlived_lease(
    source_events: Iterable[ev.Event],
    target_events: Iterable[ev.Event],
    *,
    target_restarts: Sequence[int] = (),
) -> list[Violation]:
    """A lease P expired while a pull D had started under it had not recorded the end of its read — merged by HLC.

    A read ends, per part, when D records that part's completion (the part reached READY_FOR_ATTENTION) or the
    load's failure or decline. D must cancel its read before P's expiry can free the blocks ("a read never
    outlives its lease"); an expiry stamped before that end, or before any later event of D's same incarnation
    while the read was still open, is a read P's next owner of the blocks may overwrite. The violation names the
    transfer, P's blocks, both times and the first reallocation of the blocks after the expiry, if any.

    Not flagged: a lease every consumer completed (D's read ended before its notification), one P released for a
    peer restart (the reader's agent is gone), an expiry after the read ended, a load never started, a push (P is
    the one reading), and a read whose end D's log cannot show (its log, or its incarnation, ends first: D died).
    A failed or cancelled release under a reader, or one recorded as completed before every consumer completed, is
    ``released-under-reader`` (found here, part by part, for a multi-rank load; :func:`check_merged` finds it for a
    load of one transfer).
    """
    leases = _source_leases(source_events)
    out: list[Violation] = []
    for read in _pull_reads(target_events, target_restarts):
        for part_transfer, parts in _parts_by_transfer(read).items():
            lease = leases.get(part_transfer)
            if lease is None or lease.end_hlc is None:
                continue
            if lease.reason == "expired":
                rule = READ_OUTLIVED_LEASE
            elif lease.reason in ("failed", "cancelled", "completed") and read.transfer != part_transfer:
                rule = "released-under-reader"  # a multi-rank load, which the rule above cannot match by name
            else:
                continue
            if lease.completions >= lease.consumers or lease.end_hlc < read.start_hlc:
                continue  # completed, or ended before the read began (read-after-release's case)
            if lease.consumers > 1 and lease.completions and lease.reason != "completed":
                continue  # some of its consumers completed: check_shared_leases counts the readers of every D
            ends = [read.part_end.get(part) for part in parts]
            if all(end is not None for end in ends):
                end_hlc, how = max(end for end in ends if end is not None)
                if end_hlc <= lease.end_hlc:
                    continue
                ended = f"D's read ended at {_hlc_time(end_hlc)} ({how})"
            else:
                end_hlc = read.alive_until
                if end_hlc <= lease.end_hlc:
                    continue  # D's log stops first: it cannot show the read outlived the lease
                ended = f"D's read had not ended at {_hlc_time(end_hlc)} (D's last event; never ended)"
            reuse = ""
            if lease.reused_hlc is not None and lease.reused_hlc < end_hlc:
                reuse = (f"; P reallocated block(s) {_ranges(lease.reused_blocks)} to {lease.reused_by} at "
                         f"{_hlc_time(lease.reused_hlc)}")
            which = f" part(s) {_ranges(parts)} of load {read.transfer}" if read.transfer != part_transfer else ""
            reason = EARLY_COMPLETION if lease.reason == "completed" else lease.reason
            how_ended = "expired" if rule == READ_OUTLIVED_LEASE else f"was released ({reason})"
            out.append(Violation(
                rule,
                f"P's lease of transfer {part_transfer} (blocks {_ranges(lease.blocks.tolist())} of {lease.request}) "
                f"{how_ended} at {_hlc_time(lease.end_hlc)} while D was reading it{which}: {ended}{reuse}",
            ))
    return out


def check_shared_leases(
    source_events: Iterable[ev.Event],
    targets: Iterable[tuple[str, Sequence[ev.Event], Sequence[int]]],
) -> list[Violation]:
    """A lease of several consumers (D ranks each reading their head slice of one P rank's blocks) that P released
    as failed or cancelled, or expired, after some of them completed: the reads of it still open at that release,
    over every D log, must not outnumber the completions P counted that no read recorded as done before the release
    accounts for. Each completed consumer's read ended before its notification, but its D may record that end only
    later (it polls), and one D's log cannot tell whether its read was one of those. ``targets``: each D log's
    (name, events, restart positions)."""
    shared = {transfer: lease for transfer, lease in _source_leases(source_events).items()
              if 0 < lease.completions < lease.consumers and lease.end_hlc is not None
              and lease.reason in ("failed", "cancelled", "expired")}
    if not shared:
        return []
    readers: dict[str, list[str]] = {}  # P's transfer -> the D logs whose read of it was open at its release
    done_before: Counter[str] = Counter()  # P's transfer -> the reads of it D recorded done before its release
    for name, events, restarts in targets:
        for read in _pull_reads(events, restarts):
            for part_transfer, parts in _parts_by_transfer(read).items():
                lease = shared.get(part_transfer)
                if lease is None or lease.end_hlc is None or lease.end_hlc < read.start_hlc:
                    continue
                ends = [read.part_end.get(part) for part in parts]
                end = max(e[0] for e in ends if e is not None) if None not in ends else read.alive_until
                if end > lease.end_hlc:
                    readers.setdefault(part_transfer, []).append(name)
                elif all(e is not None and e[1] == "part done" for e in ends):
                    done_before[part_transfer] += 1
    out: list[Violation] = []
    for transfer, names in readers.items():
        lease = shared[transfer]
        if len(names) <= lease.completions - done_before[transfer]:
            continue  # as many completions P counted may be theirs
        assert lease.end_hlc is not None  # shared leases ended
        expired = lease.reason == "expired"
        out.append(Violation(
            READ_OUTLIVED_LEASE if expired else "released-under-reader",
            f"P's lease of transfer {transfer} (blocks {_ranges(lease.blocks.tolist())} of {lease.request}, "
            f"{lease.completions} of {lease.consumers} consumers completed) "
            f"{'expired' if expired else f'was released ({lease.reason})'} at {_hlc_time(lease.end_hlc)} while "
            f"{len(names)} D read(s) of it had not ended ({', '.join(names)})",
        ))
    return out


def _source_leases(events: Iterable[ev.Event]) -> dict[str, _PLease]:
    blocks_of: dict[str, np.ndarray] = {}
    leases: dict[str, _PLease] = {}
    awaiting_reuse: dict[int, list[_PLease]] = {}  # block -> ended leases whose blocks were not reallocated yet
    for e in events:
        if isinstance(e, ev.SrcAllocated | ev.SrcShared):
            blocks = ev.unpack_blocks(e.blocks)
            blocks_of[e.request] = blocks
            if isinstance(e, ev.SrcAllocated):
                for block in blocks.tolist():
                    for lease in awaiting_reuse.pop(block, []):
                        if lease.reused_hlc is None or lease.reused_hlc == e.hlc:
                            lease.reused_hlc, lease.reused_by = e.hlc, e.request
                            lease.reused_blocks.append(block)
        elif isinstance(e, ev.SrcGranted):
            blocks = blocks_of.get(e.request, np.zeros(0, dtype=ev.BLOCK_DTYPE))
            leases[e.transfer] = _PLease(e.request, blocks, e.consumers)
        elif isinstance(e, ev.SrcConsumerDone) and e.transfer in leases:
            leases[e.transfer].completions += 1
        elif isinstance(e, ev.SrcLeaseReleased) and e.transfer in leases:
            lease = leases[e.transfer]
            lease.end_hlc, lease.reason = e.hlc, e.reason
            for block in lease.blocks.tolist():
                awaiting_reuse.setdefault(block, []).append(lease)
    return leases


def _pull_reads(events: Iterable[ev.Event], restarts: Sequence[int]) -> list[_DRead]:
    reads: list[_DRead] = []
    open_reads: dict[str, _DRead] = {}  # transfer -> its latest load, while any part's read is open
    incarnation: list[_DRead] = []  # reads started in the current incarnation
    boundaries = set(restarts)
    last_hlc = 0
    for i, e in enumerate(events):
        if i in boundaries:  # D restarted: what the old incarnation had in flight died with it
            for read in incarnation:
                read.alive_until = last_hlc
            incarnation, open_reads = [], {}
        last_hlc = max(last_hlc, e.hlc)
        if isinstance(e, ev.TgtLoadStarted):
            if e.mode == "pull":
                read = _DRead(e.transfer, e.hlc, max(1, e.parts))
                reads.append(read)
                incarnation.append(read)
                open_reads[e.transfer] = read
            else:
                open_reads.pop(e.transfer, None)
        elif isinstance(e, ev.TgtPartDone) and e.transfer in open_reads:
            open_reads[e.transfer].part_end.setdefault(e.part, (e.hlc, "part done"))
        elif isinstance(e, ev.TgtLoadFailed | ev.TgtLoadDeclined) and e.transfer in open_reads:
            read = open_reads.pop(e.transfer)
            how = f"{'failed' if isinstance(e, ev.TgtLoadFailed) else 'declined'}: {e.reason}"
            for part in range(read.parts):
                read.part_end.setdefault(part, (e.hlc, how))
    for read in incarnation:
        read.alive_until = last_hlc
    return reads


def _parts_by_transfer(read: _DRead) -> dict[str, list[int]]:
    """P's transfer each part reads: a multi-rank load (``<request><-<t1>+<t2>``) reads rank i's transfer in part
    i; a load of one transfer reads it in every part."""
    transfers = source_transfers(read.transfer)
    if len(transfers) == read.parts:
        return {transfer: [part] for part, transfer in enumerate(transfers)}
    return {transfer: list(range(read.parts)) for transfer in transfers}


def _ranges(ids: Iterable[int]) -> str:
    return block_ranges(list(ids))


def _hlc_time(stamp: int) -> str:
    """An HLC stamp's wall clock, to the millisecond (its resolution), in UTC."""
    wall = dt.datetime.fromtimestamp(hlc_wall_seconds(stamp), tz=dt.timezone.utc)
    return wall.isoformat(timespec="milliseconds").replace("+00:00", "Z")
