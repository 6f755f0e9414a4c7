"""The declarations check themselves, the compiled tables say what ``transitions`` does with them, and every
event is bound to its trigger and handled by the ledger, the telemetry and the timeline."""

from __future__ import annotations

import itertools
import typing

import msgspec
import numpy as np
import pytest
from transitions import MachineError

from kvlifecycle import events as ev
from kvlifecycle import machines as m
from kvlifecycle.ledger import SourceLedger, TargetLedger, open_ledger


@pytest.mark.parametrize("spec", [m.SOURCE_MACHINE, m.TARGET_MACHINE, m.STAGING_MACHINE], ids=lambda s: s.name)
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
    for spec, compiled in ((m.SOURCE_MACHINE, m.SOURCE), (m.TARGET_MACHINE, m.TARGET),
                           (m.STAGING_MACHINE, m.STAGING)):
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


def _spec(edges: tuple[m.Edge, ...], *, guards: tuple[str, ...] = (), initial: str = "FREE",
          records: tuple[m.Records, ...] | None = None) -> m.MachineSpec:
    """A small target-state machine whose every trigger is recorded by ``TgtReserved`` unless told otherwise."""
    if records is None:
        records = (m.Records(ev.TgtReserved, tuple(dict.fromkeys(e.trigger for e in edges))),)
    return m.MachineSpec("bad", m.TargetState, initial, edges, guards, records)


BAD_DECLARATIONS = {
    "unknown dest state": (lambda: _spec((m.Edge("x", "FREE", "RESERVD"),)), "unknown state 'RESERVD'"),
    "unknown source state": (lambda: _spec((m.Edge("x", "FRE", "RESERVED"),)), "unknown state 'FRE'"),
    "unknown initial state": (lambda: _spec((m.Edge("x", "FREE", "RESERVED"),), initial="NONE"), "initial state"),
    "undeclared guard": (lambda: _spec((m.Edge("x", "FREE", "RESERVED", guard="nope"),)), "undeclared guard 'nope'"),
    "declared guard no edge uses": (lambda: _spec((m.Edge("x", "FREE", "RESERVED"),), guards=("g",)), "no edge uses"),
    "negation without a guard": (lambda: _spec((m.Edge("x", "FREE", "RESERVED", negate=True),)), "negates no guard"),
    "duplicate edge": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED"), m.Edge("x", "FREE", "LOADING"))),
        "two edges from FREE under trigger 'x'",
    ),
    "the same edge twice": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED"), m.Edge("x", "FREE", "RESERVED"))),
        "two edges from FREE",
    ),
    "duplicate under one guard value": (
        lambda: _spec(
            (m.Edge("x", "FREE", "RESERVED", guard="g"), m.Edge("x", "FREE", "LOADING", guard="g")), guards=("g",)
        ),
        "two edges from FREE under trigger 'x' \\(guard True\\)",
    ),
    "unguarded beside guarded": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED", guard="g"), m.Edge("x", "FREE", "LOADING")), guards=("g",)),
        "two edges from FREE",
    ),
    "two guards on one trigger": (
        lambda: _spec(
            (m.Edge("x", "FREE", "RESERVED", guard="g"), m.Edge("x", "RESERVED", "LOADING", guard="h")),
            guards=("g", "h"),
        ),
        "more than one guard",
    ),
    "trigger no event records": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED"),), records=(m.Records(ev.Refused, why="refusals"),)),
        "trigger 'x' is fired by no event",
    ),
    "event fires an unknown trigger": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED"),), records=(m.Records(ev.TgtReserved, ("x", "y")),)),
        "fires unknown trigger 'y'",
    ),
    "event bound twice": (
        lambda: _spec(
            (m.Edge("x", "FREE", "RESERVED"),),
            records=(m.Records(ev.TgtReserved, ("x",)), m.Records(ev.TgtReserved, why="again")),
        ),
        "bound twice",
    ),
    "stateless event without a why": (
        lambda: _spec((m.Edge("x", "FREE", "RESERVED"),), records=(m.Records(ev.TgtReserved, ("x",)),
                                                                    m.Records(ev.Refused))),
        "does not say why",
    ),
}


@pytest.mark.parametrize("name", BAD_DECLARATIONS)
def test_each_bad_declaration_is_refused_when_made(name: str) -> None:
    make, message = BAD_DECLARATIONS[name]
    with pytest.raises(ValueError, match=message):
        make()


@pytest.mark.parametrize(
    "edges",
    [
        [{"trigger": "x", "source": "FREE", "dest": "NOWHERE"}],
        [{"trigger": "x", "source": "FREE", "dest": "RESERVED", "conditions": "undeclared"}],
        [{"trigger": "x", "source": "FREE", "dest": "RESERVED"}, {"trigger": "x", "source": "FREE", "dest": "LOADING"}],
    ],
    ids=["unknown state", "undeclared guard", "duplicate edge"],
)
def test_transitions_alone_accepts_what_the_declaration_refuses(edges: list[dict[str, str]]) -> None:
    """What machines.py says about ``transitions`` is true of the installed version: it checks none of these."""
    from transitions import Machine

    class Model:
        pass

    machine = Machine(model=Model(), states=[s.name for s in m.TargetState], transitions=edges, initial="FREE",
                      auto_transitions=False, ignore_invalid_triggers=False)
    assert "x" in machine.events


# --- events bound to triggers ---------------------------------------------------------------------------------

SPECS = {"source": m.SOURCE_MACHINE, "target": m.TARGET_MACHINE}


def test_every_event_type_is_recorded_by_some_machine() -> None:
    recorded = m.SOURCE_MACHINE.event_types | m.TARGET_MACHINE.event_types | m.STAGING_MACHINE.event_types
    assert recorded == set(typing.get_args(ev.AnyEvent))


@pytest.mark.parametrize("side", SPECS)
def test_the_ledger_handles_exactly_the_events_its_machine_records(side: str) -> None:
    ledger = open_ledger(side, 8)
    assert set(ledger._handlers) == SPECS[side].event_types


@pytest.mark.parametrize("side", SPECS)
def test_telemetry_handles_every_recorded_event_or_says_why_not(side: str) -> None:
    from kvlifecycle.telemetry import NOT_OBSERVED, Instrumentation

    handled = set(Instrumentation(open_ledger(side, 8))._handlers)
    assert all(NOT_OBSERVED.values())
    assert not handled & set(NOT_OBSERVED), "an event is both handled and declared not observed"
    assert SPECS[side].event_types - set(NOT_OBSERVED) == handled


def _sample(event_type: type[ev.Event]) -> ev.Event:
    """One instance of ``event_type`` with plausible field values."""
    values: dict[type, object] = {str: "r0", int: 1, float: 0.5, bool: False, bytes: ev.pack_blocks(np.arange(2))}
    fields = msgspec.structs.fields(event_type)
    return event_type(**{f.name: values[f.type] for f in fields})


@pytest.mark.parametrize("event_type", typing.get_args(ev.AnyEvent), ids=lambda t: t.__name__)
def test_the_timeline_renders_every_event(event_type: type[ev.Event]) -> None:
    from kvlifecycle.timeline.build import Builder

    builder = Builder()
    side = {"Src": "source", "Stg": "staging"}.get(event_type.__name__[:3], "target")
    builder.feed("w", side, _sample(event_type), 1.0)
    assert builder.unrendered == set()


def test_an_event_without_a_rendering_still_shows_and_is_counted() -> None:
    from kvlifecycle.timeline.build import Builder

    class Unknown(ev.Event, tag="zz-test"):
        pass

    builder = Builder()
    builder.feed("w", "target", Unknown(1, 1.0), 1.0)
    assert builder.unrendered == {Unknown}
    assert [i.name for i in builder.instants] == ["Unknown"]


class _TriggerSpy:
    """Wraps a ledger so that every trigger its event handlers fire is noted against the event being applied."""

    def __init__(self, ledger: SourceLedger | TargetLedger) -> None:
        self.fired: set[tuple[type, str]] = set()
        self.current: type | None = None
        scalar, step, machine = ledger._scalar, ledger._step, ledger._machine
        spy = self

        def noted(trigger: str) -> None:
            if spy.current is not None:
                spy.fired.add((spy.current, trigger))

        def spied_scalar(trigger: str, *args: object) -> int:
            noted(trigger)
            return scalar(trigger, *args)

        def spied_step(trigger: str, *args: object) -> np.ndarray:
            noted(trigger)
            return step(trigger, *args)

        class _Machine:
            triggers = machine.triggers

            @staticmethod
            def step(trigger: str, *args: object) -> np.ndarray:
                noted(trigger)
                return machine.step(trigger, *args)

        ledger._scalar, ledger._step, ledger._machine = spied_scalar, spied_step, _Machine()
        for event_type, handler in list(ledger._handlers.items()):
            ledger._handlers[event_type] = self._around(event_type, handler)

    def _around(self, event_type: type, handler: typing.Callable[[object], None]) -> typing.Callable[[object], None]:
        def handle(event: object) -> None:
            self.current = event_type
            try:
                handler(event)
            finally:
                self.current = None

        return handle


def _source_scenario(p: SourceLedger) -> None:
    p.allocate("done", [0, 1])
    p.prefill_done("done")
    g = p.grant("done", consumers=1)
    p.heartbeat(g.transfer, g.generation, peer="d0")
    p.consumer_done(g.transfer, g.generation)
    p.free("done")
    p.allocate("cached", [2])
    p.prefill_done("cached")
    p.free("cached", cache=True)
    p.evict([2])
    p.allocate("aborted", [3])
    p.cancel("aborted")
    p.allocate("owner", [4, 5])
    p.share("sharer", [4])
    p.prefill_done("owner")
    claimed = p.grant("owner")
    p.heartbeat(claimed.transfer, claimed.generation, peer="d0")
    p.cancel("owner")  # claimed: deferred until the consumer is done
    p.consumer_done(claimed.transfer, claimed.generation)
    p.peer_restarted("d0", 2)
    p.prefill_done("sharer")
    p.free("owner")
    p.free("sharer")


def _target_scenario(d: TargetLedger) -> None:
    d.reserve("ok", [0])
    d.start_load("ok", "t-ok")
    d.part_done("t-ok")
    d.finish("ok")
    d.reserve("failed", [1])
    d.start_load("failed", "t-failed")
    d.fail("t-failed", "broken")
    d.reserve("cancel-then-done", [2])
    d.start_load("cancel-then-done", "t-cd")
    d.cancel("cancel-then-done")
    d.part_done("t-cd")  # discard
    d.reserve("cancel-then-fail", [3])
    d.start_load("cancel-then-fail", "t-cf")
    d.cancel("cancel-then-fail")
    d.fail("t-cf", "late")  # discard
    d.reserve("local", [4])
    d.cancel("local")
    d.reserve("local", [4])
    d.local_fill("local")
    d.reserve("streamed", [5, 6])
    d.start_load("streamed", "t-s", layers=2, mode="push")
    d.layers_landed("t-s", 0, 0, 1, [5, 6])
    d.layers_landed("t-s", 0, 1, 1, [6, 5])  # the last layer: the part (and the load) completes
    d.finish("streamed")
    d.reserve("declined", [7])
    d.start_load("declined", "t-d", layers=1, mode="push")
    d.decline("t-d", "prefill began without the reservation")
    d.cancel("declined")
    d.reserve("declined-after-cancel", [0])
    d.start_load("declined-after-cancel", "t-dc", layers=1, mode="push")
    d.cancel("declined-after-cancel")
    d.decline("t-dc", "late")  # discard


def test_every_trigger_an_event_fires_is_the_one_it_is_bound_to() -> None:
    """Applying each event, live and in an exact (not lazy) replay, fires only the triggers the declaration binds
    to it, and the scenarios use every binding."""
    for spec, make, scenario, uses_every_binding in (
        (m.SOURCE_MACHINE, lambda: SourceLedger(8), _source_scenario, True),
        (m.TARGET_MACHINE, lambda: TargetLedger(8), _target_scenario, True),
        (m.TARGET_MACHINE, lambda: TargetLedger(8, failure_policy="recompute"), _target_scenario, False),
    ):
        live = make()
        recorded: list[ev.Event] = []
        live.listeners.append(recorded.append)
        spy = _TriggerSpy(live)
        scenario(live)
        replayed = make()
        replay_spy = _TriggerSpy(replayed)
        replayed.begin_replay()
        replayed._lazy = False  # the exact replay path: every handler steps the machine block by block
        replayed.apply_all(recorded)
        replayed.end_replay()
        fired = spy.fired | replay_spy.fired
        declared = {(r.event, t) for r in spec.records for t in r.triggers}
        assert fired <= declared, fired - declared
        if uses_every_binding:
            assert fired == declared, f"the scenario never fired {declared - fired}"
