"""What both ledgers share: the command/event discipline, the lock, the log hook, the errors and the values a
command returns. :mod:`kvlifecycle.ledger` is the public face (import from there); each side is its own module
(:mod:`kvlifecycle.source_ledger`, :mod:`kvlifecycle.target_ledger`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.blockids import MAX_BLOCKS, DuplicateScratch, parse_block_ids
from kvlifecycle.choices import TransferMode
from kvlifecycle.clock import Clock, HybridLogicalClock, MonotonicClock
from kvlifecycle.eventlog import EventLog, LogError
from kvlifecycle.machines import INVALID, SOURCE

if TYPE_CHECKING:
    import enum

    from typing_extensions import Self

    from kvlifecycle.transport import XferStats


BLOCK_DTYPE = ev.BLOCK_DTYPE
_MODE_SPELLINGS = TransferMode.spellings()  # start_load is on the launch path: a lookup, not an enum parse
_encode = ev.ENCODER.encode
DEFAULT_TTL_S = 30.0


class _Step:
    """``Ledger.step()``: a class, not a generator, because it sits on the launch path (enter/exit cost)."""

    __slots__ = ("ledger", "outer")

    def __init__(self, ledger: _Ledger[Any]) -> None:
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


class _HeldBlocks(Protocol):
    """What the shared base reads of a side's request record (:class:`_SourceRequest`, :class:`_TargetRequest`)."""

    blocks: np.ndarray
    epoch: int
    state: int


_RequestT = TypeVar("_RequestT", bound=_HeldBlocks)


class _Ledger(Generic[_RequestT]):
    """What both sides share: block arrays, epochs, the event plumbing, and the compiled machine.

    Hot path: a request's blocks move together, so while a request holds its blocks exclusively its state is one
    scalar, validated against the compiled table with a Python lookup, and the block array gets one vectorised
    write per transition. Replay is lazier still: it writes only epochs as it goes and derives every block's final
    state in one gather at the end (``_materialize``).
    """

    side = ""
    _machine = SOURCE
    _first_trigger: str  # the trigger that takes a FREE block into its first owned state
    requests: dict[str, _RequestT]  # each side's request records, made before this base's __init__ runs

    def __init__(
        self,
        num_blocks: int,
        *,
        log: EventLog | None = None,
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
        # each handler takes the one event class it is keyed by (a mapping the type system cannot state)
        self._handlers: dict[type[ev.Event], Callable[[Any], None]] = {}
        # scalar views of the compiled tables, for per-request transitions
        self._next = {
            name: (tuple(int(x) for x in t.when_true), tuple(int(x) for x in t.when_false))
            for name, t in self._machine.triggers.items()
        }
        if log is not None:  # a log opened as ``EventLog(dir)`` takes this ledger's header, or it could never replay
            log.adopt_header(self.header())

    @property
    def state(self) -> np.ndarray:
        """Every block's exact state, as a new array.

        Internally a block held by one request stores only an "owned" marker (the machine's first owned state): the
        request's scalar state is the truth, so a transition costs no per-block write. This view puts them together.
        """
        if self._lazy:
            self._materialize()
        view: np.ndarray = self._state.copy()  # numpy types copy() as Any
        for req in self.requests.values():
            if req.state >= 0 and req.state != self._owned:
                view[req.blocks] = req.state
        return view

    def block_states(self, block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """The exact states of just these blocks (cheaper than :attr:`state`, which builds the whole array)."""
        ids = self._as_blocks(block_ids)
        if self._lazy:
            self._materialize()
        out: np.ndarray = self._state.take(ids)
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
        if log is not None:
            log.admit()  # backpressure: a log that cannot take the record refuses before the state changes
        if log is not None and deferred is None:
            payload = _encode(event)  # first: an event that cannot be logged raises before the state changes
            self._handlers[type(event)](event)
            log.append_payload(payload)
        else:
            self._handlers[type(event)](event)
            if log is not None and deferred is not None:
                deferred.append(event)  # encoded when the log writes its batch
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
        event: ev.Event | None = None
        try:
            for event in events:
                handlers[type(event)](event)
                last = event.hlc
        except _FOLD_ERRORS as exc:
            if event is None or type(event) not in handlers:
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

    def _advance_peer_epoch(self, peer: str, epoch: int) -> tuple[bool, int | None]:
        """Record ``peer``'s agent epoch if it is newer (caller holds the lock): (advanced, the epoch known before).
        The same epoch again changes nothing; an older one is refused and recorded."""
        known = self.peer_epochs.get(peer)
        if known is not None and epoch <= known:
            if epoch < known:
                self._refuse("peer_restarted", f"epoch {epoch} older than known {known} for {peer}")
            return False, known
        hlc, at = self._stamp()
        self._record(ev.PeerEpochChanged(hlc, at, peer, epoch))
        return True, known

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

    def _state_enum(self, value: int) -> enum.IntEnum:
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

    def _released_blocks(self, req: _RequestT, final: int) -> None:
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

    def observe_transfer_stats(self, transfer: str, stats: XferStats, *, ok: bool = True) -> None:
        """:meth:`observe_transfer` of what a transport reports of a finished transfer (its ``stats(handle)``)."""
        self.observe_transfer(transfer, t_post_s=stats.t_post_s, t_xfer_s=stats.t_xfer_s, nbytes=stats.bytes,
                              descriptors=stats.desc_count, backend=stats.backend, ok=ok)

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
    def fold(cls, events: Iterable[ev.Event], num_blocks: int, **kwargs: Any) -> Self:
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

