"""Many seeds over several worker processes, their results in seed order (``run_many(..., jobs=N)``).

Each seed is a run of its own (a fresh world, its own RNG, nothing carried between seeds), so where it runs changes
nothing about it: a worker sums up a chunk of consecutive seeds (:class:`~kvlifecycle.sim.seed_batch.SeedBatch`: the
coverage and counts, the failing runs whole) and the caller merges the chunks in the order the seeds were given,
exactly as one process running them one after the other would; only a failure is shrunk and replayed, in the
caller. One record per chunk keeps the caller's share of the cores small (it competes with the workers). The
workers are spawned fresh interpreters (no fork of a caller that may hold threads and locks); ``worker_init`` runs
in each before its first seed (a test plants a bug there the same way it plants it in the caller).

Measured side by side in one run on a 2-core machine shared with other work (so the wall time follows the cores
left free): 3,000 seeds at load 2.5, one process 42.6 s, two workers 38.2 s (38.2 CPU s in all); 10,000 seeds at
load 10-13, 450 s and 226 s. The summaries were identical each time. On two free cores, two workers halve the wall.
"""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor

from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.seed_batch import SeedBatch
from kvlifecycle.sim.world import SimConfig

CHUNKS_PER_JOB = 8  # small enough chunks that the last one does not leave the other workers idle for long


def quiet_stream_log() -> None:
    """The real stream code logs each fault the simulation injects: thousands of warnings per run."""
    logging.getLogger("kvlifecycle.streaming").setLevel(logging.ERROR)


def _init_worker(worker_init: Callable[[], None] | None) -> None:
    quiet_stream_log()
    if worker_init is not None:
        worker_init()


def _run_chunk(seeds: Sequence[int], config: SimConfig) -> SeedBatch:
    batch = SeedBatch()
    for seed in seeds:
        batch.add(run_seed(seed, config))
    return batch


def chunked(seeds: Sequence[int], jobs: int) -> list[Sequence[int]]:
    size = max(1, -(-len(seeds) // (jobs * CHUNKS_PER_JOB)))
    return [seeds[i:i + size] for i in range(0, len(seeds), size)]


def run_seeds(seeds: Sequence[int], config: SimConfig, jobs: int,
              worker_init: Callable[[], None] | None = None) -> Iterator[SeedBatch]:
    """The seeds' results in chunks of consecutive seeds (in the order of ``seeds``), run over ``jobs`` worker
    processes."""
    chunks = chunked(seeds, jobs)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(jobs, len(chunks)) or 1, mp_context=context,
                             initializer=_init_worker, initargs=(worker_init,)) as pool:
        yield from pool.map(_run_chunk, chunks, [config] * len(chunks))
