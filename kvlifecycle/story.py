"""Stories told by the event logs: every event of P's and D's logs merged in causal order and annotated with what it
did to the blocks it concerns, then cut into one request's story or one block's life.

Each worker's events are folded through a real ledger, one at a time, and the ledger is asked for the states of the
event's blocks before and after (the ledger is the one authority on what an event means, so a story can never
disagree with ``replay``). Every event becomes a :class:`Step`: its time, worker, request, blocks, each block's state
before → after, the token it carries (transfer, generation, epoch), the lease's deadline and, for a refusal, why.

Times: the HLC stamp orders events across logs but has millisecond resolution; each event's ledger clock (``at``) is
finer but has its own zero per worker. A step's ``wall`` is the ledger clock placed on the wall-clock axis with one
offset per worker, the same estimate ``kvlifecycle timeline`` draws with, so a story's times match the picture.

One concept, longer than most: the merged, annotated reading of the logs (the fold per worker, the causal
merge, the cut into a request's story or a block's life), which shares one step type and one time axis.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.clock import hlc_wall_seconds
from kvlifecycle.eventlog import LogError, Record, TailRecovery
from kvlifecycle.ledger import Lease, Load, ReplayError, SourceLedger, TargetLedger, ledger_from_header
from kvlifecycle.machines import HostSlotState, SourceState, TargetState
from kvlifecycle.merge import merge_logs, open_sources
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.transfer_ids import source_transfers

NO_BLOCKS = np.zeros(0, dtype=ev.BLOCK_DTYPE)


class NotInLogsError(LookupError):
    """What a story was asked about (a request, a block, a worker) is not in the logs given."""

# what each event kind is called in a story line
LABELS: dict[type, str] = {
    ev.SrcAllocated: "allocate",
    ev.SrcShared: "share prefix",
    ev.SrcPrefillDone: "prefill done",
    ev.SrcGranted: "grant",
    ev.SrcLeaseRenewed: "renew",
    ev.SrcCancelDeferred: "cancel deferred",
    ev.SrcConsumerDone: "consumer done",
    ev.SrcLeaseReleased: "release",
    ev.SrcFreed: "free",
    ev.SrcAborted: "abort",
    ev.SrcEvicted: "evict",
    ev.TgtReserved: "reserve",
    ev.TgtLoadStarted: "load start",
    ev.TgtPartDone: "part done",
    ev.TgtLoadFailed: "load failed",
    ev.TgtDigestMismatch: "digest mismatch",
    ev.TgtCancelled: "cancel",
    ev.TgtLocalFilled: "local fill",
    ev.TgtFinished: "finish",
    ev.PeerEpochChanged: "peer epoch",
    ev.TransferObserved: "transfer observed",
    ev.Refused: "refused",
    ev.StgStarted: "copy to host",
    ev.StgCompleted: "copy to host done",
    ev.StgAborted: "copy to host dropped",
    ev.StgServed: "serve staged copy",
    ev.StgRenewed: "renew staged copy",
    ev.StgReadEnded: "staged read ended",
    ev.StgReleased: "release staged copy",
}
# each side's block states (P's host pool: its slots)
_STATES: dict[str, type[SourceState] | type[TargetState] | type[HostSlotState]] = {
    "source": SourceState, "target": TargetState, StagingLedger.side: HostSlotState}


def _states_of(side: str) -> type[SourceState] | type[TargetState] | type[HostSlotState]:
    return _STATES.get(side, TargetState)


def digest_words(e: ev.TgtDigestMismatch) -> str:
    """Which blocks failed their digest, from which source blocks, expected against found (the first four); a
    stream's layer batch as the one unit it is."""
    if e.num_layers:
        want, got = (ev.digest_hex(e.expected) or ["?"])[0], (ev.digest_hex(e.found) or ["?"])[0]
        return (f"part {e.part}: layers {e.first_layer}-{e.first_layer + e.num_layers - 1} of blocks "
                f"{block_ranges(ev.unpack_blocks(e.blocks))} (a stream's batch): batch digest expected {want}, "
                f"found {got}")
    blocks = ev.unpack_blocks(e.blocks)[:: max(e.pieces, 1)].tolist()
    pairs = zip(blocks, ev.unpack_blocks(e.source_blocks).tolist(), ev.digest_hex(e.expected),
                ev.digest_hex(e.found), strict=False)
    shown = [f"block {d} (P block {p}): expected {want}, found {got}" for d, p, want, got in pairs]
    more = len(e.expected) // 8 - len(shown[:4])
    where = f"part {e.part}" + (f", head slice {e.slice_index}" if e.slice_index else "")
    return f"{where}: " + "; ".join(shown[:4]) + (f"; and {more} more" if more > 0 else "")


def block_ranges(ids: Iterable[int] | np.ndarray) -> str:
    """``[0, 1, 2, 3, 7]`` → ``"0-3,7"``; ``[63, 62, 61]`` → ``"63-61"``: in the order given (on D it pairs with P's
    blocks position by position), runs of consecutive ids in either direction collapse."""
    values = np.asarray(ids, dtype=np.int64).tolist()
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        step = values[i + 1] - values[i] if i + 1 < len(values) else 0
        if step in (1, -1):
            while j + 1 < len(values) and values[j + 1] - values[j] == step:
                j += 1
        out.append(str(values[i]) if j == i else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out)


@dataclass(frozen=True, slots=True)
class Transition:
    """Blocks that went from one state to another in one step."""

    blocks: str  # as ranges
    before: str
    after: str


@dataclass(frozen=True)
class Step:
    """One event of one log, with what it did."""

    index: int  # position in the merged order
    worker: str
    side: str  # "source" | "target"
    log_index: int  # position in its own log
    incarnation: int
    event: ev.Event
    wall: float  # seconds since the epoch (see the module docstring)
    request: str  # "" when the event names none
    transfer: str
    blocks: np.ndarray  # the block ids (on this worker) the event concerns
    before: np.ndarray  # their states before the event (the side's state enum values)
    after: np.ndarray  # and after it
    epoch: int  # allocation epoch of those blocks on this worker (0: none)
    generation: int  # the lease generation the event names (0: none)
    expires_at: float | None  # the lease deadline after the event (ledger clock)
    reason: str = ""  # a refusal's or a release's reason, a failed load's
    detail: str = ""
    new_incarnation: bool = False  # the first event the worker logged after it restarted

    @property
    def kind(self) -> str:
        return type(self.event).__name__

    @property
    def label(self) -> str:
        label = LABELS.get(type(self.event), self.kind)
        if isinstance(self.event, ev.Refused):
            return f"refused {self.event.command}"
        if isinstance(self.event, ev.SrcFreed) and self.event.cached:
            return "cache"
        return label

    @property
    def lease_left_s(self) -> float | None:
        """Seconds from this event to the lease's deadline (negative: past it)."""
        return None if self.expires_at is None else self.expires_at - self.event.at

    @functools.cached_property
    def transitions(self) -> tuple[Transition, ...]:
        """The blocks grouped by (state before, state after), in their order."""
        names = _states_of(self.side)
        groups: dict[tuple[int, int], list[int]] = {}
        for block, b, a in zip(self.blocks.tolist(), self.before.tolist(), self.after.tolist(), strict=True):
            groups.setdefault((b, a), []).append(block)
        return tuple(Transition(block_ranges(ids), names(b).name, names(a).name) for (b, a), ids in groups.items())

    def state_after(self, block: int) -> str | None:
        """The block's state after the event, or None when the event does not concern it."""
        where = np.flatnonzero(self.blocks == block)
        if not where.size:
            return None
        return _states_of(self.side)(int(self.after[where[0]])).name


@dataclass(frozen=True, slots=True)
class Restart:
    """A worker came back with a new incarnation: what its previous one held when its log stopped."""

    worker: str
    step_index: int  # the first step of the new incarnation
    leases: tuple[Lease, ...]
    loads: tuple[Load, ...]
    held: dict[str, np.ndarray]  # request -> blocks


@dataclass
class WorkerLog:
    path: str
    worker: str
    side: str
    header: dict[str, Any]
    ledger: SourceLedger | TargetLedger | StagingLedger  # its state at the end of the story (or at ``until``)
    events: list[ev.Event] = field(default_factory=list)
    end_at: float | None = None  # ledger clock of its last event

    def state_name(self, value: int) -> str:
        return _states_of(self.side)(value).name


@dataclass
class Trace:
    """Every step of every log given, and each worker's ledger where the steps end."""

    steps: list[Step]
    logs: dict[str, WorkerLog]  # worker -> its log
    restarts: list[Restart]
    t0: float  # wall time of the first event of all the logs (the zero of every time shown)
    tails: dict[str, TailRecovery] = field(default_factory=dict)  # worker -> where its log is torn
    cut: dict[str, float] = field(default_factory=dict)  # worker -> wall time ``until`` cut its log at

    def ms(self, wall: float) -> float:
        """``wall`` in milliseconds since :attr:`t0`."""
        return (wall - self.t0) * 1e3

    def worker_of(self, name_or_side: str) -> str:
        """A worker named by itself, or by its side (``P``/``source``, ``D``/``target``) when only one log has it."""
        if name_or_side in self.logs:
            return name_or_side
        side = {"p": "source", "d": "target", "source": "source", "target": "target"}.get(name_or_side.lower())
        matches = [w for w, log in self.logs.items() if log.side == side]
        if side is not None and len(matches) == 1:
            return matches[0]
        known = ", ".join(f"{w} ({log.side})" for w, log in self.logs.items())
        if side is not None and matches:
            raise NotInLogsError(f"{len(matches)} logs are on the {side} side ({', '.join(matches)}): name one")
        raise NotInLogsError(f"no worker {name_or_side!r} in these logs (workers: {known})")


def _worker_offsets(merged: Sequence[tuple[str, str, Record]]) -> dict[str, float]:
    """Per worker, wall-clock seconds minus ledger-clock seconds: the smallest difference (an HLC's wall part is the
    floor of the wall clock in ms, or later once it observed a peer) plus half a millisecond."""
    lowest: dict[str, float] = {}
    for worker, _side, record in merged:
        diff = hlc_wall_seconds(record.event.hlc) - record.event.at
        if diff < lowest.get(worker, float("inf")):
            lowest[worker] = diff
    return {worker: diff + 0.0005 for worker, diff in lowest.items()}


class _Fold:
    """One worker's ledger, fed one event at a time, answering what each event touched."""

    def __init__(self, header: dict[str, Any], incarnation: int, path: Any) -> None:
        self.ledger: SourceLedger | TargetLedger | StagingLedger
        try:
            if header.get("side") == StagingLedger.side:
                self.ledger = StagingLedger.from_header(header)
            else:
                self.ledger = ledger_from_header(header)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ReplayError(f"{path}: the log header cannot configure a ledger: {type(exc).__name__}: {exc}") \
                from exc
        self.ledger.begin_replay()
        self.ledger.block_states(NO_BLOCKS)  # leave the lazy fold: a story asks for block states after every event
        self.incarnation = incarnation
        self.request_of: dict[str, str] = {}  # transfer -> request, kept after the lease or load ends

    def _held(self, request: str) -> np.ndarray:
        req = self.ledger.requests.get(request)
        return NO_BLOCKS if req is None else req.blocks

    def resolve(self, e: ev.Event) -> tuple[str, str, np.ndarray, int, float | None]:
        """(request, transfer, blocks, generation, deadline) of ``e``, read before it is applied."""
        ledger = self.ledger
        transfer = getattr(e, "transfer", "")
        if isinstance(e, ev.SrcAllocated | ev.SrcShared | ev.TgtReserved):
            return e.request, "", ev.unpack_blocks(e.blocks), 0, None
        if isinstance(e, ev.SrcEvicted):
            return "", "", ev.unpack_blocks(e.blocks), 0, None
        if isinstance(e, ev.SrcGranted):
            self.request_of[e.transfer] = e.request
            return e.request, e.transfer, self._held(e.request), e.generation, e.expires_at
        if isinstance(e, ev.TgtLoadStarted):
            self.request_of[e.transfer] = e.request
            return e.request, e.transfer, self._held(e.request), e.generation, None
        if isinstance(e, ev.SrcLeaseRenewed | ev.SrcCancelDeferred | ev.SrcConsumerDone | ev.SrcLeaseReleased):
            lease = ledger.leases.get(e.transfer) if isinstance(ledger, SourceLedger) else None
            if lease is None:
                return self.request_of.get(e.transfer, ""), e.transfer, NO_BLOCKS, 0, None
            deadline = e.expires_at if isinstance(e, ev.SrcLeaseRenewed) else lease.expires_at
            return lease.request, e.transfer, lease.blocks, lease.generation, deadline
        if isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed | ev.TgtDigestMismatch):
            load = ledger.loads.get(e.transfer) if isinstance(ledger, TargetLedger) else None
            if load is None:
                return self.request_of.get(e.transfer, ""), e.transfer, NO_BLOCKS, 0, None
            blocks = ev.unpack_blocks(e.blocks) if isinstance(e, ev.TgtDigestMismatch) else self._held(load.request)
            return load.request, e.transfer, blocks, load.generation, None
        request = getattr(e, "request", "") or self.request_of.get(transfer, "")
        if isinstance(e, ev.StgStarted):
            self.request_of[e.transfer] = e.request
            return e.request, e.transfer, ev.unpack_blocks(e.blocks), e.generation, e.expires_at
        if isinstance(ledger, StagingLedger) and transfer:  # the pool's copies are its requests, by transfer
            copy = ledger.requests.get(transfer)
            if copy is None:
                return request, transfer, NO_BLOCKS, 0, None
            deadline = e.expires_at if isinstance(e, ev.StgServed | ev.StgRenewed) else copy.expires_at
            return copy.request, transfer, copy.blocks, copy.generation, deadline
        if isinstance(e, ev.PeerEpochChanged | ev.TransferObserved):
            return request, transfer, NO_BLOCKS, 0, None
        return request, transfer, self._held(request), 0, None

    def leftovers(self, worker: str, step_index: int) -> Restart:
        ledger = self.ledger
        leases = tuple(ledger.leases.values()) if isinstance(ledger, SourceLedger) else ()
        loads = tuple(ledger.loads.values()) if isinstance(ledger, TargetLedger) else ()
        held = {name: req.blocks for name, req in ledger.requests.items()}
        return Restart(worker, step_index, leases, loads, held)


def _reason(e: ev.Event) -> tuple[str, str]:
    if isinstance(e, ev.Refused):
        return e.reason, ""
    if isinstance(e, ev.SrcLeaseReleased):
        return e.reason, e.detail
    if isinstance(e, ev.TgtLoadFailed):
        return e.reason, "recompute" if e.recompute else ""
    if isinstance(e, ev.PeerEpochChanged):
        return "", f"{e.peer} epoch {e.epoch}"
    if isinstance(e, ev.TgtLoadStarted):
        epoch = f" (epoch {e.peer_epoch})" if e.peer_epoch else ""
        return "", f"{e.mode} from {e.peer or '?'}{epoch}, {e.parts} part(s)"
    if isinstance(e, ev.TgtPartDone):
        return "", f"part {e.part}" + (f", {e.verified} block(s) verified" if e.verified else "")
    if isinstance(e, ev.TgtDigestMismatch):
        return "digest mismatch", digest_words(e)
    if isinstance(e, ev.SrcConsumerDone):
        return "", f"consumer {e.consumer}"
    if isinstance(e, ev.SrcGranted):
        return "", f"{e.consumers} consumer(s)" + (f", for {e.peer}" if e.peer else "")
    if isinstance(e, ev.SrcLeaseRenewed) and e.peer:
        return "", f"claimed by {e.peer}"
    if isinstance(e, ev.StgReleased):
        return e.reason, e.detail
    if isinstance(e, ev.StgAborted):
        return e.reason, ""
    if isinstance(e, ev.StgStarted):
        return "", f"from P's blocks {block_ranges(ev.unpack_blocks(e.gpu_blocks))} (epoch {e.gpu_epoch})"
    if isinstance(e, ev.StgServed):
        return "", f"claimed by {e.peer}" if e.peer else ""
    if isinstance(e, ev.StgReadEnded):
        return ("" if e.ok else e.reason or "failed"), f"consumer {e.consumer}"
    if isinstance(e, ev.TransferObserved):
        return "" if e.ok else "failed", (f"{e.nbytes} bytes, {e.descriptors} descriptors over {e.backend}, "
                                          f"T_post {e.t_post_s * 1e3:.3f} ms, T_xfer {e.t_xfer_s * 1e3:.3f} ms")
    return "", ""


def trace_logs(
    paths: Iterable[str | os.PathLike[str]],
    *,
    until_time: float | None = None,
    until_offset_s: float | None = None,
    until_index: int | None = None,
) -> Trace:
    """Every event of the logs at ``paths`` (directories, as ``replay`` takes them), merged in HLC order and folded
    per worker. ``until_time`` (wall seconds) or ``until_offset_s`` (seconds after the first event of all the logs)
    stops each log at its first event past that moment; ``until_index`` after that many events of each log.

    Raises :class:`~kvlifecycle.eventlog.LogError` for a log that cannot be read and
    :class:`~kvlifecycle.ledger.ReplayError` (naming the worker and the event) for an event no ledger could have
    written."""
    paths = list(paths)
    sources = {source.worker: source for source, _reader in open_sources(paths)}
    if not sources:
        raise LogError("no event logs given")
    tails: dict[str, TailRecovery] = {}
    merged = merge_logs(paths, tails=tails)
    offsets = _worker_offsets(merged)
    t0 = min((record.event.at + offsets[w] for w, _s, record in merged), default=0.0)
    if until_offset_s is not None:
        until_time = t0 + until_offset_s
    logs: dict[str, WorkerLog] = {}
    folds: dict[str, _Fold] = {}
    stopped: set[str] = set()
    steps: list[Step] = []
    restarts: list[Restart] = []
    for worker, side, record in merged:
        if worker in stopped:
            continue
        e = record.event
        wall = e.at + offsets[worker]
        if (until_index is not None and record.index >= until_index) or (
            until_time is not None and wall > until_time
        ):
            stopped.add(worker)
            continue
        source = sources[worker]
        fold = folds.get(worker)
        fresh = fold is not None and fold.incarnation != record.incarnation
        if fold is not None and fresh:
            restarts.append(fold.leftovers(worker, len(steps)))
        if fold is None or fresh:
            fold = folds[worker] = _Fold(source.header, record.incarnation, source.path)
        if worker not in logs:
            logs[worker] = WorkerLog(str(source.path), worker, side, source.header, fold.ledger)
        log = logs[worker]
        log.ledger = fold.ledger
        request, transfer, blocks, generation, deadline = fold.resolve(e)
        try:
            before = fold.ledger.block_states(blocks)
            fold.ledger.apply(e)
            after = fold.ledger.block_states(blocks)
        except (ReplayError, IndexError, ValueError) as exc:
            raise ReplayError(f"{source.path}: event {record.index} ({type(e).__name__}) cannot be folded: {exc}") \
                from exc
        epoch = int(fold.ledger.epoch[blocks[0]]) if blocks.size else 0
        reason, detail = _reason(e)
        steps.append(Step(len(steps), worker, side, record.index, record.incarnation, e, wall, request, transfer,
                          blocks, before, after, epoch, generation, deadline, reason, detail, fresh))
        log.events.append(e)
        log.end_at = e.at
    for worker, source in sources.items():  # a log with no event before ``until`` still has a (fresh) ledger
        if worker not in logs:
            logs[worker] = WorkerLog(str(source.path), worker, source.side, source.header,
                                     _Fold(source.header, 0, source.path).ledger)
    for fold in folds.values():
        fold.ledger.end_replay()
    last_wall = {s.worker: s.wall for s in steps}
    cut = {w: until_time if until_time is not None else last_wall.get(w, t0) for w in stopped}
    return Trace(steps, logs, restarts, t0, tails, cut)


# --- a request's story -----------------------------------------------------------------------------------------


@dataclass
class LeaseSummary:
    transfer: str
    generation: int
    granted_wall: float
    expires_at: float  # ledger clock of the worker that granted it
    granted_at: float = 0.0  # the grant's ledger-clock time (the deadline's zero)
    renewals: int = 0
    peers: list[str] = field(default_factory=list)
    ended: str = ""  # release reason; "" while live
    ended_wall: float | None = None
    detail: str = ""


@dataclass
class LoadSummary:
    transfer: str
    generation: int
    mode: str
    parts: int
    peer: str
    started_wall: float
    parts_done: list[int] = field(default_factory=list)
    outcome: str = ""  # ready | failed | recompute | discarded; "" while in flight
    settled_wall: float | None = None
    reason: str = ""
    verified_parts: int = 0  # parts whose landed bytes D checked against P's digests, and they matched
    verified_blocks: int = 0  # the units (P blocks) of those parts
    mismatched_blocks: int = 0  # units whose landed bytes failed their digest (TgtDigestMismatch)


@dataclass
class WorkerPart:
    """What one worker did for a request."""

    worker: str
    side: str
    request: str = ""  # the worker's own id for the request (vLLM's D names it differently from P)
    blocks: str = ""
    epoch: int = 0
    state: str = ""  # the blocks' state now, or how the worker let them go (freed, cached, finished, ...)
    settled: bool = False  # the worker has nothing left in flight for the request
    leases: list[LeaseSummary] = field(default_factory=list)
    loads: list[LoadSummary] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


@dataclass
class RequestStory:
    request: str
    steps: list[Step]
    parts: list[WorkerPart]

    @property
    def ended(self) -> bool:
        return bool(self.parts) and all(part.settled for part in self.parts)

    @property
    def outcome(self) -> str:
        if not self.parts:
            return "not in these logs"
        return "; ".join(f"{p.worker}: {p.state}" for p in self.parts)


def requests_of(trace: Trace) -> dict[str, list[Step]]:
    """Each request named in the trace, with its steps (in order of first appearance)."""
    out: dict[str, list[Step]] = {}
    for s in trace.steps:
        if s.request:
            out.setdefault(s.request, []).append(s)
    return out


def linked_steps(trace: Trace, request: str) -> list[Step]:
    """The steps of ``request`` and of the requests other workers moved its KV under: the ids an engine gives
    one request can differ per side (vLLM's D names it anew), the transfers they share cannot."""
    own = [s for s in trace.steps if s.request == request]
    transfers = {t for s in own if s.transfer for t in (s.transfer, *source_transfers(s.transfer))}
    if not transfers:
        return own
    linked = {s.request for s in trace.steps if s.request and s.request != request and s.transfer
              and (s.transfer in transfers or not transfers.isdisjoint(source_transfers(s.transfer)))}
    if not linked:
        return own
    return [s for s in trace.steps if s.request == request or s.request in linked]


def no_such_request(trace: Trace, requests: Sequence[str]) -> NotInLogsError:
    """The error for ids that name no request of the trace, listing (the first 20 of) those it holds."""
    known = sorted({s.request for s in trace.steps if s.request})
    more = ", ..." if len(known) > 20 else ""
    asked = " or ".join(repr(r) for r in requests)
    return NotInLogsError(f"no request {asked} in these logs (requests: {', '.join(known[:20])}{more})")


def request_story(trace: Trace, request: str, steps: list[Step] | None = None) -> RequestStory:
    """Every step of ``request`` on every worker (including refusals of its transfers) and what each worker holds
    of it where the trace ends. ``steps``: the request's steps, when already picked out (:func:`requests_of`)."""
    if steps is None:
        steps = linked_steps(trace, request)
    parts: dict[str, WorkerPart] = {}
    cancelled: set[str] = set()  # workers where the request was cancelled while its load was in flight
    for s in steps:
        part = parts.setdefault(s.worker, WorkerPart(s.worker, s.side, s.request))
        e = s.event
        if isinstance(e, ev.SrcAllocated | ev.SrcShared | ev.TgtReserved):
            part.blocks, part.epoch, part.leases, part.loads = block_ranges(s.blocks), s.epoch, [], []
            cancelled.discard(s.worker)
        elif isinstance(e, ev.SrcGranted):
            part.leases.append(LeaseSummary(e.transfer, e.generation, s.wall, e.expires_at, e.at,
                                            peers=[e.peer] if e.peer else []))
        elif isinstance(e, ev.SrcLeaseRenewed | ev.SrcLeaseReleased):
            lease = next((x for x in part.leases if x.transfer == e.transfer), None)
            if lease is None:
                continue
            if isinstance(e, ev.SrcLeaseRenewed):
                lease.renewals += 1
                lease.expires_at = e.expires_at
                if e.peer and e.peer not in lease.peers:
                    lease.peers.append(e.peer)
            else:
                lease.ended, lease.ended_wall, lease.detail = e.reason, s.wall, e.detail
        elif isinstance(e, ev.TgtLoadStarted):
            part.loads.append(LoadSummary(e.transfer, e.generation, e.mode, e.parts, e.peer, s.wall))
        elif isinstance(e, ev.TgtCancelled):
            cancelled.add(s.worker)
        elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed):
            load = next((x for x in part.loads if x.transfer == e.transfer and not x.outcome), None)
            if load is None:
                continue
            if isinstance(e, ev.TgtPartDone):
                load.parts_done.append(e.part)
                load.verified_parts += bool(e.verified)
                load.verified_blocks += e.verified
                if len(load.parts_done) == load.parts:
                    load.outcome = "discarded" if s.worker in cancelled else "ready"
                    load.settled_wall = s.wall
            else:
                load.outcome = "discarded" if s.worker in cancelled else ("recompute" if e.recompute else "failed")
                load.settled_wall, load.reason = s.wall, e.reason
        elif isinstance(e, ev.TgtDigestMismatch):
            load = next((x for x in part.loads if x.transfer == e.transfer and not x.outcome), None)
            if load is not None:
                load.mismatched_blocks += len(e.expected) // 8
        elif isinstance(e, ev.StgStarted):  # P's host pool took the lease over: the staged copy's own lease
            part.blocks, part.epoch = block_ranges(s.blocks), s.epoch
            part.leases.append(LeaseSummary(e.transfer, e.generation, s.wall, e.expires_at, e.at))
        elif isinstance(e, ev.StgServed | ev.StgRenewed | ev.StgAborted | ev.StgReleased):
            lease = next((x for x in part.leases if x.transfer == e.transfer), None)
            if lease is None:
                continue
            if isinstance(e, ev.StgServed | ev.StgRenewed):
                lease.renewals += 1
                lease.expires_at = e.expires_at
                if e.peer and e.peer not in lease.peers:
                    lease.peers.append(e.peer)
            else:
                lease.ended, lease.ended_wall = e.reason, s.wall
                lease.detail = e.detail if isinstance(e, ev.StgReleased) else "copy dropped"
        elif isinstance(e, ev.Refused):
            part.refusals.append(f"{e.command}: {e.reason}")
    for part in parts.values():
        log = trace.logs[part.worker]
        held = _held_by(log.ledger, part.request or request)
        if held is not None:
            states = {log.state_name(int(v)) for v in log.ledger.block_states(held.blocks).tolist()}
            cancel_pending = bool(getattr(held, "cancel_pending", False))
            part.state = "/".join(sorted(states)) + (" (cancel pending)" if cancel_pending else "")
            # D decoding from READY_FOR_ATTENTION blocks is the handoff's end; anything else is still in flight
            part.settled = part.side == "target" and states <= {"READY_FOR_ATTENTION"} and not cancel_pending
        else:
            part.state = _let_go(trace, steps, part.worker, part.request or request)
            part.settled = True
    return RequestStory(request, steps, list(parts.values()))


def _held_by(ledger: SourceLedger | TargetLedger | StagingLedger, request: str) -> Any:
    """The ledger's record of what it holds for ``request`` (P's host pool keys its copies by transfer)."""
    if isinstance(ledger, StagingLedger):
        return next((copy for copy in ledger.requests.values() if copy.request == request), None)
    return ledger.requests.get(request)


def _let_go(trace: Trace, steps: list[Step], worker: str, request: str) -> str:
    """How a worker that no longer holds a request's blocks let them go."""
    mine = [s for s in steps if s.worker == worker]
    outcome, cancelled = "never held blocks (refusals only)", False
    for s in mine:
        e = s.event
        if isinstance(e, ev.SrcAllocated | ev.SrcShared | ev.TgtReserved):
            outcome, cancelled = "holding", False
        elif isinstance(e, ev.TgtCancelled):
            outcome, cancelled = "cancelled", True
        elif isinstance(e, ev.SrcFreed):
            outcome = "cached" if e.cached else "freed"
        elif isinstance(e, ev.SrcAborted):
            outcome = "aborted"
        elif isinstance(e, ev.TgtFinished):
            outcome = "finished"
        elif isinstance(e, ev.TgtLoadFailed) and not e.recompute:
            outcome = "cancelled, load discarded" if cancelled else f"load failed ({e.reason}), blocks freed"
        elif isinstance(e, ev.TgtPartDone) and cancelled:
            outcome = "cancelled, load discarded"
        elif isinstance(e, ev.StgStarted):
            outcome = "holding"
        elif isinstance(e, ev.StgAborted):
            outcome = f"copy to host dropped ({e.reason})"
        elif isinstance(e, ev.StgReleased):
            outcome = f"staged copy released ({e.reason})"
    last = mine[-1].index if mine else -1
    if any(r.worker == worker and r.step_index > last and request in r.held for r in trace.restarts):
        return "lost when its worker restarted"
    return outcome


# --- a block's life --------------------------------------------------------------------------------------------


@dataclass
class TransferUse:
    transfer: str
    generation: int
    how: str  # e.g. "read by d0 (pull)", "written by p0 (push)"
    outcome: str = ""


@dataclass
class BlockEpoch:
    epoch: int
    request: str
    states: list[tuple[str, float]] = field(default_factory=list)  # (state, wall time it was entered)
    transfers: list[TransferUse] = field(default_factory=list)


@dataclass
class BlockStory:
    worker: str
    side: str
    block: int
    steps: list[Step]  # the worker's steps that touched the block, and its peers' steps of transfers that used it
    epochs: list[BlockEpoch]
    state: str  # where the trace ends
    epoch: int


def block_story(trace: Trace, block: int, worker: str) -> BlockStory:
    """The life of ``block`` on ``worker`` (a name or a side): each allocation epoch, its owner, every state it
    passed through and when, and the transfers that read or wrote it (with the peers' steps of those transfers)."""
    worker = trace.worker_of(worker)
    log = trace.logs[worker]
    if not 0 <= block < log.ledger.num_blocks:
        raise NotInLogsError(f"block {block} is not in {worker}'s pool of {log.ledger.num_blocks}")
    epochs: list[BlockEpoch] = []
    own_transfers: dict[str, TransferUse] = {}
    mine: list[Step] = []
    for s in trace.steps:
        if s.worker != worker or not (s.blocks.size and (s.blocks == block).any()):
            continue
        mine.append(s)
        e = s.event
        state = s.state_after(block)
        if isinstance(e, ev.SrcAllocated | ev.SrcShared | ev.TgtReserved) and (
            not epochs or epochs[-1].epoch != s.epoch
        ):
            epochs.append(BlockEpoch(s.epoch, s.request))
        if not epochs:  # a block first seen mid-life (a log cut by --until-index, an evict of a cached block)
            epochs.append(BlockEpoch(s.epoch, s.request))
        current = epochs[-1]
        if state is not None and (not current.states or current.states[-1][0] != state):
            current.states.append((state, s.wall))
        if isinstance(e, ev.SrcGranted):
            use = TransferUse(e.transfer, e.generation, "pinned for a reader")
            own_transfers[e.transfer] = use
            current.transfers.append(use)
        elif isinstance(e, ev.TgtLoadStarted):
            use = TransferUse(e.transfer, e.generation,
                              f"written by {e.peer or 'its peer'} ({'push' if e.mode == 'push' else 'pull'})")
            own_transfers[e.transfer] = use
            current.transfers.append(use)
        elif isinstance(e, ev.SrcLeaseReleased) and e.transfer in own_transfers:
            own_transfers[e.transfer].outcome = f"released ({e.reason})"
        elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed) and e.transfer in own_transfers:
            use = own_transfers[e.transfer]
            if isinstance(e, ev.TgtLoadFailed):
                use.outcome = f"failed ({e.reason})"
            elif state == "READY_FOR_ATTENTION":
                use.outcome = "loaded"
            elif state == "FREE":
                use.outcome = "loaded, then discarded (the request was cancelled)"
    # a transfer goes by one id on P and, for a multi-rank load, by a combined one on D: match either way
    wanted = {name: own for own in own_transfers for name in [own, *source_transfers(own)]}
    peers: list[Step] = []
    for s in trace.steps:
        if s.worker == worker or not s.transfer:
            continue
        hit = {wanted[name] for name in [s.transfer, *source_transfers(s.transfer)] if name in wanted}
        if not hit:
            continue
        peers.append(s)
        if log.side == "source" and isinstance(s.event, ev.TgtLoadStarted):
            for transfer in hit:
                mode = s.event.mode
                own_transfers[transfer].how = (f"read by {s.worker} (pull)" if mode == "pull"
                                               else f"read by {worker} to write into {s.worker} (push)")
    steps = sorted(mine + peers, key=lambda s: s.index)
    state_now = log.state_name(int(log.ledger.block_states([block])[0]))
    return BlockStory(worker, log.side, block, steps, epochs, state_now, int(log.ledger.epoch[block]))


# --- JSON-friendly views (what ``--json`` prints, and what the terminal tables are drawn from) ------------------


def step_view(trace: Trace, step: Step) -> dict[str, Any]:
    left = step.lease_left_s
    return {
        "t_ms": round(trace.ms(step.wall), 3),
        "wall": step.wall,
        "hlc": step.event.hlc,
        "worker": step.worker,
        "side": step.side,
        "log_index": step.log_index,
        "request": step.request,
        "event": step.label,
        "kind": step.kind,
        "blocks": block_ranges(step.blocks),
        "transitions": [{"blocks": t.blocks, "before": t.before, "after": t.after} for t in step.transitions],
        "transfer": step.transfer,
        "generation": step.generation,
        "epoch": step.epoch,
        "lease_deadline_ms": None if left is None else round(trace.ms(step.wall + left), 3),
        "lease_left_s": None if left is None else round(left, 6),
        "reason": step.reason,
        "detail": step.detail,
        "after_restart": step.new_incarnation,
    }


def request_view(trace: Trace, story: RequestStory) -> dict[str, Any]:
    def ms(wall: float | None) -> float | None:
        return None if wall is None else round(trace.ms(wall), 3)

    parts = []
    for part in story.parts:
        parts.append({
            "worker": part.worker,
            "side": part.side,
            "blocks": part.blocks,
            "epoch": part.epoch,
            "state": part.state,
            "settled": part.settled,
            "leases": [{"transfer": x.transfer, "generation": x.generation, "granted_ms": ms(x.granted_wall),
                        "deadline_ms": ms(x.granted_wall + x.expires_at - x.granted_at),
                        "renewals": x.renewals, "peers": x.peers, "ended": x.ended or None,
                        "ended_ms": ms(x.ended_wall), "detail": x.detail} for x in part.leases],
            "loads": [{"transfer": x.transfer, "generation": x.generation, "mode": x.mode, "parts": x.parts,
                       "parts_done": x.parts_done, "peer": x.peer, "started_ms": ms(x.started_wall),
                       "outcome": x.outcome or None, "settled_ms": ms(x.settled_wall), "reason": x.reason,
                       "verified_parts": x.verified_parts, "verified_blocks": x.verified_blocks,
                       "mismatched_blocks": x.mismatched_blocks}
                      for x in part.loads],
            "refusals": part.refusals,
        })
    return {"request": story.request, "t0": trace.t0, "outcome": story.outcome, "ended": story.ended,
            "parts": parts, "steps": [step_view(trace, s) for s in story.steps]}


def block_view(trace: Trace, story: BlockStory) -> dict[str, Any]:
    return {
        "worker": story.worker,
        "side": story.side,
        "block": story.block,
        "t0": trace.t0,
        "state": story.state,
        "epoch": story.epoch,
        "epochs": [{"epoch": x.epoch, "request": x.request,
                    "states": [{"state": state, "since_ms": round(trace.ms(wall), 3)} for state, wall in x.states],
                    "transfers": [{"transfer": u.transfer, "generation": u.generation, "how": u.how,
                                   "outcome": u.outcome} for u in x.transfers]} for x in story.epochs],
        "steps": [step_view(trace, s) for s in story.steps],
    }
