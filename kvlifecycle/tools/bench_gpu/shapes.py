"""The requests ``bench gpu`` moves and the arithmetic every path's figures share: a shape, random id sets, medians
and rates, and the two ways a copy is waited for (CUDA events with the GPU kept busy, a bounded spin)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

POISON = 0xA5  # every destination is filled with this before a checked copy
GOALS = {"large": 0.9, "small": 0.6}  # one request end to end x the contiguous copy, 512 MiB / 16 blocks


@dataclass(frozen=True, slots=True)
class Shape:
    regions: int
    blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.regions * self.blocks * self.block_bytes


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds and seconds == seconds and seconds > 0 else float("nan")


def id_sets(rng: np.random.Generator, pool: int, n: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` pairs of (source ids, destination ids), ``n`` distinct blocks of ``pool`` each: a new pair every
    repetition, so neither the kernel nor the ceiling is served from L2."""
    return [(rng.choice(pool, n, replace=False).astype(np.int32), rng.choice(pool, n, replace=False).astype(np.int32))
            for _ in range(count)]


def pinned_id_sets(torch: Any, sets: list[Any]) -> list[tuple[Any, int]]:
    """Pinned host copies of the id sets, 16-byte aligned halves, as the transport stages them: (tensor, pad)."""
    out = []
    for s, d in sets:
        pad = -(-len(s) // 4) * 4
        h = torch.zeros(2 * pad, dtype=torch.int32, pin_memory=True)
        h[: len(s)], h[pad:pad + len(s)] = torch.from_numpy(s), torch.from_numpy(d)
        out.append((h, pad))
    return out


def busy(torch: Any, cycles: int = 200_000) -> None:
    """~0.1 ms of GPU spin ahead of a timed region (CUDA-event timing then excludes host launch overhead)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def spin(event: Any, timeout_s: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not event.query():
        if time.perf_counter() > deadline:
            raise TimeoutError("copy did not complete in time")
