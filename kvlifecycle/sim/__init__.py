"""Deterministic simulation of the P/D handoff: the real ledgers and their event logs, driven through the handoff
protocol by one seeded RNG over simulated time, network, transport memory and storage (see docs/simulation.md).

Core-side: numpy and the standard library only. A seed's run starts no thread and reads no wall clock; the same
seed gives the same run, event for event (``run_many(..., jobs=N)`` spreads seeds over worker processes, one seed
in one process each: :mod:`kvlifecycle.sim.parallel`).
"""

from kvlifecycle.sim.runner import RunResult, run_seed, run_steps
from kvlifecycle.sim.world import SimConfig

__all__ = ["RunResult", "SimConfig", "run_seed", "run_steps"]
