"""``TargetLedger.peer_restarted`` while a sibling part still reads (the race named in the decode ledger's contract).

A load of several parts reads several P ranks (P TP > D TP: one part per P rank, or one per region group); the
ledger's load names the P rank of its first part. When that rank comes back under a new agent epoch, its part is
lost, but a sibling part's read from another, live P rank may still be landing in the same D blocks. The ledger
used to fail the load at once, so its blocks were FREE (policy ``fail``) or RESERVED again (policy ``recompute``)
and could be handed to another request while that read was still writing into them. Now a restart dooms the load,
as a cancel with a transfer in flight does (``LOADING -> LOADING``): no block of it leaves LOADING, and no part of
it completes, until the caller (the Consumer, once every read of the load settled) fails it.

Each step is checked against the log: the ledger folded from its events equals the live one (one event per
command, fold == live)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlifecycle import events as ev
from kvlifecycle.clock import ManualClock
from kvlifecycle.invariants import check_target, check_target_events
from kvlifecycle.ledger import BlockBusyError, TargetLedger, open_ledger
from kvlifecycle.machines import TargetState
from kvlifecycle.replay import replay

BLOCKS = [2, 3]


def names(d: TargetLedger, blocks: list[int]) -> list[str]:
    return [TargetState(int(s)).name for s in d.state[blocks]]


def assert_fold_equals_live(d: TargetLedger, log_dir: Path) -> None:
    d.log.commit()
    folded = replay(log_dir).ledger
    assert np.array_equal(folded.state, d.state)
    assert np.array_equal(folded.epoch, d.epoch)
    assert set(folded.loads) == set(d.loads)
    assert folded.doomed == d.doomed
    assert folded.peer_epochs == d.peer_epochs
    assert {n: (r.state, r.transfer, r.cancel_pending) for n, r in folded.requests.items()} == {
        n: (r.state, r.transfer, r.cancel_pending) for n, r in d.requests.items()}


def two_part_load(tmp_path: Path, policy: str) -> tuple[TargetLedger, list[ev.Event]]:
    """D reserved ``BLOCKS`` and started one load of two parts: part 0 read from p0 (the rank the load names),
    part 1 from p1."""
    d = open_ledger("target", 16, str(tmp_path / "d"), clock=ManualClock(100.0), worker="d0",
                    failure_policy=policy)
    seen: list[ev.Event] = []
    d.listeners.append(seen.append)
    d.peer_restarted("p0", 1)  # the first handshake records p0's epoch
    d.reserve("r", BLOCKS)
    d.start_load("r", "t1", parts=2, generation=1, peer="p0", peer_epoch=1)
    return d, seen


def p0_restarts_while_part_1_reads(d: TargetLedger) -> list[list[str]]:
    """The race: p0 restarts while part 1's read is in flight. Returns the blocks' states seen until that read
    settled (each ledger command the engine or a late part may make meanwhile)."""
    seen = []
    assert d.peer_restarted("p0", 2) == ["t1"]
    seen.append(names(d, BLOCKS))
    try:  # the allocator tries to hand a block to another request
        d.reserve("other", [BLOCKS[0]])
        d.cancel("other")
    except BlockBusyError:
        pass
    seen.append(names(d, BLOCKS))
    d.part_done("t1", 1) if "t1" in d.loads else None  # part 1's completion, if it arrives first
    seen.append(names(d, BLOCKS))
    return seen


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_race_p_rank_restarts_while_a_sibling_part_still_reads(tmp_path: Path, policy: str) -> None:
    """No block of the load leaves LOADING while part 1's read may still land; once it settled the caller fails
    the load, with the restart as its reason, and the blocks go where the policy says."""
    d, seen = two_part_load(tmp_path, policy)
    assert_fold_equals_live(d, tmp_path / "d")
    while_reading = p0_restarts_while_part_1_reads(d)
    assert while_reading == [["LOADING"] * 2] * 3
    assert d.doomed == {"t1": "peer_restarted: p0 epoch 1 -> 2"}
    refused = [e for e in seen if isinstance(e, ev.Refused)]
    assert [(e.command, e.reason) for e in refused][-2:] == [
        ("reserve", refused[-2].reason), ("part_done", "peer_restarted: p0 epoch 1 -> 2: only fail ends it")]
    assert "LOADING" in refused[-2].reason  # the block is busy: nobody reuses it under the read
    assert not [e for e in seen if isinstance(e, ev.TgtLoadFailed | ev.TgtPartDone)]
    assert_fold_equals_live(d, tmp_path / "d")
    # part 1's read settled (the Consumer saw it end, or cancelled it and saw it settle): the load fails now
    assert d.fail("t1", "peer restarted (new agent epoch)")
    failed = [e for e in seen if isinstance(e, ev.TgtLoadFailed)]
    assert [(e.reason, e.recompute) for e in failed] == [("peer_restarted: p0 epoch 1 -> 2", policy == "recompute")]
    assert names(d, BLOCKS) == (["RESERVED"] * 2 if policy == "recompute" else ["FREE"] * 2)
    assert d.doomed == {} and not d.fail("t1") and not check_target(d)
    assert not check_target_events(seen)
    assert_fold_equals_live(d, tmp_path / "d")
    if policy == "recompute":
        d.local_fill("r")
        d.finish("r")
    assert (d.state == 0).all()
    assert_fold_equals_live(d, tmp_path / "d")


def test_a_doomed_load_cancelled_meanwhile_is_discarded_once_it_fails(tmp_path: Path) -> None:
    """The engine aborts the request while the doomed load waits for its sibling read: the cancel is pending as
    for any load in flight, and the failure frees the blocks (discarded), never RESERVED under policy recompute."""
    d, _ = two_part_load(tmp_path, "recompute")
    d.peer_restarted("p0", 2)
    assert d.cancel("r")
    assert names(d, BLOCKS) == ["LOADING"] * 2
    assert_fold_equals_live(d, tmp_path / "d")
    assert d.fail("t1", "sibling settled")
    assert names(d, BLOCKS) == ["FREE"] * 2 and "r" not in d.requests and d.stats["discarded"] == 1
    assert_fold_equals_live(d, tmp_path / "d")


def test_a_restart_of_another_peer_or_an_old_epoch_dooms_nothing(tmp_path: Path) -> None:
    d, _ = two_part_load(tmp_path, "fail")
    assert d.peer_restarted("p1", 3) == []  # the load names p0 (the Consumer marks the load by any of its parts)
    assert d.peer_restarted("p0", 1) == []  # the same epoch again
    assert d.doomed == {} and d.part_done("t1", 0) and d.part_done("t1", 1)
    assert names(d, BLOCKS) == ["READY_FOR_ATTENTION"] * 2
    d.finish("r")
    assert_fold_equals_live(d, tmp_path / "d")


def test_replaying_a_log_that_failed_at_once_gives_the_same_ledger(tmp_path: Path) -> None:
    """Logs written before: the restart's ``PeerEpochChanged`` followed at once by the load's ``TgtLoadFailed``.
    Folded now, the restart dooms the load and the failure ends it: the same blocks, FREE."""
    d, _ = two_part_load(tmp_path, "fail")
    with d._lock:  # the earlier command's two records, as it wrote them
        d._advance_peer_epoch("p0", 2)
        hlc, at = d._stamp()
        d._record(ev.TgtLoadFailed(hlc, at, "t1", "peer_restarted: p0 epoch 1 -> 2", False))
    assert names(d, BLOCKS) == ["FREE"] * 2 and d.doomed == {}
    assert_fold_equals_live(d, tmp_path / "d")


@pytest.mark.mutants
def test_mutant_peer_restarted_failing_at_once_frees_blocks_under_the_sibling_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: ``peer_restarted`` fails the old incarnation's loads at once (as it did). The race above sees
    the blocks leave LOADING while part 1 still reads, and the allocator reuse one of them."""

    def fail_at_once(self: TargetLedger, peer: str, epoch: int) -> list[str]:
        with self._lock:
            advanced, _ = self._advance_peer_epoch(peer, epoch)
            stale = [t for t in self.doomed] if advanced else []
            for transfer in stale:
                self.fail(transfer, "peer_restarted")
            return stale

    monkeypatch.setattr(TargetLedger, "peer_restarted", fail_at_once)
    d, seen = two_part_load(tmp_path, "fail")
    while_reading = p0_restarts_while_part_1_reads(d)
    assert while_reading != [["LOADING"] * 2] * 3
    assert while_reading[0] == ["FREE"] * 2  # freed under the read in flight
    assert any(isinstance(e, ev.TgtReserved) and e.request == "other" for e in seen)  # and handed to another
