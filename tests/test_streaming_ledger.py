"""The target ledger under layer-wise streaming: one event per layer batch, READY_FOR_ATTENTION only once every layer
of every block landed, a failed layer fails the request, nothing is landed twice, and the log replays to the same
state. Random interleavings (hypothesis) check the same against an independent reading of the events."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events
from kvlifecycle.invariants import check_quiescent, check_target, check_target_events
from kvlifecycle.ledger import ReplayError, TargetLedger, open_ledger
from kvlifecycle.machines import TargetState
from kvlifecycle.replay import replay

READY = TargetState.READY_FOR_ATTENTION


class _ReadyWatch:
    """Every READY_FOR_ATTENTION block seen after any event (a partially loaded READY block cannot hide)."""

    def __init__(self, ledger: TargetLedger) -> None:
        self.ledger, self.ever_ready = ledger, set()
        ledger.listeners.append(self)

    def __call__(self, _event: ev.Event) -> None:
        self.ever_ready |= set(np.flatnonzero(self.ledger.state == READY).tolist())


def _streaming(tmp_path: Path, policy: str = "fail", blocks: int = 4, layers: int = 8) -> TargetLedger:
    d = open_ledger("target", 16, tmp_path / "d", failure_policy=policy, fsync="never")
    d.reserve("r", list(range(blocks)))
    d.start_load("r", "t", mode="push", layers=layers)
    return d


@pytest.mark.parametrize("k", [0, 3, 7])
def test_layer_k_of_n_fails_no_block_is_ever_ready_and_nothing_leaks(tmp_path: Path, k: int) -> None:
    d = _streaming(tmp_path)
    watch = _ReadyWatch(d)
    for layer in range(k):
        assert d.layers_landed("t", 0, layer, 1, [0, 1, 2, 3])
    assert d.fail("t", f"write of layer {k} failed")
    assert watch.ever_ready == set()
    assert (d.state == TargetState.FREE).all() and not d.requests and not d.loads and not d.layer_progress
    assert not check_quiescent(d) and not check_target(d)
    assert not d.layers_landed("t", 0, k, 1, [0, 1, 2, 3])  # a late layer after the failure changes nothing
    d.log.close()
    r = replay(tmp_path / "d")
    assert np.array_equal(r.ledger.state, d.state) and not check_target_events(r.events)


def test_a_failed_layer_under_recompute_keeps_the_reservation_for_local_prefill(tmp_path: Path) -> None:
    d = _streaming(tmp_path, policy="recompute")
    assert d.layers_landed("t", 0, 0, 4, [0, 1, 2, 3])
    assert d.fail("t", "layer 4 failed")
    assert (d.state[:4] == TargetState.RESERVED).all() and not d.layer_progress
    d.local_fill("r")
    assert (d.state[:4] == READY).all()


def test_chunked_prefill_blocks_land_layer_by_layer_and_ready_comes_with_the_last(tmp_path: Path) -> None:
    d = _streaming(tmp_path, layers=3)
    watch = _ReadyWatch(d)
    for chunk in ([0, 1], [2, 3]):  # two prefill chunks, each sends its complete blocks layer by layer
        for layer in range(3):
            assert (d.state[:4] == TargetState.LOADING).all()
            assert d.layers_landed("t", 0, layer, 1, chunk)
    assert watch.ever_ready == {0, 1, 2, 3}
    assert (d.state[:4] == READY).all() and "t" not in d.loads
    d.log.close()
    kinds = [type(e).__name__ for e in read_events(tmp_path / "d")]
    assert kinds.count("TgtLayersLanded") == 6 and kinds.count("TgtPartDone") == 1  # per batch, not per block
    assert kinds.index("TgtPartDone") == len(kinds) - 1


def test_the_ready_state_waits_for_every_part_of_a_multi_rank_stream(tmp_path: Path) -> None:
    d = open_ledger("target", 8, tmp_path / "d", fsync="never")
    d.reserve("r", [5, 6])
    d.start_load("r", "t", parts=2, mode="push", layers=2)
    assert d.layers_landed("t", 0, 0, 2, [5, 6])  # rank 0 done
    assert (d.state[[5, 6]] == TargetState.LOADING).all()
    assert d.layers_landed("t", 1, 0, 1, [5, 6]) and d.layers_landed("t", 1, 1, 1, [6, 5])
    assert (d.state[[5, 6]] == READY).all()


@pytest.mark.parametrize(
    ("batch", "why"),
    [
        ((0, 0, 1, [0, 1]), "duplicate: layer 0 of block 0"),
        ((0, 1, 8, [0]), "not within"),
        ((0, -1, 1, [0]), "not within"),
        ((1, 0, 1, [0]), "part 1 not in"),
        ((0, 1, 1, [9]), "not the request's"),
        ((0, 1, 1, [0, 0]), "twice"),
        ((0, 1, 1, []), "no block ids"),
    ],
    ids=["landed twice", "past the last layer", "negative layer", "no such part", "another block", "twice in one",
         "no blocks"],
)
def test_a_bad_layer_batch_is_refused_and_changes_nothing(tmp_path: Path, batch: tuple, why: str) -> None:
    d = _streaming(tmp_path)
    assert d.layers_landed("t", 0, 0, 1, [0, 1])
    before = d.layer_progress["t"].landed.copy()
    assert not d.layers_landed("t", *batch)
    assert np.array_equal(d.layer_progress["t"].landed, before)
    assert d.refusals and any(why in reason for reason in _reasons(tmp_path, d))


def _reasons(tmp_path: Path, d: TargetLedger) -> list[str]:
    d.log.commit()
    return [e.reason for e in read_events(tmp_path / "d") if isinstance(e, ev.Refused)]


def test_part_done_cannot_complete_a_streaming_load_and_layers_cannot_land_on_a_whole_load(tmp_path: Path) -> None:
    d = _streaming(tmp_path)
    assert not d.part_done("t", 0)
    assert (d.state[:4] == TargetState.LOADING).all()
    d.reserve("whole", [8])
    d.start_load("whole", "w")
    assert not d.layers_landed("w", 0, 0, 1, [8])
    assert any("complete by their layers" in r for r in _reasons(tmp_path, d))
    assert any("not a streaming load" in r for r in _reasons(tmp_path, d))


def test_cancel_mid_stream_waits_for_in_flight_layers_then_frees(tmp_path: Path) -> None:
    d = _streaming(tmp_path, layers=4)
    assert d.layers_landed("t", 0, 0, 1, [0, 1, 2, 3])
    assert d.cancel("r")
    assert (d.state[:4] == TargetState.LOADING).all()  # layer 1's write may still be landing
    assert d.layers_landed("t", 0, 1, 1, [0, 1, 2, 3])  # it lands: still not the new owner's
    assert d.fail("t", "stream cancelled; in-flight writes settled")  # the stream settles: discarded
    assert (d.state == TargetState.FREE).all() and not d.requests and d.stats["discarded"] == 1
    assert not check_quiescent(d)


def test_a_stream_that_completes_after_a_cancel_is_discarded(tmp_path: Path) -> None:
    d = _streaming(tmp_path, layers=1)
    assert d.cancel("r")
    assert d.layers_landed("t", 0, 0, 1, [0, 1, 2, 3])
    assert (d.state == TargetState.FREE).all() and d.stats["discarded"] == 1


def test_a_declined_stream_returns_the_reservation_whatever_the_policy(tmp_path: Path) -> None:
    d = _streaming(tmp_path, policy="fail")
    assert d.decline("t", "prefill began without the reservation")
    assert (d.state[:4] == TargetState.RESERVED).all() and not d.loads and not d.layer_progress
    d.start_load("r", "pull-after-prefill")  # the post-prefill path fills the same reservation
    assert d.part_done("pull-after-prefill")
    assert (d.state[:4] == READY).all()


def test_a_stream_with_a_landed_layer_cannot_be_declined(tmp_path: Path) -> None:
    d = _streaming(tmp_path)
    assert d.layers_landed("t", 0, 0, 1, [0])
    assert not d.decline("t", "too late")
    assert (d.state[:4] == TargetState.LOADING).all()
    assert any("fail it instead" in r for r in _reasons(tmp_path, d))


def test_replay_restores_the_landed_layers_and_continues(tmp_path: Path) -> None:
    d = _streaming(tmp_path, layers=2)
    assert d.layers_landed("t", 0, 0, 1, [0, 2])
    d.log.close()
    r = replay(tmp_path / "d")
    again = r.ledger
    assert np.array_equal(again.layer_progress["t"].landed, d.layer_progress["t"].landed)
    assert again.layer_progress["t"].landed_layers(0) == 0  # blocks 1 and 3 lack layer 0


def test_a_log_whose_streaming_part_completes_with_a_layer_missing_does_not_fold() -> None:
    d = TargetLedger(4)
    d.reserve("r", [0, 1])
    recorded: list[ev.Event] = []
    d.listeners.append(recorded.append)
    d.start_load("r", "t", layers=2)
    forged = [*recorded, ev.TgtLayersLanded(10**6, 1.0, "t", 0, 0, 1, ev.pack_blocks(np.array([0, 1]))),
              ev.TgtPartDone(10**6 + 1, 1.0, "t", 0)]
    fresh = TargetLedger(4)
    fresh.reserve("r", [0, 1])
    fresh.begin_replay()
    with pytest.raises(ReplayError, match="layers missing"):
        fresh.apply_all(forged)
    assert [v.rule for v in check_target_events([ev.TgtReserved(1, 0.0, "r", ev.pack_blocks(np.array([0, 1]))),
                                                 *forged])] == ["part-before-its-layers"]


def test_start_load_refuses_a_layer_count_out_of_range() -> None:
    d = TargetLedger(4)
    d.reserve("r", [0])
    with pytest.raises(ValueError, match="layers"):
        d.start_load("r", "t", layers=-1)
    assert "r" in d.requests and not d.loads


# --- random interleavings ------------------------------------------------------------------------------------

N = 10


class Streams(RuleBasedStateMachine):
    """Reserve, stream layer batches (any order, any subset, duplicates and strays included), fail, cancel and
    finish at random; after every step no READY block has a layer missing and the ledger is consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.d = open_ledger("target", N, f"{self.dir}/d", failure_policy="recompute", fsync="never")
        self.n = 0
        self.landed: dict[tuple[str, int], set[tuple[int, int]]] = {}  # what the test saw accepted

    @rule(size=st.integers(1, 3), parts=st.integers(1, 2), layers=st.integers(1, 4))
    def reserve_and_stream(self, size: int, parts: int, layers: int) -> None:
        free = np.flatnonzero(self.d.state == TargetState.FREE)
        if free.size < size:
            return
        name, self.n = f"r{self.n}", self.n + 1
        self.d.reserve(name, free[:size])
        self.d.start_load(name, f"t-{name}", parts=parts, mode="push", layers=layers)

    @rule(data=st.data())
    def land(self, data: st.DataObject) -> None:
        if not self.d.layer_progress:
            return
        transfer = data.draw(st.sampled_from(sorted(self.d.layer_progress)))
        progress = self.d.layer_progress[transfer]
        part = data.draw(st.integers(0, progress.landed.shape[0]))  # one past the last: refused
        first = data.draw(st.integers(0, progress.layers))
        count = data.draw(st.integers(1, 2))
        pool = [*progress.blocks.tolist(), (int(progress.blocks.max()) + 1) % N]  # a stray block too
        ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=len(pool), unique=True))
        pairs = {(b, layer) for b in ids for layer in range(first, first + count)}
        seen = self.landed.setdefault((transfer, part), set())
        valid = (part < progress.landed.shape[0] and first + count <= progress.layers
                 and set(ids) <= set(progress.blocks.tolist()) and not pairs & seen)
        assert self.d.layers_landed(transfer, part, first, count, ids) == valid
        if valid:
            seen |= pairs

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        if self.d.loads:
            self.d.fail(data.draw(st.sampled_from(sorted(self.d.loads))), "a layer's write failed")

    @rule(data=st.data())
    def decline(self, data: st.DataObject) -> None:
        if self.d.layer_progress:
            transfer = data.draw(st.sampled_from(sorted(self.d.layer_progress)))
            untouched = not self.d.layer_progress[transfer].landed.any()
            assert self.d.decline(transfer, "prefill began first") == untouched

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        if self.d.requests:
            self.d.cancel(data.draw(st.sampled_from(sorted(self.d.requests))))

    @rule()
    def finish_ready(self) -> None:
        for name, req in list(self.d.requests.items()):
            if (self.d.state[req.blocks] == READY).all():
                self.d.finish(name)

    @invariant()
    def no_ready_block_lacks_a_layer(self) -> None:
        assert not check_target(self.d), check_target(self.d)
        for req in self.d.requests.values():
            if req.transfer is not None:
                assert not (self.d.state[req.blocks] == READY).any()
        self.d.log.commit()
        assert not check_target_events(read_events(f"{self.dir}/d"))

    def teardown(self) -> None:
        try:
            for transfer in list(self.d.loads):
                self.d.fail(transfer, "drain")
            for name in list(self.d.requests):
                self.d.cancel(name)
            assert not check_quiescent(self.d) and (self.d.state == 0).all() and not self.d.layer_progress
            self.d.log.close()
            r = replay(f"{self.dir}/d")
            assert np.array_equal(r.ledger.state, self.d.state) and not check_target_events(r.events)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


Streams.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_streams = Streams.TestCase


def test_the_timeline_shows_each_layer_batch_and_the_load_ready_after_the_last(tmp_path: Path) -> None:
    from kvlifecycle.timeline import timeline_from_logs

    d = _streaming(tmp_path, layers=2)
    assert d.layers_landed("t", 0, 0, 1, [0, 1, 2, 3])
    assert d.layers_landed("t", 0, 1, 1, [0, 1, 2, 3])
    d.finish("r")
    d.log.close()
    timeline = timeline_from_logs([tmp_path / "d"])
    assert [i.name for i in timeline.instants if "landed" in i.name] == ["layer 0 landed", "layer 1 landed"]
    load = next(s for s in timeline.slices if s.category == "load")
    assert load.args["outcome"] == "ready" and load.args["layers"] == 2
    assert load.end >= max(i.ts for i in timeline.instants if "landed" in i.name)
