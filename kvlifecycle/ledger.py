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
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.blockids import MAX_BLOCKS, DuplicateScratch, parse_block_ids
from kvlifecycle.choices import LoadFailurePolicy, LoadFailurePolicyName, Side, SideName, TransferMode, TransferModeName
from kvlifecycle.clock import Clock, HybridLogicalClock, MonotonicClock
from kvlifecycle.eventlog import LogError
from kvlifecycle.machines import INVALID, SOURCE, TARGET, SourceState, TargetState

if TYPE_CHECKING:
    from kvlifecycle.eventlog import FsyncPolicy

BLOCK_DTYPE = ev.BLOCK_DTYPE
_MODE_SPELLINGS = TransferMode.spellings()  # start_load is on the launch path: a lookup, not an enum parse
_encode = ev.ENCODER.encode
DEFAULT_TTL_S = 30.0


class _Step:
    """``Ledger.step()``: a class, not a generator, because it sits on the launch path (enter/exit cost)."""

    __slots__ = ("ledger", "outer")

    def __init__(self, ledger: Any) -> None:
        self.ledger = ledger
        self.outer = False

    def __enter__(self) -> None:
        ledger = self.ledger
        with ledger._lock:
            self.outer = ledger._deferred is None
            if self.outer:
                ledger._deferred = []

    def __exit__(self, *exc: object) -> None:
        if self.outer:
            self.ledger._end_step()


class LedgerError(Exception):
    """Base class of the ledger's refusals that the caller must act on."""


class BlockBusyError(LedgerError):
    """An allocator tried to hand out a block that is not free (e.g. still pinned for a transfer)."""


class InvalidTransitionError(LedgerError):
    """A command whose edge does not exist from the blocks' current state."""


class UnknownRequestError(LedgerError):
    pass


class InvalidBlockIdsError(LedgerError, ValueError):
    """Block ids that name no block, name one twice, or are not integers (a refusal: a ``Refused`` is recorded)."""


class ReplayError(LedgerError, LogError):
    """A log holds an event that cannot have come from a ledger (edited, or from another ledger).

    A :class:`~kvlifecycle.eventlog.LogError` too: for a reader, a well-framed but impossible log is as unreadable
    as a corrupt one (``kvlifecycle replay`` exits 2 on either)."""


# what a handler can raise on an event no ledger could have written (an unknown request, a bad id, a wrong type)
_FOLD_ERRORS = (KeyError, ValueError, IndexError, TypeError, AttributeError, OverflowError)


@dataclass(frozen=True, slots=True)
class Grant:
    """What P publishes for a request's handoff (inside ``kv_transfer_params`` or a bootstrap message)."""

    request: str
    transfer: str
    generation: int
    worker: str
    block_ids: np.ndarray
    epoch: int  # allocation epoch of the request's blocks (per block: ``epochs``)
    consumers: int
    ttl_s: float
    expires_at: float

    @property
    def epochs(self) -> np.ndarray:
        return np.full(self.block_ids.size, self.epoch, dtype=np.uint32)

    def to_wire(self) -> dict[str, Any]:
        return {
            "request": self.request,
            "transfer": self.transfer,
            "generation": self.generation,
            "worker": self.worker,
            "block_ids": self.block_ids.tolist(),
            "epoch": self.epoch,
            "consumers": self.consumers,
            "ttl_s": self.ttl_s,
        }


@dataclass(frozen=True, slots=True)
class Released:
    """A lease that ended; the engine may now free (or cache) the request's blocks."""

    request: str
    transfer: str
    reason: str


MIXED = -1  # a request whose blocks are not all in one state (prefix sharing): handled per block


@dataclass(slots=True)
class _SourceRequest:
    blocks: np.ndarray
    epoch: int  # the allocation epoch of the request's own blocks
    state: int  # the state of every block of the request, while it holds them exclusively
    shared: bool = False  # some block is referenced by another request: per-block (vectorised) handling
    leases: list[str] = field(default_factory=list)
    block_epochs: np.ndarray | None = None  # per-block epochs, for shared requests

    @property
    def epochs(self) -> np.ndarray:
        if self.block_epochs is not None:
            return self.block_epochs
        return np.full(self.blocks.size, self.epoch, dtype=np.uint32)


@dataclass(slots=True)
class Lease:
    transfer: str
    request: str
    generation: int
    blocks: np.ndarray
    epoch: int
    consumers: int
    expires_at: float
    ttl_s: float
    peers: set[str]  # consumers bound to the lease (at grant, or by their first heartbeat)
    granted_at: float
    done: set[int] = field(default_factory=set)
    claimed: bool = False  # a consumer heartbeated: it may be reading right now
    cancel_deferred: bool = False
    block_epochs: np.ndarray | None = None

    @property
    def epochs(self) -> np.ndarray:
        if self.block_epochs is not None:
            return self.block_epochs
        return np.full(self.blocks.size, self.epoch, dtype=np.uint32)


@dataclass(slots=True)
class _TargetRequest:
    blocks: np.ndarray
    epoch: int
    state: int
    transfer: str | None = None
    cancel_pending: bool = False

    @property
    def epochs(self) -> np.ndarray:
        return np.full(self.blocks.size, self.epoch, dtype=np.uint32)


@dataclass(slots=True)
class Load:
    transfer: str
    request: str
    parts: int
    generation: int
    peer: str
    peer_epoch: int
    started_at: float
    done: set[int] = field(default_factory=set)


Listener = Callable[[ev.Event], None]


class _Ledger:
    """What both sides share: block arrays, epochs, the event plumbing, and the compiled machine.

    Hot path: a request's blocks move together, so while a request holds its blocks exclusively its state is one
    scalar, validated against the compiled table with a Python lookup, and the block array gets one vectorised
    write per transition. Replay is lazier still: it writes only epochs as it goes and derives every block's final
    state in one gather at the end (``_materialize``).
    """

    side = ""
    _machine = SOURCE

    def __init__(
        self,
        num_blocks: int,
        *,
        log: Any | None = None,
        clock: Clock | None = None,
        hlc: HybridLogicalClock | None = None,
        worker: str = "",
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise TypeError(f"num_blocks must be an integer, got {type(num_blocks).__name__}")
        if not 0 < num_blocks <= MAX_BLOCKS:
            raise ValueError(f"num_blocks must be in [1, {MAX_BLOCKS}], got {num_blocks}")
        self.num_blocks = int(num_blocks)
        self.worker = worker or f"{self.side}-{os.getpid()}"
        # transfer ids must never repeat across restarts of a worker that keeps its name
        self.incarnation = int.from_bytes(os.urandom(4), "little")
        self.log = log
        self.clock = clock or MonotonicClock()
        self.hlc = hlc or HybridLogicalClock()
        self._state = np.zeros(self.num_blocks, dtype=np.uint8)
        self.epoch = np.zeros(self.num_blocks, dtype=np.uint32)  # = the allocation sequence number that owns it
        self._duplicates = DuplicateScratch(self.num_blocks)
        self.allocations = 0  # allocation sequence; a block's epoch is the sequence number of its last allocation
        self.refusals: dict[str, int] = {}
        self.peer_epochs: dict[str, int] = {}
        self.listeners: list[Listener] = []
        self._lock = threading.RLock()
        self._deferred: list[ev.Event] | None = None  # inside step(): events whose log record waits for its end
        self._replaying = False
        self._lazy = False
        self._final: dict[int, int] = {}  # lazy replay: allocation seq -> state its blocks were left in
        self._owner: dict[int, str] = {}  # allocation seq -> request, for requests that hold their blocks
        self._owned = int(self._machine.triggers[self._first_trigger].when_true[0])  # FREE -> first owned state
        self._handlers: dict[type, Callable[[Any], None]] = {}
        # scalar views of the compiled tables, for per-request transitions
        self._next = {
            name: (tuple(int(x) for x in t.when_true), tuple(int(x) for x in t.when_false))
            for name, t in self._machine.triggers.items()
        }

    @property
    def state(self) -> np.ndarray:
        """Every block's exact state, as a new array.

        Internally a block held by one request stores only an "owned" marker (the machine's first owned state): the
        request's scalar state is the truth, so a transition costs no per-block write. This view puts them together.
        """
        if self._lazy:
            self._materialize()
        view = self._state.copy()
        for req in self.requests.values():
            if req.state >= 0 and req.state != self._owned:
                view[req.blocks] = req.state
        return view

    def block_states(self, block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """The exact states of just these blocks (cheaper than :attr:`state`, which builds the whole array)."""
        ids = self._as_blocks(block_ids)
        if self._lazy:
            self._materialize()
        out = self._state.take(ids)
        owned = out == self._owned
        if owned.any():
            epochs = self.epoch.take(ids)
            for seq in np.unique(epochs[owned]).tolist():
                owner = self._owner.get(seq)
                req = self.requests.get(owner) if owner is not None else None
                if req is not None and req.state >= 0:
                    out[owned & (epochs == seq)] = req.state
        return out

    def _block_state(self, block: int) -> int:
        stored = int(self._state[block])
        if stored == self._owned:
            owner = self._owner.get(int(self.epoch[block]))
            req = self.requests.get(owner) if owner is not None else None
            if req is not None and req.state >= 0:
                return req.state
        return stored

    # -- events ---------------------------------------------------------------------------------------------------
    def _record(self, event: ev.Event) -> None:
        log, deferred = self.log, self._deferred
        if log is not None and deferred is None:
            payload = _encode(event)  # first: an event that cannot be logged raises before the state changes
            self._handlers[type(event)](event)
            log.append_payload(payload)
        else:
            self._handlers[type(event)](event)
            if log is not None:
                deferred.append(event)  # type: ignore[union-attr]  # encoded when the log writes its batch
        if self.listeners:
            for listener in self.listeners:
                listener(event)

    def apply(self, event: ev.Event) -> None:
        """Fold one event into the state (replay). Raises :class:`ReplayError` for an impossible event."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise ReplayError(f"{type(event).__name__} does not belong in a {self.side} log")
        if event.hlc > self.hlc.last:
            self.hlc.observe(event.hlc)
        try:
            handler(event)
        except _FOLD_ERRORS as exc:
            raise self._impossible(event, exc) from exc

    def apply_all(self, events: Iterable[ev.Event]) -> None:
        """Fold many events (the replay loop: one dispatch per event, nothing else). An event that cannot be folded
        raises :class:`ReplayError` naming it; nothing else escapes."""
        handlers = self._handlers
        last = 0
        event: Any = None
        try:
            for event in events:
                handlers[type(event)](event)
                last = event.hlc
        except _FOLD_ERRORS as exc:
            if type(event) not in handlers:
                raise ReplayError(f"{type(event).__name__} does not belong in a {self.side} log") from None
            raise self._impossible(event, exc) from exc
        if last > self.hlc.last:
            self.hlc.observe(last)

    @staticmethod
    def _impossible(event: ev.Event, exc: BaseException) -> ReplayError:
        """One line naming the event and what is wrong with it."""
        names = ("request", "transfer")
        about = ", ".join(f"{n}={getattr(event, n)!r}" for n in names if getattr(event, n, ""))
        what = f"names unknown {exc}" if isinstance(exc, KeyError) else f"{type(exc).__name__}: {exc}"
        text = f"{type(event).__name__}({about}) at hlc {event.hlc} cannot be folded: {what}"
        return ReplayError(" ".join(text.split()))

    def _stamp(self) -> tuple[int, float]:
        return self.hlc.tick(), self.clock.now()

    def _refuse(self, command: str, reason: str, request: str = "", transfer: str = "") -> None:
        hlc, at = self._stamp()
        # a name that is not a string (a caller's bug) is recorded as its repr: the log must stay decodable
        request = request if request.__class__ is str else repr(request)
        transfer = transfer if transfer.__class__ is str else repr(transfer)
        self._record(ev.Refused(hlc, at, command, reason, request, transfer))

    def refuse(self, command: str, reason: str, request: str = "", transfer: str = "") -> None:
        """Record a refusal decided in front of the ledger (a wrong claim token at the side channel)."""
        with self._lock:
            self._refuse(command, reason, request, transfer)

    def _check_name(self, command: str, request: str) -> None:
        """A new request's id must be a string (it is logged as one; anything else would make the log unreadable)."""
        if request.__class__ is not str and not isinstance(request, str):
            reason = f"request id not a string: {type(request).__name__}"
            self._refuse(command, reason, request)
            raise UnknownRequestError(reason)

    def _on_refused(self, event: ev.Refused) -> None:
        key = f"{event.command}: {event.reason.split(':')[0]}"
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def _on_observed(self, event: ev.TransferObserved) -> None:
        pass

    def _on_peer_epoch(self, event: ev.PeerEpochChanged) -> None:
        self.peer_epochs[event.peer] = event.epoch

    def _scalar(self, trigger: str, state: int, guard: bool = True) -> int:
        """Next state of a whole request; ``ReplayError`` in replay, ``INVALID`` otherwise."""
        nxt = self._next[trigger][0 if guard else 1][state] if state >= 0 else INVALID
        if nxt < 0 and self._replaying:
            raise ReplayError(f"{trigger} is not an edge from {self._state_enum(state).name}")
        return nxt

    def _step(self, trigger: str, block_ids: np.ndarray, guard: np.ndarray | bool | None = None) -> np.ndarray:
        """Next states of individual blocks (the vectorised path)."""
        nxt = self._machine.step(trigger, self._state[block_ids], guard)
        if self._replaying and nxt.size and nxt.min() < 0:
            bad = int(block_ids[int(np.argmin(nxt))])
            raise ReplayError(
                f"{trigger} is not an edge from {self._state_enum(int(self._state[bad])).name} (block {bad})"
            )
        return nxt

    def _first_invalid(self, trigger: str, block_ids: np.ndarray, nxt: np.ndarray) -> str:
        i = int(np.argmin(nxt))
        block = int(block_ids[i])
        return f"block {block} is {self._state_enum(self._block_state(block)).name}, no {trigger!r} edge from there"

    def _check_allocatable(self, command: str, request: str, ids: np.ndarray) -> None:
        self._check_name(command, request)
        if request in self.requests:
            self._refuse(command, "duplicate request id", request)
            raise BlockBusyError(f"request {request!r} already holds blocks")
        current = self._state.take(ids)  # ids checked by _command_blocks
        if np.count_nonzero(current):  # fast path: every block FREE (0); count_nonzero is ~5x cheaper than any()
            nxt = self._machine.triggers[command].when_true.take(current)
            if nxt.min() < 0:
                reason = self._first_invalid(command, ids, nxt)
                self._refuse(command, reason, request)
                raise BlockBusyError(reason)

    def _state_enum(self, value: int) -> Any:
        raise NotImplementedError

    def _as_blocks(self, block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """Ids for a query (no event): any number of them, repeats allowed."""
        ids, reason = parse_block_ids(block_ids, self.num_blocks, allow_empty=True)
        if reason:
            raise InvalidBlockIdsError(reason)
        return ids

    def _command_blocks(self, command: str, block_ids: Iterable[int] | np.ndarray, request: str = "") -> np.ndarray:
        """Ids for a command (under the lock): at least one, each once, each in the pool — or the command is refused
        (recorded) with :class:`InvalidBlockIdsError`."""
        ids, reason = parse_block_ids(block_ids, self.num_blocks, self._duplicates)
        if reason:
            self._refuse(command, reason, request)
            raise InvalidBlockIdsError(reason)
        return ids

    def _logged_blocks(self, raw: bytes) -> np.ndarray:
        """The ids of a logged event. Replay checks their range (a log is input, and a negative id would wrap
        silently in a scatter); a live command checked them in full already. Replay speed matters here: one
        reduction, no duplicate check (a repeated id cannot corrupt the fold)."""
        if not self._replaying:
            return ev.unpack_blocks(raw)
        if len(raw) % BLOCK_DTYPE.itemsize:
            raise ReplayError(f"a block list of {len(raw)} bytes is not a whole number of int32 ids")
        ids = ev.unpack_blocks(raw)
        if ids.size and int(ids.view(np.uint32).max()) >= self.num_blocks:
            _, reason = parse_block_ids(ids, self.num_blocks)
            raise ReplayError(f"{reason} (a log of a pool of {self.num_blocks} blocks)")
        return ids

    def _new_allocation(self, ids: np.ndarray, request: str) -> int:
        self.allocations += 1
        self.epoch.put(ids, self.allocations)  # put() is the cheapest scatter numpy has for this
        if not self._lazy:
            self._state.put(ids, self._owned)
        self._owner[self.allocations] = request
        return self.allocations

    def _released_blocks(self, req: Any, final: int) -> None:
        """A request gave its blocks up, leaving them in ``final`` (FREE or PREFIX_CACHED)."""
        self._owner.pop(req.epoch, None)
        if self._lazy:
            self._final[req.epoch] = final
        else:
            self._state.put(req.blocks, final)

    def _materialize(self) -> None:
        """End of a lazy replay: each block's state is the state its last allocation left it in."""
        final = np.zeros(self.allocations + 1, dtype=np.uint8)
        for seq, state in self._final.items():
            final[seq] = state
        for req in self.requests.values():
            final[req.epoch] = self._owned
        self._state[:] = final.take(self.epoch)
        self._final = {}
        self._lazy = False
        self._after_materialize()

    def _after_materialize(self) -> None:
        pass

    def observe_transfer(
        self,
        transfer: str,
        *,
        t_post_s: float,
        t_xfer_s: float,
        nbytes: int,
        descriptors: int,
        backend: str,
        ok: bool,
    ) -> None:
        """Record data-plane facts of a transfer (metrics, timelines). Changes no block state."""
        with self._lock:
            hlc, at = self._stamp()
            self._record(ev.TransferObserved(hlc, at, transfer, t_post_s, t_xfer_s, nbytes, descriptors, backend, ok))

    def counts(self) -> dict[str, int]:
        values = np.bincount(self.state, minlength=len(self._machine.spec.states))
        return {s.name: int(values[s.value]) for s in self._machine.spec.states}

    def commit(self) -> None:
        """Group-commit boundary: call once per scheduler step."""
        if self.log is not None:
            self.log.commit()

    def step(self) -> _Step:
        """One scheduler step: the commands inside change state, refuse and tell listeners at once, but their log
        records join the log's batch together when the block ends, and are encoded only when the batch is written
        (no I/O, no encoding at the step's end: :meth:`commit`, or the log's syncer, does both).

        Why: a command often gates work that should start right after it (``start_load`` → the copy's launch,
        ``part_done`` → attention reading the blocks); the record's encoding and the log append need not sit in
        that gap. The log's order is the commands' order, so replay is unchanged; events still in memory at a
        crash are lost exactly as an unwritten group-commit batch would be. Nested or concurrent steps share the
        outermost one's batch."""
        return _Step(self)

    def _end_step(self) -> None:
        with self._lock:
            events, self._deferred = self._deferred, None
            if self.log is not None and events:
                self.log.append_events(events)  # encoded when the batch is written, not here

    @classmethod
    def fold(cls, events: Iterable[ev.Event], num_blocks: int, **kwargs: Any) -> Any:
        """A ledger rebuilt from ``events`` (no log attached)."""
        ledger = cls(num_blocks, **kwargs)
        ledger.begin_replay()
        ledger.apply_all(events)
        ledger.end_replay()
        return ledger

    def begin_replay(self) -> None:
        self._replaying = True
        self._lazy = True

    def end_replay(self) -> None:
        if self._lazy:
            self._materialize()
        self._replaying = False

    def header(self) -> dict[str, Any]:
        """What a log needs in its header to replay on its own."""
        return {
            "side": self.side,
            "worker": self.worker,
            "num_blocks": self.num_blocks,
            "incarnation": self.incarnation,
        }


_S_ALLOCATED = int(SourceState.ALLOCATED)
_S_READY = int(SourceState.READY)


class SourceLedger(_Ledger):
    """Prefill-side ledger: ALLOCATED → READY → PINNED_FOR_TRANSFER → RELEASABLE → FREE | PREFIX_CACHED."""

    side = "source"
    _machine = SOURCE
    _first_trigger = "allocate"

    def __init__(self, num_blocks: int, *, default_ttl_s: float = DEFAULT_TTL_S, **kwargs: Any) -> None:
        self.requests: dict[str, _SourceRequest] = {}
        super().__init__(num_blocks, **kwargs)
        self.default_ttl_s = float(default_ttl_s)
        self._pins = np.zeros(self.num_blocks, dtype=np.uint16)  # pins of shared blocks (the rest: from leases)
        self.refs = np.zeros(self.num_blocks, dtype=np.uint16)  # requests referencing a shared block
        self.leases: dict[str, Lease] = {}
        self.generation = 0
        self.stats = {
            "granted": 0,
            "renewed": 0,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
            "expired": 0,
            "peer_restarted": 0,
        }
        self._released: list[Released] = []
        self._handlers = {
            ev.SrcAllocated: self._on_allocated,
            ev.SrcShared: self._on_shared,
            ev.SrcPrefillDone: self._on_prefill_done,
            ev.SrcGranted: self._on_granted,
            ev.SrcLeaseRenewed: self._on_renewed,
            ev.SrcCancelDeferred: self._on_cancel_deferred,
            ev.SrcConsumerDone: self._on_consumer_done,
            ev.SrcLeaseReleased: self._on_released,
            ev.SrcFreed: self._on_freed,
            ev.SrcAborted: self._on_aborted,
            ev.SrcEvicted: self._on_evicted,
            ev.PeerEpochChanged: self._on_peer_epoch,
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }
        self._evictions: list[tuple[np.ndarray, np.ndarray]] = []  # lazy replay only

    def _state_enum(self, value: int) -> Any:
        return SourceState(value)

    @property
    def pins(self) -> np.ndarray:
        """Live leases pinning each block, as a new array."""
        view = self._pins.copy()
        for req in self.requests.values():
            if req.leases and not req.shared:
                view[req.blocks] = len(req.leases)
        return view

    # -- commands -------------------------------------------------------------------------------------------------
    def allocate(self, request: str, block_ids: Iterable[int] | np.ndarray) -> int:
        """The engine's allocator gives ``block_ids`` to ``request``. Returns the blocks' new epoch (one number for the
        whole allocation: every block of it gets the same, larger than any it had).

        Raises :class:`BlockBusyError` (after recording the refusal) when a block is not free — in particular when
        it is still pinned for a transfer: the allocator must not reuse it.
        """
        with self._lock:
            ids = self._command_blocks("allocate", block_ids, request)
            self._check_allocatable("allocate", request, ids)
            hlc, at = self._stamp()
            self._record(ev.SrcAllocated(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epoch

    def share(self, request: str, block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """``request`` references blocks another request already holds (a prefix-cache hit): no new epoch."""
        with self._lock:
            ids = self._command_blocks("share", block_ids, request)
            self._check_name("share", request)
            if request in self.requests:
                self._refuse("share", "duplicate request id", request)
                raise BlockBusyError(f"request {request!r} already holds blocks")
            if (self._state[ids] == SourceState.FREE).any():
                self._refuse("share", "a shared block is FREE: allocate it instead", request)
                raise InvalidTransitionError("cannot share a FREE block")
            hlc, at = self._stamp()
            self._record(ev.SrcShared(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epochs

    def prefill_done(self, request: str) -> None:
        with self._lock:
            req = self._request("prefill_done", request)
            if not req.shared and self._next["prefill_done"][0][req.state] < 0:
                reason = f"request is {SourceState(req.state).name}, no 'prefill_done' edge from there"
                self._refuse("prefill_done", reason, request)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(ev.SrcPrefillDone(hlc, at, request))

    def grant(
        self,
        request: str,
        *,
        consumers: int = 1,
        ttl_s: float | None = None,
        transfer: str | None = None,
        peer: str = "",
    ) -> Grant:
        """Pin the request's blocks for ``consumers`` readers under a lease (the descriptor may be published)."""
        with self._lock:
            if consumers < 1:
                self._refuse("grant", f"consumers must be >= 1: got {consumers}", request)
                raise ValueError("consumers must be >= 1")
            req = self._request("grant", request)
            if req.shared:
                nxt = self._machine.triggers["grant"].when_true[self._state[req.blocks]]
                reason = self._first_invalid("grant", req.blocks, nxt) if nxt.size and nxt.min() < 0 else ""
            else:
                reason = (
                    ""
                    if self._next["grant"][0][req.state] >= 0
                    else (f"request is {SourceState(req.state).name}, no 'grant' edge from there")
                )
            if reason:
                self._refuse("grant", reason, request)
                raise InvalidTransitionError(reason)
            generation = self.generation + 1
            transfer = transfer or f"{self.worker}.{self.incarnation:08x}.{generation}"
            if transfer in self.leases:
                self._refuse("grant", "transfer id already has a lease", request, transfer)
                raise InvalidTransitionError(f"transfer {transfer!r} already has a lease")
            ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
            hlc, at = self._stamp()
            self._record(ev.SrcGranted(hlc, at, request, transfer, generation, consumers, at + ttl, peer))
            return Grant(request, transfer, generation, self.worker, req.blocks, req.epoch, consumers, ttl, at + ttl)

    def heartbeat(self, transfer: str, generation: int, peer: str = "") -> bool:
        """Renew (and claim) a lease. A consumer claims the lease with a heartbeat before it posts a read, so that a
        cancel racing the read defers the release. A lease already past its expiry is not renewed: it is released
        as expired, and the consumer must not read. ``peer`` names the consumer (its side-channel identity): the
        lease is bound to it, so that :meth:`peer_restarted` releases it when that consumer comes back new."""
        with self._lock:
            lease = self._live_lease("heartbeat", transfer, generation)
            if lease is None:
                return False
            hlc, at = self._stamp()
            if at >= lease.expires_at:
                self._refuse("heartbeat", "lease already expired", lease.request, transfer)
                self._release(lease, "expired", "heartbeat arrived after expiry")
                return False
            self._record(ev.SrcLeaseRenewed(hlc, at, transfer, at + lease.ttl_s, peer))
            return True

    def consumer_done(self, transfer: str, generation: int, consumer: int = 0) -> bool:
        """A consumer finished reading (pull) or P's write completed (push). The last one releases the lease."""
        with self._lock:
            lease = self._live_lease("consumer_done", transfer, generation)
            if lease is None:
                return False
            if not 0 <= consumer < lease.consumers:
                self._refuse(
                    "consumer_done", f"consumer {consumer} not in [0, {lease.consumers})", lease.request, transfer
                )
                return False
            if consumer in lease.done:
                self._refuse("consumer_done", f"duplicate completion from consumer {consumer}", lease.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.SrcConsumerDone(hlc, at, transfer, consumer))
            if len(lease.done) == lease.consumers:
                self._release(lease, "cancelled" if lease.cancel_deferred else "completed")
            return True

    def fail(self, transfer: str, generation: int, reason: str = "") -> bool:
        with self._lock:
            lease = self._live_lease("fail", transfer, generation)
            if lease is None:
                return False
            self._release(lease, "failed", reason)
            return True

    def cancel(self, request: str) -> bool:
        """Cancel a request wherever it is: before grant (abort), during a transfer (an unclaimed lease is released
        now; a claimed one when its consumer finishes or the lease ends), or after completion (nothing left to
        cancel: refused, recorded)."""
        with self._lock:
            req = self.requests.get(request)
            if req is None:
                self._refuse("cancel", "unknown request", request)
                return False
            if req.leases:
                for transfer in list(req.leases):
                    lease = self.leases[transfer]
                    if lease.cancel_deferred:
                        continue
                    if lease.claimed:
                        hlc, at = self._stamp()
                        self._record(ev.SrcCancelDeferred(hlc, at, transfer))
                    else:
                        self._release(lease, "cancelled")
                return True
            if req.shared:
                states = self._state[req.blocks]
                abortable = bool((self._machine.triggers["abort"].when_true[states] >= 0).all())
            else:
                abortable = self._next["abort"][0][req.state] >= 0
            if abortable:
                hlc, at = self._stamp()
                self._record(ev.SrcAborted(hlc, at, request))
                return True
            self._refuse("cancel", "nothing in flight to cancel (already released)", request)
            return False

    def sweep(self) -> list[str]:
        """Release every lease whose TTL ran out; returns their transfer ids."""
        with self._lock:
            now = self.clock.now()
            expired = [lease for lease in self.leases.values() if lease.expires_at <= now]
            for lease in expired:
                self._release(lease, "expired")
            return [lease.transfer for lease in expired]

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        """A peer came back with a new agent epoch: leases bound to it are released (its reads are gone)."""
        with self._lock:
            known = self.peer_epochs.get(peer)
            if known is not None and epoch <= known:
                if epoch < known:
                    self._refuse("peer_restarted", f"epoch {epoch} older than known {known} for {peer}")
                return []
            hlc, at = self._stamp()
            self._record(ev.PeerEpochChanged(hlc, at, peer, epoch))
            dropped = [lease for lease in self.leases.values() if peer in lease.peers] if known is not None else []
            for lease in dropped:
                self._release(lease, "peer_restarted", f"{peer} epoch {known} -> {epoch}")
            return [lease.transfer for lease in dropped]

    def take_released(self) -> list[Released]:
        """Leases that ended since the last call (vLLM: ``finished_sending``)."""
        with self._lock:
            out, self._released = self._released, []
            return out

    def free(self, request: str, *, cache: bool = False) -> None:
        """The engine frees (or caches) the request's blocks. Blocks another lease still pins stay pinned."""
        with self._lock:
            req = self._request("free", request)
            if req.leases:
                reason = f"request still holds lease(s) {req.leases}: cancel first"
                self._refuse("free", reason, request)
                raise InvalidTransitionError(reason)
            if req.state == _S_ALLOCATED or (req.shared and (self._state[req.blocks] == _S_ALLOCATED).any()):
                self._refuse("free", "blocks still ALLOCATED (prefill not done): use cancel", request)
                raise InvalidTransitionError("free before prefill_done: use cancel()")
            hlc, at = self._stamp()
            self._record(ev.SrcFreed(hlc, at, request, cache))

    def evict(self, block_ids: Iterable[int] | np.ndarray) -> None:
        with self._lock:
            ids = self._command_blocks("evict", block_ids)
            nxt = self._machine.triggers["evict"].when_true[self._state[ids]]
            busy = (nxt < 0) | (self.refs[ids] > 0)
            if busy.any():
                block = int(ids[int(np.argmax(busy))])
                refs = int(self.refs[block])
                held = f" (referenced by {refs} requests)" if refs else ""
                reason = f"block {block} is {SourceState(self._block_state(block)).name}{held}, not evictable"
                self._refuse("evict", reason)
                raise BlockBusyError(reason)
            hlc, at = self._stamp()
            self._record(ev.SrcEvicted(hlc, at, ev.pack_blocks(ids)))

    # -- tokens and the one release path --------------------------------------------------------------------------
    def _request(self, command: str, request: str) -> _SourceRequest:
        req = self.requests.get(request)
        if req is None:
            self._refuse(command, "unknown request", request)
            raise UnknownRequestError(request)
        return req

    def _live_lease(self, command: str, transfer: str, generation: int) -> Lease | None:
        """The token check: (transfer, generation) must name a live lease. Leases end on release and generations
        never repeat, so a late, duplicate or replayed token finds nothing and is refused."""
        lease = self.leases.get(transfer)
        if lease is None:
            self._refuse(
                command, "stale token: no live lease for this transfer (released or never granted)", transfer=transfer
            )
            return None
        if generation != lease.generation:
            self._refuse(
                command, f"stale token: generation {generation} != {lease.generation}", lease.request, transfer
            )
            return None
        return lease

    def _release(self, lease: Lease, reason: str, detail: str = "") -> None:
        hlc, at = self._stamp()
        self._record(ev.SrcLeaseReleased(hlc, at, lease.transfer, reason, detail))

    # -- fold -----------------------------------------------------------------------------------------------------
    def _on_allocated(self, e: ev.SrcAllocated) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._replaying and not self._lazy:
            self._step("allocate", ids)
        seq = self._new_allocation(ids, e.request)
        self.requests[e.request] = _SourceRequest(ids, seq, _S_ALLOCATED)

    def _on_shared(self, e: ev.SrcShared) -> None:
        if self._lazy:
            self._materialize()
        ids = self._logged_blocks(e.blocks)
        for other in self.requests.values():  # owners of these blocks switch to per-block handling
            if not other.shared and np.isin(other.blocks, ids).any():
                other.shared = True
                other.block_epochs = self.epoch[other.blocks]
                self.refs[other.blocks] += 1
                self._state[other.blocks] = other.state  # from now on kept exactly, block by block
                self._pins[other.blocks] = len(other.leases)
                self._owner.pop(other.epoch, None)
                other.state = MIXED
                for transfer in other.leases:
                    self.leases[transfer].block_epochs = other.block_epochs
        self.refs[ids] += 1
        self.requests[e.request] = _SourceRequest(
            ids, int(self.epoch[ids].max(initial=0)), MIXED, shared=True, block_epochs=self.epoch[ids]
        )

    def _on_prefill_done(self, e: ev.SrcPrefillDone) -> None:
        req = self.requests[e.request]
        if req.shared:  # shared blocks another request already made READY (or pinned) keep their state
            ids = req.blocks
            mask = self._state[ids] == _S_ALLOCATED
            self._state[ids[mask]] = _S_READY
            return
        req.state = self._scalar("prefill_done", req.state)

    def _on_granted(self, e: ev.SrcGranted) -> None:
        req = self.requests[e.request]
        ids = req.blocks
        if req.shared:
            self._state[ids] = self._step("grant", ids)
            self._pins[ids] += 1
        else:
            req.state = self._scalar("grant", req.state)
        self.generation = max(self.generation, e.generation)
        self.leases[e.transfer] = Lease(
            e.transfer,
            e.request,
            e.generation,
            ids,
            req.epoch,
            e.consumers,
            e.expires_at,
            e.expires_at - e.at,
            {e.peer} if e.peer else set(),
            e.at,
            block_epochs=req.block_epochs,
        )
        req.leases.append(e.transfer)
        self.stats["granted"] += 1

    def _on_renewed(self, e: ev.SrcLeaseRenewed) -> None:
        lease = self.leases[e.transfer]
        lease.expires_at = e.expires_at
        lease.claimed = True
        if e.peer:
            lease.peers.add(e.peer)
        self.stats["renewed"] += 1

    def _on_cancel_deferred(self, e: ev.SrcCancelDeferred) -> None:
        self.leases[e.transfer].cancel_deferred = True

    def _on_consumer_done(self, e: ev.SrcConsumerDone) -> None:
        self.leases[e.transfer].done.add(e.consumer)

    def _on_released(self, e: ev.SrcLeaseReleased) -> None:
        lease = self.leases.pop(e.transfer)
        req = self.requests[lease.request]
        req.leases.remove(e.transfer)
        ids = lease.blocks
        if req.shared:
            self._pins[ids] -= 1
            self._state[ids] = self._step("release", ids, self._pins[ids] == 0)
        else:
            req.state = self._scalar("release", req.state, not req.leases)
        self.stats[e.reason] = self.stats.get(e.reason, 0) + 1
        if not self._replaying:
            self._released.append(Released(lease.request, e.transfer, e.reason))

    def _on_freed(self, e: ev.SrcFreed) -> None:
        self._remove(e.request, "cache" if e.cached else "free")

    def _on_aborted(self, e: ev.SrcAborted) -> None:
        self._remove(e.request, "abort")

    def _remove(self, request: str, trigger: str) -> None:
        req = self.requests.pop(request)
        ids = req.blocks
        if not req.shared:
            final = self._scalar(trigger, req.state)
            if final < 0:  # e.g. free of a request still ALLOCATED: the command refuses this before recording
                raise ReplayError(f"{trigger} from {SourceState(req.state).name}")
            self._released_blocks(req, final)
            return
        self.refs[ids] -= 1
        # only blocks nobody else references and no lease pins leave; the rest stay as they are
        last = ids[(self.refs[ids] == 0) & (self._pins[ids] == 0)]
        if last.size:
            nxt = self._machine.step(trigger, self._state[last])
            movable = nxt != INVALID
            self._state[last[movable]] = nxt[movable]

    def _on_evicted(self, e: ev.SrcEvicted) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._lazy:
            self._evictions.append((ids, self.epoch[ids]))
            return
        self._state[ids] = self._step("evict", ids)

    def _after_materialize(self) -> None:
        for ids, epochs in self._evictions:
            unchanged = ids[self.epoch[ids] == epochs]  # not reallocated since the eviction
            self._state[unchanged] = SourceState.FREE
        self._evictions = []


_T_RESERVED = int(TargetState.RESERVED)


class TargetLedger(_Ledger):
    """Decode-side ledger: RESERVED → LOADING → READY_FOR_ATTENTION → FREE; a failed load never becomes READY."""

    side = "target"
    _machine = TARGET
    _first_trigger = "reserve"

    def __init__(
        self,
        num_blocks: int,
        *,
        failure_policy: LoadFailurePolicy | LoadFailurePolicyName = LoadFailurePolicy.FAIL,
        **kwargs: Any,
    ) -> None:
        policy = LoadFailurePolicy.parse(failure_policy, "failure_policy")
        self.requests: dict[str, _TargetRequest] = {}
        super().__init__(num_blocks, **kwargs)
        self.failure_policy = policy
        self.loads: dict[str, Load] = {}
        self.stats = {"loaded": 0, "failed": 0, "recompute": 0, "cancelled": 0, "discarded": 0}
        self._handlers = {
            ev.TgtReserved: self._on_reserved,
            ev.TgtLoadStarted: self._on_load_started,
            ev.TgtPartDone: self._on_part_done,
            ev.TgtLoadFailed: self._on_load_failed,
            ev.TgtCancelled: self._on_cancelled,
            ev.TgtLocalFilled: self._on_local_filled,
            ev.TgtFinished: self._on_finished,
            ev.PeerEpochChanged: self._on_peer_epoch,
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }

    def header(self) -> dict[str, Any]:
        return {**super().header(), "failure_policy": self.failure_policy.value}

    def _state_enum(self, value: int) -> Any:
        return TargetState(value)

    # -- commands -------------------------------------------------------------------------------------------------
    def reserve(self, request: str, block_ids: Iterable[int] | np.ndarray) -> int:
        """D's scheduler reserves ``block_ids`` for ``request``; returns their new epoch (as ``allocate`` does)."""
        with self._lock:
            ids = self._command_blocks("reserve", block_ids, request)
            self._check_allocatable("reserve", request, ids)
            hlc, at = self._stamp()
            self._record(ev.TgtReserved(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epoch

    def start_load(
        self,
        request: str,
        transfer: str,
        *,
        parts: int = 1,
        generation: int = 0,
        peer: str = "",
        peer_epoch: int = 0,
        mode: TransferMode | TransferModeName = TransferMode.PULL,
    ) -> None:
        """The request's blocks start receiving bytes; ``parts`` completions (layers, shards, P ranks) are expected.
        ``mode``: ``pull`` (D reads P's pinned blocks) or ``push`` (P writes into these)."""
        with self._lock:
            spelling = _MODE_SPELLINGS.get(mode)
            if spelling is None:
                try:
                    spelling = str(TransferMode.parse(mode, "mode"))  # names the field and the members
                except ValueError as exc:
                    self._refuse("start_load", f"mode: {exc}", request, transfer)
                    raise
            if parts < 1:
                self._refuse("start_load", f"parts must be >= 1: got {parts}", request, transfer)
                raise ValueError("parts must be >= 1")
            req = self._request("start_load", request, transfer)
            if transfer in self.loads:
                self._refuse("start_load", "transfer already loading", request, transfer)
                raise InvalidTransitionError(f"transfer {transfer!r} already loading")
            known = self.peer_epochs.get(peer)
            if peer and known is not None and peer_epoch < known:
                reason = f"stale token: peer {peer} epoch {peer_epoch} < {known}"
                self._refuse("start_load", reason, request, transfer)
                raise InvalidTransitionError(reason)
            if self._next["start_load"][0][req.state] < 0:
                reason = f"request is {TargetState(req.state).name}, no 'start_load' edge from there"
                self._refuse("start_load", reason, request, transfer)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(
                ev.TgtLoadStarted(hlc, at, request, transfer, parts, generation, peer, peer_epoch, spelling)
            )

    def part_done(self, transfer: str, part: int = 0) -> bool:
        """One expected part (layer, shard, P rank) landed. The last one makes the blocks READY_FOR_ATTENTION."""
        with self._lock:
            load = self._live_load("part_done", transfer)
            if load is None:
                return False
            if not 0 <= part < load.parts:
                self._refuse("part_done", f"part {part} not in [0, {load.parts})", load.request, transfer)
                return False
            if part in load.done:
                self._refuse("part_done", f"duplicate completion of part {part}", load.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtPartDone(hlc, at, transfer, part))
            return True

    def fail(self, transfer: str, reason: str = "") -> bool:
        """The load failed (any part). Policy ``recompute``: blocks go back to RESERVED; ``fail``: to FREE."""
        with self._lock:
            load = self._live_load("fail", transfer)
            if load is None:
                return False
            req = self.requests[load.request]
            recompute = self.failure_policy == "recompute" and not req.cancel_pending
            hlc, at = self._stamp()
            self._record(ev.TgtLoadFailed(hlc, at, transfer, reason, recompute))
            return True

    def cancel(self, request: str) -> bool:
        """Cancel or preempt a request. While its load is in flight the blocks stay LOADING and are freed when the
        transfer settles (completion or failure), so late bytes never land in a new owner's block."""
        with self._lock:
            req = self.requests.get(request)
            if req is None:
                self._refuse("cancel", "unknown request", request)
                return False
            if req.cancel_pending:
                self._refuse("cancel", "cancel already pending", request)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtCancelled(hlc, at, request))
            return True

    def local_fill(self, request: str) -> None:
        """The engine computed the request's KV itself (recompute after a failed load)."""
        self._simple("local_fill", request, ev.TgtLocalFilled)

    def finish(self, request: str) -> None:
        self._simple("finish", request, ev.TgtFinished)

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        """A source peer came back with a new epoch: loads from its old incarnation fail cleanly."""
        with self._lock:
            known = self.peer_epochs.get(peer)
            if known is not None and epoch <= known:
                if epoch < known:
                    self._refuse("peer_restarted", f"epoch {epoch} older than known {known} for {peer}")
                return []
            hlc, at = self._stamp()
            self._record(ev.PeerEpochChanged(hlc, at, peer, epoch))
            stale = [load for load in self.loads.values() if load.peer == peer and load.peer_epoch < epoch]
            for load in stale:
                self.fail(load.transfer, f"peer_restarted: {peer} epoch {load.peer_epoch} -> {epoch}")
            return [load.transfer for load in stale]

    def _request(self, command: str, request: str, transfer: str = "") -> _TargetRequest:
        req = self.requests.get(request)
        if req is None:
            self._refuse(command, "unknown request", request, transfer)
            raise UnknownRequestError(request)
        return req

    def _simple(self, trigger: str, request: str, event_type: type) -> None:
        with self._lock:
            req = self._request(trigger, request)
            if self._next[trigger][0][req.state] < 0:
                reason = f"request is {TargetState(req.state).name}, no {trigger!r} edge from there"
                self._refuse(trigger, reason, request)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(event_type(hlc, at, request))

    def _live_load(self, command: str, transfer: str) -> Load | None:
        load = self.loads.get(transfer)
        if load is None:
            self._refuse(
                command, "stale token: no live load for this transfer (settled or never started)", transfer=transfer
            )
            return None
        return load

    # -- fold -----------------------------------------------------------------------------------------------------
    def _set(self, req: _TargetRequest, state: int) -> None:
        req.state = state

    def _drop(self, request: str, final: int) -> None:
        self._released_blocks(self.requests.pop(request), final)

    def _on_reserved(self, e: ev.TgtReserved) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._replaying and not self._lazy:
            self._step("reserve", ids)
        seq = self._new_allocation(ids, e.request)
        self.requests[e.request] = _TargetRequest(ids, seq, _T_RESERVED)

    def _on_load_started(self, e: ev.TgtLoadStarted) -> None:
        req = self.requests[e.request]
        self._set(req, self._scalar("start_load", req.state))
        req.transfer = e.transfer
        self.loads[e.transfer] = Load(e.transfer, e.request, e.parts, e.generation, e.peer, e.peer_epoch, e.at)

    def _on_part_done(self, e: ev.TgtPartDone) -> None:
        load = self.loads[e.transfer]
        load.done.add(e.part)
        if len(load.done) < load.parts:
            return
        req = self.requests[load.request]
        del self.loads[e.transfer]
        req.transfer = None
        if req.cancel_pending:
            self._drop(load.request, self._scalar("discard", req.state))
            self.stats["discarded"] += 1
        else:
            self._set(req, self._scalar("part_done", req.state, True))
            self.stats["loaded"] += 1

    def _on_load_failed(self, e: ev.TgtLoadFailed) -> None:
        load = self.loads.pop(e.transfer)
        req = self.requests[load.request]
        req.transfer = None
        if req.cancel_pending:
            self._drop(load.request, self._scalar("discard", req.state))
            self.stats["discarded"] += 1
            return
        nxt = self._scalar("load_failed", req.state, e.recompute)
        self.stats["recompute" if e.recompute else "failed"] += 1
        if e.recompute:
            self._set(req, nxt)
        else:
            self._drop(load.request, nxt)

    def _on_cancelled(self, e: ev.TgtCancelled) -> None:
        req = self.requests[e.request]
        in_flight = req.transfer is not None
        nxt = self._scalar("cancel", req.state, in_flight)
        self.stats["cancelled"] += 1
        if in_flight:
            req.cancel_pending = True
        else:
            self._drop(e.request, nxt)

    def _on_local_filled(self, e: ev.TgtLocalFilled) -> None:
        req = self.requests[e.request]
        self._set(req, self._scalar("local_fill", req.state))

    def _on_finished(self, e: ev.TgtFinished) -> None:
        req = self.requests[e.request]
        self._drop(e.request, self._scalar("finish", req.state))


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


def ledger_from_header(header: dict[str, Any]) -> SourceLedger | TargetLedger:
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
