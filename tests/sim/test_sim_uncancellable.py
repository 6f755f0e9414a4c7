"""Transports that cannot cancel a running copy (CUDA IPC's rule, ``cancels_in_flight = False``): a released or
orphaned copy still lands, and the real Producer and Consumer keep its blocks LOADING or pinned until it ended."""

from __future__ import annotations

from collections import Counter

import numpy as np

from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.transport import SimFabric, SimTransport, sim_layout
from kvlifecycle.sim.world import SimConfig, transports_cancel
from kvlifecycle.transport import XferOp, XferStatus, cancels_in_flight


def _pair(cancels: bool) -> tuple[SimFabric, SimTransport, list[np.ndarray], list[np.ndarray]]:
    fabric = SimFabric(autorun=False)
    d, p = SimTransport("D", fabric, cancels_in_flight=cancels), SimTransport("P", fabric)
    d_layout, d_regions = sim_layout(fabric, regions=1, blocks=4, block_bytes=16)
    p_layout, p_regions = sim_layout(fabric, regions=1, blocks=4, block_bytes=16)
    d.register(d_layout)
    p.register(p_layout)
    d.add_peer(p.local_metadata())
    p_regions[0][:] = 7
    return fabric, d, d_regions, p_regions


def test_a_released_copy_of_a_transport_that_cannot_cancel_still_lands() -> None:
    fabric, d, d_regions, _ = _pair(cancels=False)
    assert not cancels_in_flight(d)
    handle = d.post(XferOp.READ, d.prepare("P"), [0], [1])
    d.release(handle)
    assert d.open_handles() == 0 and len(fabric.in_flight) == 1  # the handle is gone, the copy is not
    fabric.complete(0)
    assert (d_regions[0][0] == 7).all()


def test_a_released_copy_of_a_transport_that_cancels_never_lands() -> None:
    fabric, d, d_regions, _ = _pair(cancels=True)
    d.release(d.post(XferOp.READ, d.prepare("P"), [0], [1]))
    assert not fabric.in_flight and (d_regions[0][0] == 0).all()


def test_a_removed_peers_copy_runs_to_its_end_then_fails() -> None:
    fabric, d, d_regions, _ = _pair(cancels=False)
    handle = d.post(XferOp.READ, d.prepare("P"), [0], [1])
    d.remove_peer("P")
    assert d.poll(handle) is XferStatus.PENDING
    fabric.complete(0)
    assert d.poll(handle) is XferStatus.FAILED and (d_regions[0][0] == 7).all()


def test_seeds_whose_transports_cannot_cancel_run_clean() -> None:
    """Every seed on CUDA IPC's rule: the runtime waits for every copy it stopped wanting (a read at its bound, a
    P declared lost under a read, a push or stream write to stop) and no block is freed under one."""
    config = SimConfig(cancels_in_flight=False)
    coverage: Counter[str] = Counter()
    for seed in range(60):
        result = run_seed(seed, config)
        assert result.ok, (seed, (result.violations + result.leaks)[:1])
        coverage.update(result.coverage)
    assert coverage["fault: uncancellable_copy_waited"] and coverage["fault: peer_invalidated"]


def test_one_seed_in_eight_draws_transports_that_cannot_cancel() -> None:
    drawn = sum(not transports_cancel(SimConfig(), seed) for seed in range(800))
    assert 60 <= drawn <= 140
    assert transports_cancel(SimConfig(faults=frozenset({"drop"})), 0)
