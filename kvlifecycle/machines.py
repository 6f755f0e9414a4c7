"""The block state machines (P's KV blocks, D's KV blocks, P's host staging slots), declared once, and the
compiler that turns them into numpy tables.

The declarations below are the single source of truth. A :class:`MachineSpec` checks itself when it is made:
every state an edge names exists, every guard is declared (and used), no two edges leave one state under one
trigger and guard value, each trigger has at most one guard, and every event its ledger records is bound to the
triggers applying it may fire (every trigger bound by some event, an event that fires none says why). The docs
diagrams are generated from the declarations, and :func:`compile_machine` derives the table-driven hot path the
ledgers use.

What ``transitions`` contributes: it interprets the declaration. :func:`compile_machine` reads the transitions of
a real ``transitions.Machine`` built from it into the tables, and ``tests/test_machines.py`` runs that machine on
every (state, trigger, guard value) against the tables. It validates nothing about the declaration: it accepts an
edge to an unknown state, a guard no model defines and two edges for one (trigger, source) (checked on
``transitions`` 0.9.3), which is why :class:`MachineSpec` checks those itself. A ``transitions`` trigger costs
~20 µs; a table lookup over a request's block-id array costs a few ns per block, so per-block work never goes
through ``transitions`` itself.

A guard names a per-block boolean the ledger computes (e.g. "this was the last pin"). An edge with a guard exists in
two compiled tables: one used where the guard holds, one where it does not.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import attrs
import numpy as np

from kvlifecycle import events as ev

INVALID = -1  # table entry for "this trigger is not allowed from this state"


class SourceState(enum.IntEnum):
    """State of a KV block on the prefill (source) side."""

    FREE = 0
    ALLOCATED = 1
    READY = 2
    PINNED_FOR_TRANSFER = 3
    RELEASABLE = 4
    PREFIX_CACHED = 5


class TargetState(enum.IntEnum):
    """State of a KV block on the decode (target) side."""

    FREE = 0
    RESERVED = 1
    LOADING = 2
    READY_FOR_ATTENTION = 3


class HostSlotState(enum.IntEnum):
    """State of a slot of P's host staging pool (pinned host memory holding a copy of a granted request's KV)."""

    FREE = 0
    STAGING = 1  # a device -> host copy into the slot is in flight: its bytes are not whole yet
    STAGED = 2  # the copy completed; the copy's lease is live and no consumer is reading it
    SERVING = 3  # a consumer claimed the staged copy: its read may be in flight


@attrs.frozen
class Edge:
    trigger: str
    source: str
    dest: str
    guard: str | None = None  # name of a per-block boolean; None: unconditional
    negate: bool = False  # True: the edge is taken where the guard does NOT hold
    why: str = ""

    def as_transitions_dict(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"trigger": self.trigger, "source": self.source, "dest": self.dest}
        if self.guard is not None:
            spec["unless" if self.negate else "conditions"] = self.guard
        return spec

    def label(self) -> str:
        return self.trigger if self.guard is None else f"{self.trigger} [{'not ' if self.negate else ''}{self.guard}]"


@attrs.frozen
class Records:
    """An event type the machine's ledger records, bound to the triggers applying it may fire.

    ``triggers`` empty: the event changes no block state (a lease renewal, a refusal), and ``why`` says what it
    records instead. The ledger, the OpenTelemetry instrumentation and the timeline each handle every bound event
    (``tests/test_machines.py`` checks all three against this binding)."""

    event: type[ev.Event]
    triggers: tuple[str, ...] = ()
    why: str = ""


@attrs.frozen
class MachineSpec:
    """One machine: states, edges, guards, and the events its ledger records. Checked when made (``ValueError``)."""

    name: str
    states: type[enum.IntEnum]
    initial: str
    edges: tuple[Edge, ...]
    guards: tuple[str, ...] = ()
    records: tuple[Records, ...] = ()

    def __attrs_post_init__(self) -> None:
        problems = _problems(self)
        if problems:
            raise ValueError(f"machine {self.name!r}: " + "; ".join(problems))

    @property
    def triggers(self) -> tuple[str, ...]:
        """Trigger names in declaration order."""
        return tuple(dict.fromkeys(e.trigger for e in self.edges))

    def events_of(self, trigger: str) -> tuple[type[ev.Event], ...]:
        return tuple(r.event for r in self.records if trigger in r.triggers)

    @property
    def event_types(self) -> frozenset[type[ev.Event]]:
        return frozenset(r.event for r in self.records)


def _problems(spec: MachineSpec) -> list[str]:
    """Everything wrong with a declaration (``transitions`` would let each of these through)."""
    names = {s.name for s in spec.states}
    problems: list[str] = []
    if spec.initial not in names:
        problems.append(f"initial state {spec.initial!r} is not a state of {spec.states.__name__}")
    declared = set(spec.guards)
    for edge in spec.edges:
        for end in (edge.source, edge.dest):
            if end not in names:
                problems.append(f"edge {edge.trigger} {edge.source} -> {edge.dest} names unknown state {end!r}")
        if edge.guard is not None and edge.guard not in declared:
            problems.append(f"edge {edge.trigger} {edge.source} -> {edge.dest} uses undeclared guard {edge.guard!r}")
        if edge.guard is None and edge.negate:
            problems.append(f"edge {edge.trigger} {edge.source} -> {edge.dest} negates no guard")
    # one edge per (trigger, source, guard value): an unguarded edge holds for both values
    taken: Counter[tuple[str, str, bool]] = Counter()
    for edge in spec.edges:
        values = (True, False) if edge.guard is None else (not edge.negate,)
        for value in values:
            taken[(edge.trigger, edge.source, value)] += 1
    for (trigger, source, value), count in taken.items():
        if count > 1:
            where = "" if all(e.guard is None for e in spec.edges if e.trigger == trigger) else f" (guard {value})"
            problems.append(f"two edges from {source} under trigger {trigger!r}{where}")
    for trigger in spec.triggers:
        guards = {e.guard for e in spec.edges if e.trigger == trigger and e.guard is not None}
        if len(guards) > 1:
            problems.append(f"trigger {trigger!r} has more than one guard: {sorted(guards)}")
    used = {e.guard for e in spec.edges}
    problems += [f"guard {g!r} is declared but no edge uses it" for g in spec.guards if g not in used]
    # the events: each bound once, each trigger fired by some event, each bound trigger a real one
    counts = Counter(r.event for r in spec.records)
    problems += [f"event {t.__name__} is bound twice" for t, n in counts.items() if n > 1]
    triggers = set(spec.triggers)
    for record in spec.records:
        problems += [f"event {record.event.__name__} fires unknown trigger {t!r}" for t in record.triggers
                     if t not in triggers]
        if not record.triggers and not record.why:
            problems.append(f"event {record.event.__name__} fires no trigger and does not say why")
    bound = {t for r in spec.records for t in r.triggers}
    problems += [f"trigger {t!r} is fired by no event" for t in spec.triggers if t not in bound]
    return problems


# events both ledgers record that change no block state
_SHARED_RECORDS = (
    Records(ev.PeerEpochChanged, why="a peer restarted: the epoch it now runs under"),
    Records(ev.TransferObserved, why="data-plane facts about one transfer, for metrics and timelines"),
    Records(ev.Refused, why="a refused command: it changed nothing, and this says why"),
)

S = SourceState
T = TargetState

SOURCE_MACHINE = MachineSpec(
    name="source",
    states=SourceState,
    initial=S.FREE.name,
    guards=("last_pin",),
    records=(
        Records(ev.SrcAllocated, ("allocate",)),
        Records(ev.SrcShared, why="a prefix hit: the request references blocks another request holds, as they are"),
        Records(ev.SrcPrefillDone, ("prefill_done",)),
        Records(ev.SrcGranted, ("grant",)),
        Records(ev.SrcLeaseRenewed, why="a consumer renewed (claimed) a lease: its expiry moves, its pins stay"),
        Records(ev.SrcCancelDeferred, why="a cancel waits for the consumer that claimed the lease"),
        Records(ev.SrcConsumerDone, why="one consumer finished; the lease ends (release) with the last one"),
        Records(ev.SrcLeaseReleased, ("release",)),
        Records(ev.SrcFreed, ("free", "cache")),
        Records(ev.SrcAborted, ("abort",)),
        Records(ev.SrcEvicted, ("evict",)),
        *_SHARED_RECORDS,
    ),
    edges=(
        Edge("allocate", "FREE", "ALLOCATED", why="the engine's allocator hands the block to a request"),
        Edge("allocate", "PREFIX_CACHED", "ALLOCATED", why="a cached block is evicted and reused"),
        Edge("prefill_done", "ALLOCATED", "READY", why="prefill wrote every layer's K/V"),
        Edge("abort", "ALLOCATED", "FREE", why="request aborted before prefill finished"),
        Edge("abort", "READY", "FREE", why="request aborted before any consumer was granted"),
        Edge("grant", "READY", "PINNED_FOR_TRANSFER", why="descriptor published, lease granted"),
        Edge("grant", "PREFIX_CACHED", "PINNED_FOR_TRANSFER", why="a cached prefix pinned for a new consumer"),
        Edge("grant", "PINNED_FOR_TRANSFER", "PINNED_FOR_TRANSFER", why="another consumer of the same block"),
        Edge(
            "grant",
            "RELEASABLE",
            "PINNED_FOR_TRANSFER",
            why="released but not yet freed: pinned again for a new consumer",
        ),
        Edge(
            "release",
            "PINNED_FOR_TRANSFER",
            "RELEASABLE",
            guard="last_pin",
            why="the last lease on the block ended (completed, failed, cancelled or expired)",
        ),
        Edge(
            "release",
            "PINNED_FOR_TRANSFER",
            "PINNED_FOR_TRANSFER",
            guard="last_pin",
            negate=True,
            why="another lease still pins the block",
        ),
        Edge("free", "RELEASABLE", "FREE", why="the engine frees the block"),
        Edge("free", "READY", "FREE", why="request finished locally, no handoff"),
        Edge("cache", "RELEASABLE", "PREFIX_CACHED", why="kept for prefix reuse"),
        Edge("cache", "READY", "PREFIX_CACHED", why="kept for prefix reuse, no handoff"),
        Edge("evict", "PREFIX_CACHED", "FREE", why="the prefix cache evicts the block"),
    ),
)

TARGET_MACHINE = MachineSpec(
    name="target",
    states=TargetState,
    initial=T.FREE.name,
    guards=("all_parts_done", "recompute", "in_flight"),
    records=(
        Records(ev.TgtReserved, ("reserve",)),
        Records(ev.TgtLoadStarted, ("start_load",)),
        Records(ev.TgtLayersLanded, ("layer_landed",)),
        Records(ev.TgtLoadDeclined, ("decline", "discard")),  # discard: declined after a cancel
        Records(ev.TgtPartDone, ("part_done", "discard")),  # discard: the part settles a cancelled load
        Records(ev.TgtLoadFailed, ("load_failed", "discard")),
        Records(ev.TgtDigestMismatch, why="landed bytes failed their digest: the load's failure follows, the "
                "blocks are quarantined"),
        Records(ev.TgtCancelled, ("cancel",)),
        Records(ev.TgtLocalFilled, ("local_fill",)),
        Records(ev.TgtFinished, ("finish",)),
        *_SHARED_RECORDS,
    ),
    edges=(
        Edge("reserve", "FREE", "RESERVED", why="the decode scheduler allocates local blocks"),
        Edge("start_load", "RESERVED", "LOADING", why="transfer posted (pull) or target exposed (push)"),
        Edge(
            "layer_landed",
            "LOADING",
            "LOADING",
            why="a layer batch of a streaming load landed; the part completes when every layer of every block did",
        ),
        Edge(
            "part_done",
            "LOADING",
            "READY_FOR_ATTENTION",
            guard="all_parts_done",
            why="every expected layer/shard completed",
        ),
        Edge(
            "part_done", "LOADING", "LOADING", guard="all_parts_done", negate=True, why="other parts still outstanding"
        ),
        Edge(
            "load_failed",
            "LOADING",
            "RESERVED",
            guard="recompute",
            why="failure policy recompute: the engine recomputes the tokens locally",
        ),
        Edge(
            "load_failed",
            "LOADING",
            "FREE",
            guard="recompute",
            negate=True,
            why="failure policy fail: the request errors out",
        ),
        Edge(
            "decline",
            "LOADING",
            "RESERVED",
            why="the source declined a stream before writing a byte: the post-prefill path fills the reservation",
        ),
        Edge("cancel", "RESERVED", "FREE", why="request cancelled or preempted before loading"),
        Edge(
            "cancel",
            "LOADING",
            "LOADING",
            guard="in_flight",
            why="cancelled while bytes may still land: freed when the transfer settles",
        ),
        Edge("cancel", "LOADING", "FREE", guard="in_flight", negate=True, why="cancelled, nothing in flight"),
        Edge("cancel", "READY_FOR_ATTENTION", "FREE", why="preempted after loading"),
        Edge("discard", "LOADING", "FREE", why="a cancelled load settled"),
        Edge("local_fill", "RESERVED", "READY_FOR_ATTENTION", why="the engine computed the KV itself"),
        Edge("finish", "READY_FOR_ATTENTION", "FREE", why="request finished or evicted"),
    ),
)


H = HostSlotState

STAGING_MACHINE = MachineSpec(
    name="staging",
    states=HostSlotState,
    initial=H.FREE.name,
    guards=("last_reader", "reader_gone"),
    records=(
        Records(ev.StgStarted, ("stage",)),
        Records(ev.StgCompleted, ("staged",)),
        Records(ev.StgAborted, ("abort",)),
        Records(ev.StgServed, ("serve",)),
        Records(ev.StgRenewed, why="a consumer renewed the staged copy's lease: its expiry moves, its readers stay"),
        Records(ev.StgReadEnded, ("read_end",)),
        Records(ev.StgReleased, ("release",)),
        *_SHARED_RECORDS,
    ),
    edges=(
        Edge("stage", "FREE", "STAGING", why="a copy of an unclaimed lease's GPU blocks into the slot is posted"),
        Edge("staged", "STAGING", "STAGED", why="the copy completed: every byte of the slot is written"),
        Edge(
            "abort",
            "STAGING",
            "FREE",
            why="the copy failed, a consumer claimed the GPU copy first, or P restarted mid-copy: a half-written "
            "slot is dropped, never served",
        ),
        Edge("serve", "STAGED", "SERVING", why="a consumer claimed the staged copy under its live lease"),
        Edge("serve", "SERVING", "SERVING", why="another consumer of the same staged copy"),
        Edge("read_end", "SERVING", "STAGED", guard="last_reader", why="the last read in flight ended"),
        Edge(
            "read_end", "SERVING", "SERVING", guard="last_reader", negate=True, why="another consumer is still reading"
        ),
        Edge(
            "release",
            "STAGED",
            "FREE",
            why="the copy's lease ended (every consumer done, cancelled or expired) with no read in flight",
        ),
        Edge(
            "release",
            "SERVING",
            "FREE",
            guard="reader_gone",
            why="the lease expired or the reader's peer restarted: a read never outlives its lease, so it ended",
        ),
    ),
)


def build_transitions_machine(spec: MachineSpec) -> Any:
    """A real ``transitions`` machine interpreting ``spec``, on a model whose every guard holds (no checks: the
    spec checked itself when it was made)."""
    from transitions import Machine

    class _Guards:  # transitions resolves guard names on the model: give it one with every guard
        pass

    model = _Guards()
    for guard in spec.guards:
        setattr(model, guard, lambda: True)
    return Machine(
        model=model,
        states=[s.name for s in spec.states],
        transitions=[e.as_transitions_dict() for e in spec.edges],
        initial=spec.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )


@dataclass(frozen=True)
class CompiledTrigger:
    """One trigger as tables indexed by the current state: ``when_true[s]`` / ``when_false[s]`` is the next state."""

    name: str
    guard: str | None
    when_true: np.ndarray  # int8[num_states]
    when_false: np.ndarray  # int8[num_states]; equals when_true for unguarded triggers

    def sources(self) -> frozenset[int]:
        return frozenset(int(s) for s in np.flatnonzero((self.when_true >= 0) | (self.when_false >= 0)))


@dataclass(frozen=True)
class CompiledMachine:
    spec: MachineSpec
    triggers: Mapping[str, CompiledTrigger]

    def step(self, trigger: str, states: np.ndarray, guard: np.ndarray | bool | None = None) -> np.ndarray:
        """Next states for ``states`` under ``trigger``; entries are ``INVALID`` where the edge does not exist."""
        compiled = self.triggers[trigger]
        nxt: np.ndarray
        if compiled.guard is None or guard is None or guard is True:
            nxt = compiled.when_true[states]
        elif guard is False:
            nxt = compiled.when_false[states]
        else:
            nxt = np.where(guard, compiled.when_true[states], compiled.when_false[states])
        return nxt


def compile_machine(spec: MachineSpec) -> CompiledMachine:
    """One lookup table pair per trigger, read from the ``transitions`` machine interpreting ``spec``."""
    machine = build_transitions_machine(spec)
    num_states = len(spec.states)
    triggers: dict[str, CompiledTrigger] = {}
    for trigger_name, event in machine.events.items():
        when_true = np.full(num_states, INVALID, dtype=np.int8)
        when_false = np.full(num_states, INVALID, dtype=np.int8)
        guard_names: set[str] = set()
        for source_name, transitions_from_source in event.transitions.items():
            source = spec.states[source_name].value
            for transition in transitions_from_source:
                dest = spec.states[transition.dest].value
                conditions = list(transition.conditions)
                if len(conditions) > 1:
                    raise ValueError(f"{spec.name}.{trigger_name}: at most one guard per edge")
                if not conditions:
                    _set_once(when_true, source, dest, spec, trigger_name)
                    _set_once(when_false, source, dest, spec, trigger_name)
                    continue
                condition = conditions[0]
                guard_names.add(condition.func)
                table = when_true if condition.target else when_false
                _set_once(table, source, dest, spec, trigger_name)
        if len(guard_names) > 1:
            raise ValueError(f"{spec.name}.{trigger_name}: one guard per trigger, got {sorted(guard_names)}")
        guard = guard_names.pop() if guard_names else None
        triggers[trigger_name] = CompiledTrigger(trigger_name, guard, when_true, when_false)
    return CompiledMachine(spec, triggers)


def _set_once(table: np.ndarray, source: int, dest: int, spec: MachineSpec, trigger: str) -> None:
    if table[source] != INVALID:
        raise ValueError(f"{spec.name}.{trigger}: two edges from {spec.states(source).name} under the same guard")
    table[source] = dest


def to_mermaid(spec: MachineSpec) -> str:
    """A Mermaid ``stateDiagram-v2`` generated from the declaration (used by ``kvlifecycle diagram``)."""
    lines = ["stateDiagram-v2", f"    [*] --> {spec.initial}"]
    lines += [f"    {edge.source} --> {edge.dest}: {edge.label()}" for edge in spec.edges]
    return "\n".join(lines) + "\n"


def edges_table_markdown(spec: MachineSpec) -> str:
    """Every edge, with the event(s) that record its trigger."""
    rows = ["| trigger | recorded as | from | to | guard | why |", "| --- | --- | --- | --- | --- | --- |"]
    for e in spec.edges:
        guard = "" if e.guard is None else f"{'not ' if e.negate else ''}{e.guard}"
        recorded = ", ".join(f"`{t.__name__}`" for t in spec.events_of(e.trigger))
        rows.append(f"| `{e.trigger}` | {recorded} | {e.source} | {e.dest} | {guard} | {e.why} |")
    return "\n".join(rows) + "\n"


def events_table_markdown(spec: MachineSpec) -> str:
    """The events the ledger records that fire no trigger, and what each records instead."""
    rows = ["| event | changes no block state: it records |", "| --- | --- |"]
    rows += [f"| `{r.event.__name__}` | {r.why} |" for r in spec.records if not r.triggers]
    return "\n".join(rows) + "\n"


SOURCE: CompiledMachine = compile_machine(SOURCE_MACHINE)
TARGET: CompiledMachine = compile_machine(TARGET_MACHINE)
STAGING: CompiledMachine = compile_machine(STAGING_MACHINE)


def state_names(states: type[enum.IntEnum], values: Sequence[int]) -> list[str]:
    return [states(int(v)).name for v in values]
