"""One seed, one run: the same seed gives the same steps and the same events on every ledger, bit for bit; the
step list alone replays the run."""

from __future__ import annotations

from kvlifecycle.sim.runner import run_seed, run_steps


def test_same_seed_same_trace_bit_for_bit() -> None:
    first, second = run_seed(7, keep_trace=True), run_seed(7, keep_trace=True)
    assert first.trace == second.trace
    assert first.coverage == second.coverage
    assert sum(len(events) for _, _, events in first.trace) > 50  # a run that did something


def test_other_seed_other_trace() -> None:
    assert run_seed(7, keep_trace=True).trace != run_seed(8, keep_trace=True).trace


def test_the_step_list_replays_the_run() -> None:
    original = run_seed(11, keep_trace=True)
    replayed = run_steps(original.steps, 11, keep_trace=True)
    assert replayed.trace == original.trace
