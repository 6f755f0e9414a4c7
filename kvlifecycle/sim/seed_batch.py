"""Consecutive seeds' results summed up: the one record that crosses from wherever the seeds ran to the summary.

A worker process of ``run_many(..., jobs=N)`` (:mod:`kvlifecycle.sim.parallel`) sends one back per chunk of seeds;
one process running the seeds itself makes one per seed; :mod:`kvlifecycle.sim.report` merges them either way.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvlifecycle.sim.runner import RunResult


@dataclass
class SeedBatch:
    """Consecutive seeds' results summed up, the failing ones kept whole (in seed order)."""

    seeds: int = 0
    coverage: Counter[str] = field(default_factory=Counter)
    known: Counter[str] = field(default_factory=Counter)
    violations: int = 0
    leaks: int = 0
    corrupted_reads: int = 0
    failed: list[RunResult] = field(default_factory=list)

    def add(self, result: RunResult) -> SeedBatch:
        self.seeds += 1
        self.coverage.update(result.coverage)
        self.known.update(k.split(":")[0] for k in result.known)
        self.violations += len(result.violations)
        self.leaks += len(result.leaks)
        self.corrupted_reads += result.corrupted_reads
        if not result.ok:
            self.failed.append(result)
        return self
