"""``run_many(..., jobs=2)``: seeds spread over two worker processes give the summary one process gives, bit for
bit: the same coverage counts, findings, failing seeds in order, first violations and reproducers."""

from __future__ import annotations

from pathlib import Path

import pytest
from planted import _fail_without_releasing_handles, plant_handle_leak

from kvlifecycle.handoff import Consumer
from kvlifecycle.sim.parallel import chunked
from kvlifecycle.sim.report import Summary, run_many
from kvlifecycle.sim.world import SimConfig


def _comparable(summary: Summary) -> dict:
    return {**summary.to_json(), "seeds_per_s": None, "seeds_per_cpu_s": None}


def test_two_workers_give_the_summary_of_one_process() -> None:
    seeds = range(150)
    one = run_many(seeds, SimConfig(), out=None)
    two = run_many(seeds, SimConfig(), out=None, jobs=2)
    assert two.seeds == one.seeds == 150
    assert _comparable(two) == _comparable(one)
    assert sum(two.coverage.values()) > 1000  # the workers ran real seeds and their coverage came back
    assert two.cpu_s > 0


def test_failing_seeds_come_back_in_order_with_their_reproducer_and_shrunk_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Consumer, "_fail", _fail_without_releasing_handles)  # here, where failures are shrunk
    seeds = [10, 11, 12, 30, 31, 32]  # the planted bug fails 11 and 31
    one = run_many(seeds, SimConfig(), out=tmp_path / "one", cli_args="--faults x")
    said: list[int] = []
    two = run_many(seeds, SimConfig(), out=tmp_path / "two", cli_args="--faults x", jobs=2,
                   worker_init=plant_handle_leak, on_failure=lambda failure: said.append(failure.seed))
    assert [f.seed for f in one.failures] == [f.seed for f in two.failures] == said == [11, 31]
    assert [(f.first, f.reproduce, f.steps, f.shrunk_steps) for f in two.failures] == \
        [(f.first, f.reproduce, f.steps, f.shrunk_steps) for f in one.failures]
    assert two.failures[0].reproduce == "kvlifecycle sim --seed 11 --faults x"
    for mine, theirs in zip(two.failures, one.failures, strict=True):  # shrunk from the steps the worker sent back
        assert mine.shrunk_steps is not None and mine.shrunk_steps < mine.steps
        assert Path(str(mine.trace)).read_text() == Path(str(theirs.trace)).read_text()
    assert two.violations + two.leaks == one.violations + one.leaks > 0
    assert two.coverage == one.coverage


def test_chunks_cover_every_seed_once_in_order() -> None:
    seeds = list(range(7, 1010))
    for jobs in (1, 2, 3):
        chunks = chunked(seeds, jobs)
        assert [s for chunk in chunks for s in chunk] == seeds
        assert len(chunks) <= jobs * 8
