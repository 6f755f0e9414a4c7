"""The packaged transport conformance suite against the simulated transport (regions in simulated memory)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvlifecycle.sim.transport import SimFabric, SimTransport, sim_layout
from kvlifecycle.testing.transport_conformance import BLOCK_BYTES, BLOCKS, REGIONS, Fill, TransportConformance


class SimBuffers:
    """The suite's KV regions, in the fabric's simulated address space (the sim transport moves only those)."""

    def __init__(self, fabric: SimFabric, fill: Fill, seed: int) -> None:
        self.layout, self.arrays = sim_layout(fabric, regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
        if fill == "random":
            rng = np.random.default_rng(seed)
            for a in self.arrays:
                a[:] = rng.integers(0, 256, a.shape, dtype=np.uint8)

    def blocks(self, region: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        return self.arrays[region][np.asarray(ids, dtype=np.int64)].copy()


class TestSimTransportConformance(TransportConformance):
    """The suite polls in real time, so this fabric is ``autorun``: a transfer completes on its first poll (the
    simulation's own fabric leaves completion to the scheduler). Every case of the suite applies."""

    fabric: Any = None

    def _fabric(self) -> SimFabric:
        if self.fabric is None:
            self.fabric = SimFabric(autorun=True)
        return self.fabric

    def make_transport(self, name: str) -> SimTransport:
        return SimTransport(name, self._fabric())

    def make_buffers(self, fill: Fill, seed: int = 0, endpoint: int = 0) -> SimBuffers:
        return SimBuffers(self._fabric(), fill, seed)
