"""Deterministic simulation of the P/D handoff: the real ledgers and their event logs, driven through the handoff
protocol by one seeded RNG over simulated time, network, transport memory and storage (see docs/simulation.md).

Core-side: numpy and the standard library only. Nothing here starts a thread or reads the wall clock; the same
seed gives the same run, event for event.
"""

from kvlifecycle.sim.runner import RunResult, run_seed, run_steps
from kvlifecycle.sim.world import SimConfig

__all__ = ["RunResult", "SimConfig", "run_seed", "run_steps"]
