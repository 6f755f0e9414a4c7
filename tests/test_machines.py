"""The compiled tables must say exactly what the ``transitions`` declaration says."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from transitions import MachineError

from kvlifecycle import machines as m


@pytest.mark.parametrize("spec", [m.SOURCE_MACHINE, m.TARGET_MACHINE], ids=lambda s: s.name)
def test_compiled_tables_agree_with_transitions_on_every_state_trigger_guard(spec: m.MachineSpec) -> None:
    compiled = m.compile_machine(spec)
    for state, trigger, guard_value in itertools.product(spec.states, compiled.triggers, (True, False)):
        machine = m.build_transitions_machine(spec)
        model = machine.models[0]
        for guard in spec.guards:
            setattr(model, guard, (lambda v: lambda: v)(guard_value))
        machine.set_state(state.name)
        try:
            moved = getattr(model, trigger)()
        except MachineError:
            expected = m.INVALID
        else:
            expected = spec.states[model.state].value if moved else m.INVALID
        got = int(compiled.step(trigger, np.array([state.value]), np.array([guard_value]))[0])
        assert got == expected, (spec.name, state.name, trigger, guard_value)


def test_every_declared_edge_is_in_the_table_and_nothing_else() -> None:
    for spec, compiled in ((m.SOURCE_MACHINE, m.SOURCE), (m.TARGET_MACHINE, m.TARGET)):
        guarded = {e.trigger for e in spec.edges if e.guard is not None}
        # an unguarded edge of a guarded trigger holds either way, so it sits in both tables
        declared = sum(2 if e.guard is None and e.trigger in guarded else 1 for e in spec.edges)
        entries = 0
        for trig in compiled.triggers.values():
            if trig.guard is None:
                entries += int((trig.when_true >= 0).sum())
            else:
                entries += int((trig.when_true >= 0).sum()) + int((trig.when_false >= 0).sum())
        assert entries == declared


def test_failed_load_never_reaches_ready() -> None:
    failed = m.TARGET.triggers["load_failed"]
    ready = m.TargetState.READY_FOR_ATTENTION
    assert ready not in (failed.when_true.tolist() + failed.when_false.tolist())


def test_bad_declarations_are_refused() -> None:
    dup = m.MachineSpec("bad", m.TargetState, "FREE", (m.Edge("x", "FREE", "RESERVED"), m.Edge("x", "FREE", "LOADING")))
    with pytest.raises(ValueError, match="two edges"):
        m.compile_machine(dup)
    undeclared = m.MachineSpec("bad", m.TargetState, "FREE", (m.Edge("x", "FREE", "RESERVED", guard="nope"),))
    with pytest.raises((ValueError, AttributeError)):
        m.compile_machine(undeclared)


def test_mermaid_lists_every_edge() -> None:
    text = m.to_mermaid(m.SOURCE_MACHINE)
    for edge in m.SOURCE_MACHINE.edges:
        assert f"{edge.source} --> {edge.dest}: {edge.trigger}" in text


def test_docs_diagram_is_generated_from_the_declaration() -> None:
    from pathlib import Path

    from kvlifecycle.cli.diagram import render

    doc = Path(__file__).resolve().parents[1] / "docs" / "state-machines.md"
    assert doc.read_text() == render(), (
        "docs/state-machines.md is stale: run `kvlifecycle diagram -o docs/state-machines.md`"
    )
