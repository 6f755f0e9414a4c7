"""A batch of seeds over the real ledgers: no violation, no leak, and the checks actually ran (READY blocks were
tag-checked, faults were exercised, both logs replayed)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvlifecycle.sim import checks
from kvlifecycle.sim.runner import Simulation, run_seed, run_steps
from kvlifecycle.sim.world import SimConfig


def test_forty_seeds_are_clean_and_exercise_the_faults() -> None:
    coverage: Counter[str] = Counter()
    for seed in range(40):
        result = run_seed(seed)
        assert result.ok, (seed, result.violations, result.leaks)
        coverage.update(result.coverage)
    for fault in ("drop", "duplicate", "reorder", "partition", "p_restart", "torn_tail", "d_crash", "lease_expired",
                  "allocator_reuse", "push", "pull", "tp_handles", "cancel_p:before_grant", "cancel_d:reserved"):
        assert coverage[f"fault: {fault}"], fault
    assert coverage["target: LOADING -> READY_FOR_ATTENTION (part_done [all_parts_done])"] > 20


def _run_until_ready(tmp_path, seed: int) -> tuple[Simulation, list]:
    sim = Simulation(SimConfig(), seed, tmp_path / str(seed))
    seen: list = []
    check = sim.world.on_ready_hook
    sim.world.on_ready_hook = lambda d, request: (seen.append((d, request)), check(d, request))
    for _ in range(SimConfig().steps):
        sim.apply(sim.choose())
        if seen:
            break
    return sim, seen


def test_every_ready_request_is_tag_checked(tmp_path) -> None:
    checked = 0
    for seed in range(10):
        sim = Simulation(SimConfig(), seed, tmp_path / str(seed))
        for _ in range(SimConfig().steps):
            sim.apply(sim.choose())
        loaded = sum(w.ledger.stats["loaded"] for w in sim.world.d)  # of the live incarnations
        assert sim.world.ready_checked >= loaded and not sim.violations
        checked += sim.world.ready_checked
    assert checked > 0


def test_a_stale_byte_fails_the_tag_check(tmp_path) -> None:
    """The tag check sees one wrong byte: overwrite a READY block's bytes and check again."""
    seen: list = []
    for seed in range(20):
        sim, seen = _run_until_ready(tmp_path, seed)
        if seen:
            break
    d, request = seen[0]
    assert checks.tag_check(sim.world, d, request) == []
    block = int(d.ledger.requests[request].blocks[0])
    d.regions[0][block, 5] ^= 0xFF
    assert "READY but block" in checks.tag_check(sim.world, d, request)[0]


@pytest.mark.parametrize("faults", [frozenset({"drop"}), frozenset({"p_restart", "d_crash"})])
def test_fault_subsets_run_clean(faults: frozenset[str]) -> None:
    for seed in range(5):
        result = run_seed(seed, SimConfig(faults=faults))
        assert result.ok, (seed, result.violations, result.leaks)


def test_a_stream_asked_for_after_ps_lease_expired_and_freed_the_request_is_not_asked() -> None:
    """Seed 5028 of a CI run: P granted r0 into a partition, the lease expired and P's ledger freed it; at the drain D
    still wanted a stream of r0 and the world read P's freed record (KeyError). A request P freed is not streamed."""
    steps = [("arrive", 1, 2, 3, True, "stream"), ("partition", "P2", "D2"), ("prefill", 15187), ("grant", 716),
             ("advance", 0.1), ("advance", 0.8), ("advance", 0.1), ("advance", 0.4)]
    result = run_steps(steps, seed=5028)
    assert result.ok, (result.violations, result.leaks)
    assert run_seed(5028).ok
