"""Shrinking a failing run: delta debugging (Zeller's ddmin) over its step list. A candidate list is replayed from
scratch (:func:`~kvlifecycle.sim.runner.run_steps`); it still fails when it reports a violation or leak of the same
rule as the original failure. The result is 1-minimal: removing any single step makes the failure go away.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from kvlifecycle.sim.runner import RunResult, Step, run_steps
from kvlifecycle.sim.world import SimConfig

_WORKER_AND_PATH = re.compile(r"^(/\S+/)?[PD]\d+: ")


def failure_key(result: RunResult) -> str:
    """What kind of failure a run showed: its first violation or leak with the worker and numbers left out."""
    first = (result.violations or result.leaks or [""])[0]
    text = _WORKER_AND_PATH.sub("", first)
    return re.sub(r"\d+", "#", text.split("(")[0]).strip()[:80]


def shrink(steps: list[Step], seed: int, config: SimConfig, *, max_runs: int = 2000) -> tuple[list[Step], int]:
    """The fewest steps (1-minimal) that still fail as ``steps`` did; returns them and the replays it took."""
    original = run_steps(steps, seed, config)
    if original.ok:
        return list(steps), 1
    key = failure_key(original)
    runs = 1

    def fails(candidate: list[Step]) -> bool:
        nonlocal runs
        runs += 1
        result = run_steps(candidate, seed, config)
        return not result.ok and failure_key(result) == key

    current = list(steps[: (original.failed_at + 1) if original.failed_at is not None else len(steps)])
    if current != steps and not fails(current):
        current = list(steps)
    current = _ddmin(current, fails, lambda: runs < max_runs)
    return current, runs


def _ddmin(steps: list[Step], fails: Callable[[list[Step]], bool], budget: Callable[[], bool]) -> list[Step]:
    n = 2
    while len(steps) >= 2 and budget():
        chunk = max(1, len(steps) // n)
        subsets = [steps[i : i + chunk] for i in range(0, len(steps), chunk)]
        reduced = False
        for i in range(len(subsets)):
            complement = [s for j, sub in enumerate(subsets) if j != i for s in sub]
            if complement and fails(complement):
                steps, n, reduced = complement, max(n - 1, 2), True
                break
            if not budget():
                return steps
        if not reduced:
            if n >= len(steps):
                break
            n = min(len(steps), n * 2)
    return steps
