"""What the simulation found, one strict-xfail regression test each, named after the finding and pinned to the
seed that found it (docs/simulation.md describes each). A test that starts passing means the fix landed: remove
its xfail and the finding's entry in ``kvlifecycle.sim.checks.KNOWN_FINDINGS``."""

from __future__ import annotations

import numpy as np
import pytest

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.invariants import check_merged
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.world import SimConfig


def _clean(seed: int, config: SimConfig | None = None) -> None:
    result = run_seed(seed, config or SimConfig())
    assert result.ok and not result.known, (result.violations + result.leaks + result.known)[:1]


def test_duplicate_push_request_reads_freed_source_blocks() -> None:
    """Fixed finding duplicate-push-request (seed 889): a duplicated PushRequest posted a second WRITE that read
    the source blocks after the first completion freed them. P now accepts one WRITE per (transfer, generation,
    part)."""
    _clean(889)


def test_duplicate_push_request_writes_into_recomputed_blocks() -> None:
    """Fixed finding duplicate-push-request (seed 6542): the first WRITE's post failed, D recomputed the request
    locally, and the duplicate's WRITE landed in its READY blocks."""
    _clean(6542)


@pytest.mark.xfail(strict=True, reason="finding push-timeout-frees-target: a lost PushRequest reply fails D's load "
                                       "and frees its blocks while P's WRITE into them is in flight")
def test_push_timeout_frees_target_blocks_under_write() -> None:
    _clean(290)


@pytest.mark.xfail(strict=True, reason="finding transfer-outlives-lease: with no per-transfer deadline a READ "
                                       "outlives its lease (heartbeats lost); P expires it and frees the blocks")
def test_read_outliving_its_lease_reads_reused_blocks() -> None:
    _clean(73, SimConfig(transfer_deadline_s=None))


@pytest.mark.xfail(strict=True, reason="finding push-write-outlives-lease: a push job that runs after its lease "
                                       "expired posts the WRITE anyway; the same service step releases the lease")
def test_push_posted_after_its_lease_expired() -> None:
    _clean(36, SimConfig(prompt_jobs=False))


@pytest.mark.xfail(strict=True, reason="finding deferred-cancel-completed: the seed's logs fail check_pair")
def test_deferred_cancel_then_completion_seed() -> None:
    _clean(49)


@pytest.mark.xfail(strict=True, reason="finding deferred-cancel-completed: a cancel deferred under a claimed lease, "
                                       "then the completion: released as 'cancelled' and flagged released-under-reader")
def test_deferred_cancel_then_completion_is_not_released_under_reader() -> None:
    """The ledgers alone: P's completion notification is drained before D polls its DONE (the usual order)."""
    clock, hlc = ManualClock(), HybridLogicalClock(wall_ms=lambda: 0)
    p, d = SourceLedger(4, worker="p0", clock=clock, hlc=hlc), TargetLedger(4, worker="d0", clock=clock, hlc=hlc)
    p_events: list = []
    d_events: list = []
    p.listeners.append(p_events.append)
    d.listeners.append(d_events.append)
    p.allocate("r", np.array([0, 1]))
    p.prefill_done("r")
    g = p.grant("r")
    d.reserve("r", np.array([2, 3]))
    assert p.heartbeat(g.transfer, g.generation, peer="d0")  # the claim
    d.start_load("r", g.transfer, generation=g.generation, peer="p0")
    p.cancel("r")  # deferred: the lease is claimed
    assert p.consumer_done(g.transfer, g.generation)  # the read finished; its notification reached P
    assert d.part_done(g.transfer)  # D polls the DONE a moment later
    assert check_merged(p_events, d_events) == []
