"""Many seeds, one summary: aggregate coverage, the unexercised edges and faults, failing seeds with their
reproducer, shrunk trace and logs (what ``kvlifecycle sim`` prints and writes)."""

from __future__ import annotations

import logging
import resource
import shlex
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlifecycle.sim.coverage import ALL_EDGES, NOT_MODELED
from kvlifecycle.sim.faults import ALL as ALL_FAULTS
from kvlifecycle.sim.parallel import run_seeds
from kvlifecycle.sim.runner import RunResult, Step, run_seed, run_steps
from kvlifecycle.sim.seed_batch import SeedBatch
from kvlifecycle.sim.shrink import shrink
from kvlifecycle.sim.world import SimConfig


@dataclass
class Failure:
    seed: int
    first: str
    reproduce: str
    steps: int
    shrunk_steps: int | None = None
    trace: str | None = None
    logs: str | None = None


@dataclass
class Summary:
    seeds: int = 0
    violations: int = 0
    leaks: int = 0
    # blocks READY_FOR_ATTENTION whose bytes were not the granted ones (each is a violation too): with verification
    # on, a corruption in flight never gets there
    corrupted_reads: int = 0
    known: Counter[str] = field(default_factory=Counter)
    coverage: Counter[str] = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    wall_s: float = 0.0
    cpu_s: float = 0.0

    @property
    def unexercised(self) -> list[str]:
        edges = [e for e in ALL_EDGES if not self.coverage[e] and e not in NOT_MODELED]
        return edges + [f"fault: {f}" for f in ALL_FAULTS if not self.coverage[f"fault: {f}"]]

    def to_json(self) -> dict[str, Any]:
        return {
            "seeds": self.seeds,
            "violations": self.violations,
            "leaks": self.leaks,
            "corrupted_reads": self.corrupted_reads,
            "failing_seeds": [f.seed for f in self.failures],
            "failures": [f.__dict__ for f in self.failures],
            "known_findings": dict(self.known),
            "unexercised": self.unexercised,
            "not_modeled": NOT_MODELED,
            "coverage": dict(sorted(self.coverage.items())),
            "seeds_per_s": round(self.seeds / self.wall_s, 2) if self.wall_s else None,
            "seeds_per_cpu_s": round(self.seeds / self.cpu_s, 2) if self.cpu_s else None,
        }


def reproducer(seed: int, cli_args: str) -> str:
    return f"kvlifecycle sim --seed {seed}{(' ' + cli_args) if cli_args else ''}"


def write_failure(result: RunResult, config: SimConfig, out: Path, *, do_shrink: bool = True) -> tuple[Path, Path, int]:
    """Shrink ``result``'s steps, replay the shrunk list keeping its trace and logs under ``out``; returns the
    trace file, the logs directory and the number of shrunk steps."""
    steps = shrink(result.steps, result.seed, config)[0] if do_shrink else result.steps
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    final = run_steps(steps, result.seed, config, keep_trace=True, keep_logs=logs)
    trace = out / "trace.txt"
    trace.write_text(format_trace(final, steps, len(result.steps)))
    return trace, logs, len(steps)


def format_trace(result: RunResult, steps: list[Step], original: int) -> str:
    lines = [f"# seed {result.seed}: {len(steps)} step(s) (shrunk from {original}) that still fail", ""]
    lines += [f"# {v}" for v in (result.violations + result.leaks)[:10]]
    lines.append("")
    for index, step, events in result.trace:
        lines.append(f"{index:4d} {step!r}")
        lines += [f"       {worker}: {event!r}" for worker, event in events]
    return "\n".join(lines) + "\n"


def run_many(seeds: Iterable[int], config: SimConfig, *, out: Path | None, cli_args: str = "", do_shrink: bool = True,
             on_failure: Callable[[Failure], None] | None = None, jobs: int = 1,
             worker_init: Callable[[], None] | None = None) -> Summary:
    """Run every seed and sum them up. ``jobs`` > 1 spreads the seeds over that many worker processes
    (:mod:`kvlifecycle.sim.parallel`; ``worker_init`` runs in each first); the summary is the same as one process
    gives, failures in seed order, each shrunk here. ``cpu_s`` then counts the workers' CPU time too."""
    # The real stream code logs each fault the simulation injects (a lost stream request, a failed write): thousands
    # of warnings per run, noise that also costs time (a test's log capture formats every one of them).
    stream_log = logging.getLogger("kvlifecycle.streaming")
    level = stream_log.level
    stream_log.setLevel(logging.CRITICAL)  # a digest mismatch (a corruption injected and refused) logs an error
    try:
        if jobs > 1:
            batches: Iterable[SeedBatch] = run_seeds(list(seeds), config, jobs, worker_init)
        else:  # one batch per seed: a failure is reported as soon as it is found
            batches = (SeedBatch().add(run_seed(seed, config)) for seed in seeds)
        return _run_many(batches, config, out=out, cli_args=cli_args, do_shrink=do_shrink, on_failure=on_failure)
    finally:
        stream_log.setLevel(level)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_many(batches: Iterable[SeedBatch], config: SimConfig, *, out: Path | None, cli_args: str, do_shrink: bool,
              on_failure: Callable[[Failure], None] | None) -> Summary:
    summary = Summary()
    t0, c0, k0 = time.perf_counter(), time.process_time(), _children_cpu_s()
    for batch in batches:
        summary.seeds += batch.seeds
        summary.coverage.update(batch.coverage)
        summary.known.update(batch.known)
        summary.violations += batch.violations
        summary.leaks += batch.leaks
        summary.corrupted_reads += batch.corrupted_reads
        for result in batch.failed:
            seed = result.seed
            failure = Failure(seed, (result.violations + result.leaks)[0], reproducer(seed, cli_args),
                              len(result.steps))
            if out is not None:
                trace, logs, shrunk = write_failure(result, config, out / f"seed-{seed}", do_shrink=do_shrink)
                failure.trace, failure.logs, failure.shrunk_steps = str(trace), str(logs), shrunk
            summary.failures.append(failure)
            if on_failure is not None:
                on_failure(failure)
    summary.wall_s = time.perf_counter() - t0
    summary.cpu_s = time.process_time() - c0 + _children_cpu_s() - k0  # the workers', once they have exited
    return summary


def coverage_rows(summary: Summary) -> list[tuple[str, str]]:
    rows = [(str(summary.coverage[e]) if e not in NOT_MODELED else "n/m", e) for e in ALL_EDGES]
    return rows + [(str(summary.coverage[f"fault: {f}"]), f"fault: {f}") for f in ALL_FAULTS]


def quote_args(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)
