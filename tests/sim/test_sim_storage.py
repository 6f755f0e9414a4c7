"""Storage faults in the simulation: every worker's disk fails now and then (ENOSPC, EIO, short writes, failed
fsyncs) and comes back; after each seed the log on disk holds exactly what each live ledger recorded, and a mutant
that loses what a failed write held is caught."""

from __future__ import annotations

from collections import Counter

import pytest

from kvlifecycle.eventlog import EventLog, LogWriteError
from kvlifecycle.sim.faults import STORAGE, parse_faults
from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.world import SimConfig


def test_forty_seeds_exercise_every_storage_fault_and_every_log_holds_what_its_ledger_recorded() -> None:
    coverage: Counter[str] = Counter()
    for seed in range(40):
        result = run_seed(seed)
        assert result.ok, (seed, result.violations, result.leaks)
        coverage.update(result.coverage)
    for fault in STORAGE:
        assert coverage[f"fault: {fault}"] > 0, fault


def test_storage_faults_switched_off_are_not_injected() -> None:
    config = SimConfig(faults=parse_faults("drop,p_restart,d_crash"))
    for seed in range(5):
        result = run_seed(seed, config)
        assert result.ok, (seed, result.violations, result.leaks)
        assert not any(result.coverage[f"fault: {fault}"] for fault in STORAGE)


def test_mutant_a_failed_write_that_drops_its_records_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant gives up on records a write could not take (as if a full disk justified dropping them): the log
    then lacks events the ledger applied, which the end-of-seed comparison names."""
    original = EventLog._failed

    def failed_and_dropped(self: EventLog, what: str, exc: OSError) -> LogWriteError:
        self._pending.clear()
        self._pending_bytes = 0
        return original(self, what, exc)

    monkeypatch.setattr(EventLog, "_failed", failed_and_dropped)
    for seed in range(100):
        result = run_seed(seed)
        if not result.ok:
            assert any("the log holds" in v or "ReplayError" in v or "cannot be folded" in v
                       for v in result.violations), result.violations
            return
    pytest.fail("the mutant survived 100 seeds")
