"""The CI run: ten thousand seeds, zero violations, zero leaks, every machine edge and every fault exercised
(``kvlifecycle sim --seeds 10000 --require-coverage`` is the same run from the command line)."""

from __future__ import annotations

import pytest

from kvlifecycle.sim.report import run_many
from kvlifecycle.sim.world import SimConfig

CI_SEEDS = 10_000
JOBS = 2  # the CI machine's cores (tests/sim/test_sim_parallel.py: the same summary as one process)


@pytest.mark.slow
@pytest.mark.background  # scripts/test.sh: beside the rest, on idle cores
def test_ten_thousand_seeds_clean_with_full_coverage(tmp_path) -> None:
    summary = run_many(range(CI_SEEDS), SimConfig(), out=tmp_path, jobs=JOBS)
    assert summary.seeds == CI_SEEDS
    assert summary.violations == 0 and summary.leaks == 0, [f.__dict__ for f in summary.failures[:3]]
    assert summary.unexercised == []
    assert not summary.known, summary.known  # every finding so far is fixed: a new one fails the run
