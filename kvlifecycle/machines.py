"""The two block state machines, declared once, and the compiler that turns them into numpy tables.

The declarations below are the single source of truth: ``transitions`` validates them (unknown states, unknown
guards, duplicate edges), the docs diagrams are generated from them, and :func:`compile_machine` derives the
table-driven hot path the ledgers use. A ``transitions`` trigger costs ~20 µs; a table lookup over a request's
block-id array costs a few ns per block, so per-block work never goes through ``transitions`` itself.

A guard names a per-block boolean the ledger computes (e.g. "this was the last pin"). An edge with a guard exists in
two compiled tables: one used where the guard holds, one where it does not.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class MachineSpec:
    name: str
    states: type[enum.IntEnum]
    initial: str
    edges: tuple[Edge, ...]
    guards: tuple[str, ...] = field(default=())


S = SourceState
T = TargetState

SOURCE_MACHINE = MachineSpec(
    name="source",
    states=SourceState,
    initial=S.FREE.name,
    guards=("last_pin",),
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
    edges=(
        Edge("reserve", "FREE", "RESERVED", why="the decode scheduler allocates local blocks"),
        Edge("start_load", "RESERVED", "LOADING", why="transfer posted (pull) or target exposed (push)"),
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


def build_transitions_machine(spec: MachineSpec) -> Any:
    """Validate ``spec`` by building a real ``transitions`` machine from it (no model attached)."""
    from transitions import Machine

    class _Guards:  # transitions resolves guard names on the model: give it one with every guard
        pass

    model = _Guards()
    for guard in spec.guards:
        setattr(model, guard, lambda: True)
    names = [s.name for s in spec.states]
    machine = Machine(
        model=model,
        states=names,
        transitions=[e.as_transitions_dict() for e in spec.edges],
        initial=spec.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
    )
    declared_guards = set(spec.guards)
    for edge in spec.edges:
        if edge.source not in names or edge.dest not in names:
            raise ValueError(f"{spec.name}: edge {edge} names an unknown state")
        if edge.guard is not None and edge.guard not in declared_guards:
            raise ValueError(f"{spec.name}: edge {edge} uses undeclared guard {edge.guard!r}")
    return machine


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
        if compiled.guard is None or guard is None or guard is True:
            return compiled.when_true[states]
        if guard is False:
            return compiled.when_false[states]
        return np.where(guard, compiled.when_true[states], compiled.when_false[states])


def compile_machine(spec: MachineSpec) -> CompiledMachine:
    """Validate ``spec`` with ``transitions`` and derive one lookup table pair per trigger."""
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
    for edge in spec.edges:
        label = edge.trigger
        if edge.guard is not None:
            label += f" [{'not ' if edge.negate else ''}{edge.guard}]"
        lines.append(f"    {edge.source} --> {edge.dest}: {label}")
    return "\n".join(lines) + "\n"


def edges_table_markdown(spec: MachineSpec) -> str:
    rows = ["| trigger | from | to | guard | why |", "| --- | --- | --- | --- | --- |"]
    for e in spec.edges:
        guard = "" if e.guard is None else f"{'not ' if e.negate else ''}{e.guard}"
        rows.append(f"| `{e.trigger}` | {e.source} | {e.dest} | {guard} | {e.why} |")
    return "\n".join(rows) + "\n"


SOURCE: CompiledMachine = compile_machine(SOURCE_MACHINE)
TARGET: CompiledMachine = compile_machine(TARGET_MACHINE)


def state_names(states: type[enum.IntEnum], values: Sequence[int]) -> list[str]:
    return [states(int(v)).name for v in values]
