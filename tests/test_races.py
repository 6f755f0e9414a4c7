"""One named test per race in the design brief. Each drives a P ledger and a D ledger through the race and ends
with every count back to zero: no pins, no leases, no loads, every block FREE, and both logs replaying clean."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.invariants import check_quiescent, check_source, check_target
from kvlifecycle.ledger import BlockBusyError, open_ledger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.replay import check, check_pair, replay


@pytest.fixture
def pair(tmp_path: Path):
    clock = ManualClock(100.0)
    hlc = HybridLogicalClock()  # one process: one causal clock, as if every message carried its stamp
    p = open_ledger("source", 32, str(tmp_path / "p"), clock=clock, hlc=hlc, worker="p0", default_ttl_s=10.0)
    d = open_ledger("target", 32, str(tmp_path / "d"), clock=clock, hlc=hlc, worker="d0")
    yield p, d, clock
    # every race ends with every count back to zero, live and replayed
    for ledger in (p, d):
        assert not check_quiescent(ledger)
        assert (ledger.state == 0).all(), ledger.counts()
        assert not ledger.requests
        ledger.log.close()
    results = [replay(tmp_path / "p"), replay(tmp_path / "d")]
    for r in results:
        assert not check(r, quiescent=True)
    assert not check_pair(results)


def handoff(p, d, name: str, src: list[int], dst: list[int], parts: int = 1):
    p.allocate(name, src)
    p.prefill_done(name)
    g = p.grant(name)
    d.reserve(name, dst)
    assert p.heartbeat(g.transfer, g.generation)  # D claims the lease before it reads
    d.start_load(name, g.transfer, parts=parts, generation=g.generation, peer="p0", peer_epoch=1)
    return g


def finish_ok(p, d, name: str, g, parts: int = 1) -> None:
    for part in range(parts):
        assert d.part_done(g.transfer, part)
    assert p.consumer_done(g.transfer, g.generation)
    p.free(name)
    d.finish(name)


def test_race_allocator_tries_to_reuse_a_pinned_block(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1, 2, 3], [4, 5, 6])
    with pytest.raises(BlockBusyError, match="PINNED_FOR_TRANSFER"):
        p.allocate("intruder", [2])
    assert [SourceState(int(s)).name for s in p.state[[1, 2, 3]]] == ["PINNED_FOR_TRANSFER"] * 3
    assert "intruder" not in p.requests
    finish_ok(p, d, "r", g)
    p.allocate("intruder", [2])  # after the release the allocator may have it
    p.cancel("intruder")


def test_race_decode_preempted_during_load(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1, 2], [3, 4])
    assert d.cancel("r")  # preempted while bytes may still land
    assert [TargetState(int(s)).name for s in d.state[[3, 4]]] == ["LOADING"] * 2
    with pytest.raises(BlockBusyError):
        d.reserve("next", [3])  # the preempted blocks are not reusable yet
    assert d.part_done(g.transfer, 0)  # the transfer settles ...
    assert [TargetState(int(s)).name for s in d.state[[3, 4]]] == ["FREE"] * 2  # ... and only then frees
    assert d.stats["discarded"] == 1
    assert p.consumer_done(g.transfer, g.generation)
    p.free("r")


def test_race_cancel_before_descriptor_published(pair) -> None:
    p, _, _ = pair
    p.allocate("r", [1, 2])
    assert p.cancel("r")  # still ALLOCATED: aborted
    p.allocate("s", [3])
    p.prefill_done("s")
    assert p.cancel("s")  # READY, never granted
    assert not p.cancel("s")  # nothing left: refused and recorded
    assert p.refusals


def test_race_cancel_during_transfer(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1, 2], [3, 4])
    assert p.cancel("r")  # D claimed the lease: the release waits for D
    assert g.transfer in p.leases and int(p.pins[1]) == 1
    assert not p.take_released()
    assert d.part_done(g.transfer, 0)
    assert p.consumer_done(g.transfer, g.generation)
    assert [r.reason for r in p.take_released()] == ["cancelled"]
    p.free("r")
    d.cancel("r")


def test_race_cancel_of_unclaimed_lease_releases_at_once_and_refuses_the_late_claim(pair) -> None:
    p, d, _ = pair
    p.allocate("r", [1])
    p.prefill_done("r")
    g = p.grant("r")
    assert p.cancel("r")
    assert [r.reason for r in p.take_released()] == ["cancelled"]
    assert not p.heartbeat(g.transfer, g.generation)  # D's claim arrives late: refused, D must not read
    p.free("r")
    d.reserve("r", [5])
    d.cancel("r")


def test_race_cancel_after_completion(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1], [2])
    assert d.part_done(g.transfer, 0)
    assert p.consumer_done(g.transfer, g.generation)
    assert not p.cancel("r")  # already released: nothing to cancel
    assert [SourceState(int(s)).name for s in p.state[[1]]] == ["RELEASABLE"]
    p.free("r")
    d.finish("r")


def test_race_duplicate_reordered_and_late_completions(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1, 2], [3, 4], parts=3)
    assert d.part_done(g.transfer, 2)  # reordered
    assert d.part_done(g.transfer, 0)
    assert not d.part_done(g.transfer, 0)  # duplicate
    assert [TargetState(int(s)).name for s in d.state[[3]]] == ["LOADING"]
    assert d.part_done(g.transfer, 1)
    assert not d.part_done(g.transfer, 1)  # late duplicate after READY
    assert p.consumer_done(g.transfer, g.generation)
    assert not p.consumer_done(g.transfer, g.generation)  # duplicate on P
    p.free("r")
    d.finish("r")
    # a completion that arrives after the blocks were reallocated to someone else
    g2 = handoff(p, d, "s", [1, 2], [3, 4])
    assert not p.consumer_done(g.transfer, g.generation)
    assert not d.part_done(g.transfer, 0)
    assert int(p.pins[1]) == 1 and g2.transfer in p.leases
    finish_ok(p, d, "s", g2)


def test_race_lease_expiry_racing_a_heartbeat(pair) -> None:
    p, d, clock = pair
    g = handoff(p, d, "r", [1], [2])
    clock.advance(9.0)  # D's read bound (0.9 TTL): D gives its read up before P may expire the lease
    assert d.fail(g.transfer, "read bound reached")
    assert [TargetState(int(s)).name for s in d.state[[2]]] == ["FREE"]  # never READY
    clock.advance(1.0)  # exactly at expiry: a renewal D sent earlier loses, deterministically
    assert not p.heartbeat(g.transfer, g.generation)
    assert [r.reason for r in p.take_released()] == ["expired"]
    assert p.sweep() == []  # the sweep agrees: nothing left to expire
    assert not p.consumer_done(g.transfer, g.generation)  # a completion after expiry is refused
    p.free("r")


def test_race_one_of_two_consumers_restarts_while_the_other_reads(pair) -> None:
    """D TP 2 over P TP 1: d0 and d1 each read their head slice of one lease. d1 comes back with a new epoch while
    d0 still reads: the lease stays (d0's read is not gone), and ends at its expiry once d0 completed."""
    p, _, clock = pair
    for peer in ("d0", "d1"):
        p.peer_restarted(peer, 1)
    p.allocate("r", [1, 2])
    p.prefill_done("r")
    g = p.grant("r", consumers=2, ttl_s=1.0)
    for peer in ("d0", "d1"):
        assert p.heartbeat(g.transfer, g.generation, peer=peer)
    assert p.peer_restarted("d1", 2) == []
    assert g.transfer in p.leases and p.take_released() == []
    assert p.consumer_done(g.transfer, g.generation, 0)  # d0's read landed; d1's share never will
    assert g.transfer in p.leases
    clock.advance(1.5)
    assert p.sweep() == [g.transfer]
    assert [r.reason for r in p.take_released()] == ["expired"]
    # a lease only the restarted consumer claimed is released at once, as a lease of one consumer
    p.free("r")
    p.allocate("s", [1, 2])
    p.prefill_done("s")
    g2 = p.grant("s", consumers=2)
    assert p.heartbeat(g2.transfer, g2.generation, peer="d1")
    assert p.peer_restarted("d1", 3) == [g2.transfer]
    assert [r.reason for r in p.take_released()] == ["peer_restarted"]
    p.free("s")


def test_race_peer_restarted_on_same_host_port_with_new_epoch(pair) -> None:
    p, d, _ = pair
    p.peer_restarted("d0@127.0.0.1:5600", 1)
    d.peer_restarted("p0", 1)
    p.allocate("r", [1])
    p.prefill_done("r")
    g = p.grant("r", peer="d0@127.0.0.1:5600")
    d.reserve("r", [2])
    d.start_load("r", g.transfer, generation=g.generation, peer="p0", peer_epoch=1)
    # P restarted: the load from the old incarnation is doomed; its blocks stay LOADING until its read settled
    # (tests/test_target_ledger_peer_restart.py), then it fails cleanly with the restart as its reason
    assert d.peer_restarted("p0", 2) == [g.transfer]
    assert [TargetState(int(s)).name for s in d.state[[2]]] == ["LOADING"]
    assert d.fail(g.transfer, "read settled")
    assert [TargetState(int(s)).name for s in d.state[[2]]] == ["FREE"]
    # D restarted: P releases the lease bound to it
    assert p.peer_restarted("d0@127.0.0.1:5600", 2) == [g.transfer]
    assert [r.reason for r in p.take_released()] == ["peer_restarted"]
    assert p.peer_restarted("d0@127.0.0.1:5600", 1) == []  # an old epoch is refused
    p.free("r")
    # a load naming the old epoch is refused before it can start
    p.allocate("s", [1])
    p.prefill_done("s")
    g2 = p.grant("s")
    d.reserve("s", [2])
    with pytest.raises(Exception, match="epoch"):
        d.start_load("s", g2.transfer, generation=g2.generation, peer="p0", peer_epoch=1)
    d.cancel("s")
    p.cancel("s")
    p.free("s")


def test_race_one_layer_fails_while_the_others_complete(pair) -> None:
    p, d, _ = pair
    g = handoff(p, d, "r", [1, 2], [3, 4], parts=4)
    for part in (0, 1, 3):
        assert d.part_done(g.transfer, part)
    assert d.fail(g.transfer, "layer 2 failed")
    assert [TargetState(int(s)).name for s in d.state[[3, 4]]] == ["FREE"] * 2  # policy fail: never READY
    assert not d.part_done(g.transfer, 2)  # the straggler after the failure is refused
    assert p.fail(g.transfer, g.generation, "consumer reported failure")
    assert [r.reason for r in p.take_released()] == ["failed"]
    p.free("r")
    assert not check_source(p) and not check_target(d)
    assert np.all(d.state == 0)


def test_race_restarted_consumer_releases_the_pull_lease_it_claimed(pair) -> None:
    """A pull lease does not know its reader at grant time; the reader's claim binds it, so a restart of that
    reader releases the lease at once instead of waiting for the TTL."""
    p, _d, _ = pair
    p.peer_restarted("d0@127.0.0.1:5601", 1)
    p.allocate("r", [1])
    p.prefill_done("r")
    g = p.grant("r")  # peer unknown yet
    assert p.heartbeat(g.transfer, g.generation, peer="d0@127.0.0.1:5601")
    assert p.peer_restarted("d0@127.0.0.1:5601", 2) == [g.transfer]
    assert [r.reason for r in p.take_released()] == ["peer_restarted"]
    p.free("r")
