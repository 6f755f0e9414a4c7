"""What the simulation found, one regression test each, named after the finding and pinned to the seed that found
it (docs/simulation.md, "Findings"). A finding not fixed yet is a strict-xfail test here and an entry in
``kvlifecycle.sim.checks.KNOWN_FINDINGS``; when its fix lands the test passes and both go. None is open."""

from __future__ import annotations

import numpy as np
import pytest

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.invariants import check_merged
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.world import SimConfig

# The decode shape every seed ran before each seed drew its own: the seeds below found their findings on it, and
# replay the same runs on it.
TWO_D = SimConfig(d_groups=(1, 1))


def _clean(seed: int, config: SimConfig = TWO_D) -> None:
    result = run_seed(seed, config)
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


def test_push_timeout_frees_target_blocks_under_write() -> None:
    """Fixed finding push-timeout-frees-target (seed 290): the PushRequest's reply was lost, D failed the load on
    the timeout and freed the blocks P's WRITE was landing in. D now hands the lease back and keeps the blocks
    LOADING until P answers; P cancels the write before it releases the lease."""
    _clean(290)


def test_read_outliving_its_lease_reads_reused_blocks() -> None:
    """Fixed finding transfer-outlives-lease (seed 73, with no data-plane timeout, now the default): D's READ
    outlived its lease (heartbeats lost), P expired it and reused the blocks. D now gives a read up at its lease's
    deadline (the last acknowledged renewal's send time + 0.9 TTL)."""
    _clean(73, SimConfig(d_groups=(1, 1), transfer_deadline_s=None))


def test_push_posted_after_its_lease_expired() -> None:
    """Fixed finding push-write-outlives-lease (seed 36): a push job that ran after its lease expired posted the
    WRITE anyway. P now posts no write of an ended or expired lease, and cancels one in flight at expiry."""
    _clean(36, SimConfig(d_groups=(1, 1), prompt_jobs=False))


@pytest.mark.parametrize("seed", [61, 1124, 1561])
def test_lease_bound_edge_seeds(seed: int) -> None:
    """Seeds that broke the first version of those fixes: a hand-back whose answer came after the caller's
    deadline (61), a renewal refused under a write that D took for a released lease (1124), a failure D sent P
    before its log held it, then a crash (1561)."""
    _clean(seed)


def test_deferred_cancel_then_completion_seed() -> None:
    """Fixed finding deferred-cancel-completed (seed 49): check_pair flagged released-under-reader on a lease whose
    every consumer had completed, because the deferred cancel recorded the release as ``cancelled``."""
    _clean(49)


def test_deferred_cancel_then_completion_is_not_released_under_reader() -> None:
    """The ledgers alone: P's completion notification is drained before D polls its DONE (the usual order); the
    lease ended by its completion, under no reader."""
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


def test_stream_timed_out_while_p_still_writes() -> None:
    """Fixed finding stream-outlives-d-timeout (seed 1, once the simulation timed out streams P still held): D's
    stream timeout freed the blocks a layer write of P was landing in; nothing bounded P's writes by D's wait. D's
    request now carries a write window that P's writes end within, and D's timeout outlasts it."""
    result = run_seed(1, TWO_D)
    assert result.ok and result.coverage["fault: stream_timeout_held"] >= 1, (result.violations + result.leaks)[:1]


def test_stream_write_cancelled_at_its_window_end() -> None:
    """P's write window ended with a layer write in flight; P cancelled it before D's timeout freed the blocks
    (seed 9 found it; seed 786 reaches it since the simulation runs the real Producer and Consumer, P's peer
    timeout included)."""
    result = run_seed(786, TWO_D)
    assert result.ok and result.coverage["fault: stream_window_closed"] >= 1, (result.violations + result.leaks)[:1]


@pytest.mark.parametrize("seed", [215, 378])
def test_one_of_two_consumers_restarting_keeps_the_lease_its_sibling_reads(seed: int) -> None:
    """Fixed finding two-consumer-peer-restart (seeds 215 and 378, a TP-2 decode instance): D1 came back with a new
    epoch, and P released the lease bound to it though D0, the lease's other consumer, was still reading its head
    slice; the blocks were freed under D0's read. ``SourceLedger.peer_restarted`` now releases a lease only when no
    other consumer is bound to it."""
    assert SimConfig().d_groups is None  # the seed draws its shape: these two draw a TP-2 D
    _clean(seed, SimConfig())



def test_digest_mismatch_with_a_sibling_read_in_flight() -> None:
    """Fixed finding digest-mismatch-sibling-poll (seed 277, once seeds verified and corruption landed in flight): a
    part of a two-handle load failed its digest, ``Consumer._fail`` released the sibling's handle, and the same
    service step went on to poll that released handle (``HandleReleasedError``). The step now stops polling a load
    it no longer holds."""
    _clean(277, SimConfig())


def test_digest_mismatch_whose_commit_fails_releases_the_handle() -> None:
    """Fixed finding digest-mismatch-handle-leak (seed 301): a part's digest mismatch fails the load and commits it
    at once; the disk refused the commit (ENOSPC), the service step raised between the part's check and its handle's
    release, and the handle stayed open for good. The release is now in a ``finally``."""
    _clean(301, SimConfig())
