"""Wrong bytes landing (kvlifecycle/sim/corruption.py): with verification on, every corruption is refused by the
real digest path before attention may read it; with it off, the READY tag check sees it."""

from __future__ import annotations

from collections import Counter

from kvlifecycle.digest import VerifyMode
from kvlifecycle.sim.faults import CORRUPTION
from kvlifecycle.sim.runner import run_seed, run_steps
from kvlifecycle.sim.world import SimConfig


def test_every_corruption_is_refused_with_verification_on() -> None:
    coverage: Counter[str] = Counter()
    for seed in range(150):
        result = run_seed(seed)
        assert result.ok, (seed, (result.violations + result.leaks)[:1])
        assert result.corrupted_reads == 0
        coverage.update(result.coverage)
    for fault in CORRUPTION:  # a stream batch's refusal is rarer (about one in 125 seeds): the CI run's coverage
        assert coverage[f"fault: {fault}"] or fault == "corruption_refused_stream", fault


def test_a_corruption_with_verification_off_is_a_corrupted_read() -> None:
    """Seed 4 flips a byte of a read that becomes READY: unverified, the tags show it (the check is needed)."""
    result = run_seed(4, SimConfig(verify=VerifyMode.NONE))
    assert result.corrupted_reads >= 1
    assert any("READY but block" in v for v in result.violations), result.violations[:1]
    assert run_seed(4, SimConfig(verify=VerifyMode.ALL)).ok


def test_a_corrupting_step_replays() -> None:
    """A corruption is part of its ``complete`` step, so a recorded step list lands the same wrong bytes."""
    first = run_seed(4, SimConfig(verify=VerifyMode.NONE))
    again = run_steps(first.steps, 4, SimConfig(verify=VerifyMode.NONE))
    assert again.violations == first.violations and again.corrupted_reads == first.corrupted_reads
