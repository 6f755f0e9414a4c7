"""Ledger commands, tokens and leases, and replay equality."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvlifecycle import events as ev
from kvlifecycle.clock import ManualClock
from kvlifecycle.eventlog import LogError, read_events
from kvlifecycle.invariants import check_quiescent, check_source, check_target
from kvlifecycle.ledger import (
    BlockBusyError,
    InvalidTransitionError,
    SourceLedger,
    TargetLedger,
    UnknownRequestError,
    open_ledger,
)
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.replay import replay


def states(ledger, blocks) -> list[str]:
    enum = SourceState if ledger.side == "source" else TargetState
    return [enum(int(s)).name for s in ledger.state[np.asarray(blocks)]]


def test_source_happy_path_and_epochs(source: SourceLedger) -> None:
    assert source.allocate("r1", [3, 4, 5]) == 1
    assert source.epoch[[3, 4, 5]].tolist() == [1, 1, 1]
    source.prefill_done("r1")
    grant = source.grant("r1")
    assert states(source, [3, 4, 5]) == ["PINNED_FOR_TRANSFER"] * 3
    assert grant.block_ids.tolist() == [3, 4, 5] and grant.generation == 1
    assert source.consumer_done(grant.transfer, grant.generation)
    assert [r.reason for r in source.take_released()] == ["completed"]
    assert states(source, [3]) == ["RELEASABLE"]
    source.free("r1")
    assert states(source, [3, 4, 5]) == ["FREE"] * 3
    assert source.allocate("r2", [3]) == 2  # reallocation bumps the epoch
    assert source.epoch[[3, 4]].tolist() == [2, 1]
    assert not check_source(source)


def test_stale_completion_after_free_and_reallocation_leaves_new_owner_untouched(source: SourceLedger) -> None:
    source.allocate("old", [7, 8])
    source.prefill_done("old")
    old = source.grant("old")
    source.cancel("old")  # unclaimed lease: released at once
    source.free("old")
    source.allocate("new", [7, 8])
    source.prefill_done("new")
    new = source.grant("new")
    before = (source.state.copy(), source.epoch.copy(), source.pins.copy())
    assert not source.consumer_done(old.transfer, old.generation)  # the late completion
    assert not source.heartbeat(old.transfer, old.generation)
    assert not source.fail(old.transfer, old.generation, "late failure")
    assert not source.consumer_done(new.transfer, old.generation)  # right transfer, stale generation
    after = (source.state, source.epoch, source.pins)
    for b, a in zip(before, after, strict=False):
        assert np.array_equal(b, a)
    assert states(source, [7, 8]) == ["PINNED_FOR_TRANSFER"] * 2
    assert new.transfer in source.leases
    assert sum(v for k, v in source.refusals.items() if "stale token" in k) == 4


def test_refusals_are_events_with_reasons(tmp_path: Path) -> None:
    ledger = open_ledger("source", 8, str(tmp_path / "p"), worker="p0")
    ledger.allocate("r", [1])
    with pytest.raises(BlockBusyError, match="block 1 is ALLOCATED"):
        ledger.allocate("other", [1])
    assert not ledger.consumer_done("nope", 1)
    ledger.log.close()
    refused = [e for e in replay(tmp_path / "p").events if isinstance(e, ev.Refused)]
    assert [(e.command, e.reason.split(":")[0]) for e in refused] == [
        ("allocate", "block 1 is ALLOCATED, no 'allocate' edge from there"),
        ("consumer_done", "stale token"),
    ]


def test_multi_consumer_block_releases_only_after_every_consumer(source: SourceLedger) -> None:
    source.allocate("r", [1, 2])
    source.prefill_done("r")
    g = source.grant("r", consumers=2)
    assert source.consumer_done(g.transfer, g.generation, consumer=1)
    assert states(source, [1, 2]) == ["PINNED_FOR_TRANSFER"] * 2
    assert not source.consumer_done(g.transfer, g.generation, consumer=1)  # duplicate
    assert not source.consumer_done(g.transfer, g.generation, consumer=2)  # no such rank
    assert source.consumer_done(g.transfer, g.generation, consumer=0)
    assert states(source, [1, 2]) == ["RELEASABLE"] * 2


def test_shared_prefix_block_stays_pinned_until_every_lease_ends(source: SourceLedger) -> None:
    source.allocate("a", [1, 2])
    source.prefill_done("a")
    source.share("b", [1])  # b hits a's prefix
    source.prefill_done("b")
    ga, gb = source.grant("a"), source.grant("b")
    assert int(source.pins[1]) == 2
    source.consumer_done(ga.transfer, ga.generation)
    source.free("a")
    assert states(source, [1, 2]) == ["PINNED_FOR_TRANSFER", "FREE"]
    source.consumer_done(gb.transfer, gb.generation)
    source.free("b", cache=True)
    assert states(source, [1]) == ["PREFIX_CACHED"]
    # a cached prefix is pinned again for a new consumer without a new epoch
    epoch = int(source.epoch[1])
    source.share("c", [1])
    g = source.grant("c")
    assert states(source, [1]) == ["PINNED_FOR_TRANSFER"] and int(source.epoch[1]) == epoch
    source.consumer_done(g.transfer, g.generation)
    source.free("c", cache=True)
    with pytest.raises(BlockBusyError):
        source.evict([2])  # FREE: nothing to evict
    source.evict([1])
    assert states(source, [1]) == ["FREE"]
    assert not check_source(source) and not check_quiescent(source)


def test_lease_expiry_and_heartbeat(source: SourceLedger, clock: ManualClock) -> None:
    source.allocate("r", [1])
    source.prefill_done("r")
    g = source.grant("r", ttl_s=10)
    clock.advance(9)
    assert source.heartbeat(g.transfer, g.generation)  # renewed to t+19
    clock.advance(9)
    assert source.sweep() == []
    clock.advance(2)
    assert source.sweep() == [g.transfer]
    assert [r.reason for r in source.take_released()] == ["expired"]
    assert source.stats["expired"] == 1 and source.stats["renewed"] == 1


def test_free_and_grant_refuse_wrong_states(source: SourceLedger) -> None:
    source.allocate("r", [1])
    with pytest.raises(InvalidTransitionError):
        source.grant("r")  # prefill not done
    with pytest.raises(InvalidTransitionError):
        source.free("r")
    with pytest.raises(UnknownRequestError):
        source.prefill_done("ghost")
    source.prefill_done("r")
    g = source.grant("r")
    with pytest.raises(InvalidTransitionError, match="lease"):
        source.free("r")
    source.consumer_done(g.transfer, g.generation)
    source.free("r")
    for bad in ([64], [-1], [[1, 2]]):
        with pytest.raises(ValueError, match="block ids"):
            source.allocate("x", bad)
    assert "x" not in source.requests


def test_target_happy_path_parts_and_policies(clock: ManualClock) -> None:
    for policy, after_fail in (("fail", "FREE"), ("recompute", "RESERVED")):
        d = TargetLedger(16, clock=clock, failure_policy=policy)
        d.reserve("r", [1, 2])
        d.start_load("r", "t", parts=3)
        assert d.part_done("t", 0) and d.part_done("t", 2)
        assert not d.part_done("t", 2)
        assert states(d, [1, 2]) == ["LOADING"] * 2
        assert d.fail("t", "part 1 failed")
        assert states(d, [1, 2]) == [after_fail] * 2
        if policy == "recompute":
            d.local_fill("r")
            d.finish("r")
        assert states(d, [1, 2]) == ["FREE"] * 2
        assert not check_target(d) and not check_quiescent(d)
    d = TargetLedger(16, clock=clock)
    d.reserve("r", [1])
    d.start_load("r", "t", parts=2)
    d.part_done("t", 0)
    d.part_done("t", 1)
    assert states(d, [1]) == ["READY_FOR_ATTENTION"]
    d.finish("r")


def test_live_state_equals_replay_at_every_event(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    clock = ManualClock()
    p = open_ledger("source", 32, str(tmp_path / "p"), clock=clock, worker="p0", fsync="never")
    snapshots = []

    def snap() -> None:
        p.log.commit()
        snapshots.append((p.log.appended, p.state.copy(), p.epoch.copy(), p.pins.copy(), set(p.leases)))

    live: dict[str, object] = {}
    for i in range(60):
        free = np.flatnonzero(p.state == SourceState.FREE)
        if len(free) >= 4 and rng.random() < 0.5:
            name = f"r{i}"
            p.allocate(name, rng.choice(free, 4, replace=False))
            p.prefill_done(name)
            live[name] = p.grant(name, ttl_s=5)
        elif live:
            name = list(live)[int(rng.integers(len(live)))]
            g = live.pop(name)
            if rng.random() < 0.7:
                p.consumer_done(g.transfer, g.generation)
            else:
                clock.advance(6)
                p.sweep()
                for other in [n for n, og in live.items() if og.transfer not in p.leases]:
                    p.free(other)
                    live.pop(other)
            if name in p.requests:
                p.free(name)
        snap()
    p.log.close()
    for count, state, epoch, pins, leases in snapshots:
        r = replay(tmp_path / "p", until_index=count)
        assert np.array_equal(r.ledger.state, state)
        assert np.array_equal(r.ledger.epoch, epoch)
        assert np.array_equal(r.ledger.pins, pins)
        assert set(r.ledger.leases) == leases


def test_replay_until_time_and_request_filter(tmp_path: Path) -> None:
    wall = iter(range(1_000_000, 2_000_000, 1000))  # one second per event
    from kvlifecycle.clock import HybridLogicalClock

    p = open_ledger("source", 8, str(tmp_path / "p"), worker="p0", hlc=HybridLogicalClock(lambda: next(wall)))
    p.allocate("a", [1])
    p.allocate("b", [2])
    p.prefill_done("a")
    p.log.close()
    r = replay(tmp_path / "p", until_time=1001.5)
    assert set(r.ledger.requests) == {"a", "b"} and states(r.ledger, [1]) == ["ALLOCATED"]
    r = replay(tmp_path / "p", request="a")
    assert [type(e).__name__ for e in r.events] == ["SrcAllocated", "SrcPrefillDone"]


def test_block_states_equals_the_full_view_for_any_blocks(source: SourceLedger) -> None:
    source.allocate("a", [1, 2, 3])
    source.prefill_done("a")
    source.grant("a")
    source.allocate("b", [4, 5])
    source.share("c", [2, 4])  # mixed: per-block path
    ids = np.array([0, 1, 2, 3, 4, 5, 6], dtype=np.int32)
    assert np.array_equal(source.block_states(ids), source.state[ids])
    assert source.block_states([1]).tolist() == [SourceState.PINNED_FOR_TRANSFER]
    assert source.block_states([5]).tolist() == [SourceState.ALLOCATED]


def test_step_changes_state_at_once_and_appends_the_records_at_its_end(tmp_path: Path) -> None:
    """Inside ``step()`` commands act immediately (state, refusals, listeners); the log gets their records, in
    order, when the step ends, so a replay equals the live ledger exactly as without a step."""
    target = open_ledger("target", 16, str(tmp_path / "d"), worker="d0")
    seen: list[str] = []
    target.listeners.append(lambda e: seen.append(type(e).__name__))
    target.reserve("r", [3, 4])
    appended = target.log.appended
    with target.step():
        target.start_load("r", "t1", generation=1, peer="p0", peer_epoch=1)
        assert states(target, [3, 4]) == ["LOADING", "LOADING"]  # the gate acted now
        assert seen[-1] == "TgtLoadStarted"  # listeners too
        with pytest.raises(InvalidTransitionError):
            target.start_load("r", "t1", generation=1, peer="p0", peer_epoch=1)  # refused now, recorded later
        with target.step():  # nested: shares the outer batch
            assert target.part_done("t1")
        assert states(target, [3, 4]) == ["READY_FOR_ATTENTION"] * 2
        assert target.log.appended == appended  # nothing appended inside the step
    assert target.log.appended == appended + 3
    target.finish("r")
    target.log.close()
    replayed = replay(tmp_path / "d")
    kinds = [type(e).__name__ for e in replayed.events]
    assert kinds[-4:] == ["TgtLoadStarted", "Refused", "TgtPartDone", "TgtFinished"]
    assert np.array_equal(replayed.ledger.state, target.state)


def test_numpy_scalars_in_a_command_are_logged_as_numbers(tmp_path: Path) -> None:
    """A generation or part taken from an array is a numpy scalar: it is written as the number it holds."""
    d = open_ledger("target", 8, tmp_path / "d", worker="d0")
    d.reserve("r", [1, 2])
    d.start_load("r", "t", parts=np.int64(2), generation=np.uint32(5), peer="p", peer_epoch=np.int64(3))
    d.part_done("t", np.int32(0))
    d.part_done("t", np.int64(1))
    d.log.close()
    events = [e for e in read_events(tmp_path / "d") if isinstance(e, (ev.TgtLoadStarted, ev.TgtPartDone))]
    assert [type(e).__name__ for e in events] == ["TgtLoadStarted", "TgtPartDone", "TgtPartDone"]
    assert (events[0].parts, events[0].generation, events[0].peer_epoch) == (2, 5, 3)
    assert all(type(x) is int for x in (events[0].parts, events[0].generation, events[1].part))
    assert replay(tmp_path / "d").ledger.requests["r"].state == TargetState.READY_FOR_ATTENTION


def test_a_command_whose_event_cannot_be_logged_changes_nothing(tmp_path: Path) -> None:
    d = open_ledger("target", 8, tmp_path / "d", worker="d0")
    d.reserve("r", [1, 2])
    with pytest.raises(TypeError, match="object"):
        d.start_load("r", "t", peer=object())  # type: ignore[arg-type]  # not a string: msgpack cannot hold it
    assert d.requests["r"].state == TargetState.RESERVED and "t" not in d.loads
    d.start_load("r", "t", peer="p")  # the request is still free to load
    d.log.close()
    assert [type(e).__name__ for e in read_events(tmp_path / "d")] == ["TgtReserved", "TgtLoadStarted"]


def test_in_a_step_an_unloggable_event_is_named_at_commit_and_the_rest_is_written(tmp_path: Path) -> None:
    """Inside ``step()`` records are encoded when the batch is written: one that cannot be is reported there (the
    command already acted), and neither the rest of the batch nor later batches are lost."""
    d = open_ledger("target", 8, tmp_path / "d", worker="d0", fsync="3600000ms")
    d.reserve("r", [1, 2])
    d.reserve("q", [3])
    with d.step():
        d.start_load("r", "t", peer=object())  # type: ignore[arg-type]
        d.start_load("q", "u", peer="p")
    with pytest.raises(LogError, match=r"could not be encoded.*TgtLoadStarted"):
        d.commit()
    d.part_done("u")
    d.commit()
    d.log.close()
    kinds = [(type(e).__name__, getattr(e, "request", getattr(e, "transfer", ""))) for e in read_events(tmp_path / "d")]
    assert kinds == [("TgtReserved", "r"), ("TgtReserved", "q"), ("TgtLoadStarted", "q"), ("TgtPartDone", "u")]
