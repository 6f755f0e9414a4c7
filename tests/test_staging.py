"""P's host staging tier: the pool's ledger, the hand-over from the GPU lease, and the checks across P's, the pool's
and D's logs — named races, a hypothesis state machine against a model, the real ``replay --check``, mutants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlifecycle import events as ev
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import EventLog
from kvlifecycle.invariants import check_merged, check_source
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import HostSlotState
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.staging import HostStaging, Where
from kvlifecycle.staging_checks import check_staging, check_staging_events, check_staging_merged
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StageWhen, StagingPolicy, WhenFull

H = HostSlotState


class Rig:
    """P (GPU ledger + host pool, one HLC) and D, every event captured; logs under ``log_dir`` when given."""

    def __init__(self, *, pool_blocks: int = 8, policy: StagingPolicy | None = None, log_dir: Path | None = None,
                 gpu_blocks: int = 32) -> None:
        self.clock = ManualClock()
        self.hlc = HybridLogicalClock()

        def log(name: str) -> EventLog | None:
            return None if log_dir is None else EventLog(log_dir / name, fsync="never")

        self.p = SourceLedger(gpu_blocks, clock=self.clock, hlc=self.hlc, worker="P", log=log("p"))
        self.pool = StagingLedger(pool_blocks, clock=self.clock, hlc=self.hlc, source_worker="P",
                                  log=log("staging"))
        self.d = TargetLedger(gpu_blocks, clock=self.clock, hlc=self.hlc, worker="D", log=log("d"))
        self.staging = HostStaging(self.p, self.pool, policy or StagingPolicy(
            when=StageWhen.AFTER, stage_after_ms=100, pool_blocks=pool_blocks))
        self.events: dict[str, list[ev.Event]] = {"p": [], "staging": [], "d": []}
        for name, ledger in (("p", self.p), ("staging", self.pool), ("d", self.d)):
            ledger.listeners.append(self.events[name].append)
        self._next = 0

    def granted(self, blocks: list[int], ttl_s: float = 30.0) -> tuple[str, str, int]:
        request = f"r{self._next}"
        self._next += 1
        self.p.allocate(request, blocks)
        self.p.prefill_done(request)
        grant = self.p.grant(request, ttl_s=ttl_s)
        return request, grant.transfer, grant.generation

    def staged(self, blocks: list[int]) -> tuple[str, str, int]:
        request, transfer, generation = self.granted(blocks)
        self.clock.advance(0.2)
        assert transfer in self.staging.due()
        assert self.staging.begin(transfer) is not None
        assert self.staging.copy_done(transfer)
        return request, transfer, generation

    def d_reads(self, request: str, transfer: str, generation: int, d_blocks: list[int], ok: bool = True) -> Where:
        """D's whole pull: reserve, claim, start, end, tell P."""
        self.d.reserve(request, d_blocks)
        where = self.staging.claim(transfer, generation, "D")
        assert where is not Where.NOWHERE
        self.d.start_load(request, transfer, generation=generation)
        if ok:
            self.d.part_done(transfer)
        else:
            self.d.fail(transfer, "read failed")
        self.staging.read_done(where, transfer, generation, ok=ok)
        return where

    def violations(self) -> list[str]:
        e = self.events
        out = check_staging(self.pool) + check_source(self.p) + check_staging_events(e["staging"])
        out += check_staging_merged(e["p"], e["staging"], e["d"]) + check_merged(e["p"], e["d"])
        return [str(v) for v in out]


# --- the hand-over, step by step ------------------------------------------------------------------------------


def test_a_staged_lease_frees_the_gpu_blocks_and_is_served_from_host() -> None:
    rig = Rig()
    request, transfer, generation = rig.staged([1, 2, 3])
    assert [r.reason for r in rig.p.take_released()] == ["staged"]
    rig.p.free(request)  # the engine takes its GPU blocks back while D has not read yet
    assert rig.p.counts()["FREE"] == 32
    assert rig.pool.counts()["STAGED"] == 3
    assert rig.d_reads(request, transfer, generation, [5, 6, 7]) is Where.HOST
    assert rig.pool.counts()["FREE"] == 8 and rig.pool.stats["completed"] == 1
    assert rig.violations() == []


def test_policy_never_stages_nothing() -> None:
    rig = Rig(policy=StagingPolicy())
    rig.granted([1])
    rig.clock.advance(100)
    assert rig.staging.due(free_gpu_blocks=0) == []


def test_watermark_policy_stages_the_oldest_unclaimed_leases_when_blocks_run_low() -> None:
    rig = Rig(policy=StagingPolicy(when="watermark", free_block_watermark=4, pool_blocks=8))
    _, first, _ = rig.granted([1])
    rig.clock.advance(0.01)
    _, second, _ = rig.granted([2])
    assert rig.staging.due(free_gpu_blocks=10) == []
    assert rig.staging.due(free_gpu_blocks=3) == [first, second]


def test_policy_is_validated_and_read_from_an_engine_config() -> None:
    with pytest.raises(ValueError, match="needs a host pool"):
        StagingPolicy(when="after")
    with pytest.raises(ValueError, match="stage_when"):
        StagingPolicy(when="sometimes", pool_blocks=1)
    with pytest.raises(ValueError, match="stage_after_ms"):
        StagingPolicy(when="after", stage_after_ms=-1, pool_blocks=1)
    policy = StagingPolicy.from_mapping({"stage_when": "after", "stage_after_ms": "250", "staging_pool_blocks": 64,
                                         "staging_when_full": "keep_gpu", "other": 1})
    assert policy == StagingPolicy(StageWhen.AFTER, 250.0, 0, 64, WhenFull.KEEP_GPU)


# --- named races ------------------------------------------------------------------------------------------------


def test_race_claim_while_the_copy_is_in_flight_keeps_the_gpu_copy_pinned() -> None:
    rig = Rig()
    request, transfer, generation = rig.granted([1, 2])
    rig.clock.advance(0.2)
    assert rig.staging.begin(transfer) is not None
    rig.d.reserve(request, [4, 5])
    assert rig.staging.claim(transfer, generation, "D") is Where.GPU  # the half-written copy is not offered
    rig.d.start_load(request, transfer, generation=generation)
    assert not rig.staging.copy_done(transfer)  # whole now, but D may be reading the GPU copy: dropped
    assert rig.p.leases[transfer].claimed and rig.p.pins[[1, 2]].tolist() == [1, 1]
    assert rig.pool.counts()["FREE"] == 8
    rig.d.part_done(transfer)
    assert rig.staging.read_done(Where.GPU, transfer, generation)
    assert [r.reason for r in rig.p.take_released()] == ["completed"]
    assert rig.violations() == []


def test_race_claim_of_a_claimed_lease_is_never_staged() -> None:
    rig = Rig()
    _, transfer, generation = rig.granted([1])
    assert rig.staging.claim(transfer, generation, "D") is Where.GPU
    rig.clock.advance(1)
    assert rig.staging.due() == [] and rig.staging.begin(transfer) is None


def test_race_a_half_written_slot_is_never_served() -> None:
    rig = Rig()
    _, transfer, generation = rig.granted([1])
    rig.clock.advance(0.2)
    rig.staging.begin(transfer)
    assert not rig.pool.serve(transfer, generation, "D")
    assert rig.pool.refusals == {"serve: copy is STAGING": 1}


def test_race_a_slot_is_not_reused_while_its_read_is_in_flight() -> None:
    rig = Rig(pool_blocks=2)
    request, transfer, generation = rig.staged([1, 2])
    rig.d.reserve(request, [5, 6])
    assert rig.staging.claim(transfer, generation, "D") is Where.HOST
    _, other, _ = rig.granted([3, 4])
    rig.clock.advance(0.2)
    assert rig.staging.due() == [other] and rig.staging.begin(other) is None  # full: waits
    assert not rig.pool.cancel(transfer)  # a cancel waits for the read too
    rig.d.start_load(request, transfer, generation=generation)
    rig.d.part_done(transfer)
    rig.staging.read_done(Where.HOST, transfer, generation)
    assert rig.staging.begin(other) is not None  # the slots came back only now
    assert rig.violations() == []


def test_race_a_full_pool_under_keep_gpu_leaves_the_lease_on_the_gpu() -> None:
    rig = Rig(pool_blocks=1, policy=StagingPolicy(when="after", pool_blocks=1, when_full="keep_gpu"))
    _, transfer, _ = rig.granted([1, 2])
    assert rig.staging.begin(transfer) is None
    assert rig.staging.due() == []


def test_race_the_lease_expires_on_a_staged_copy() -> None:
    rig = Rig()
    request, transfer, generation = rig.staged([1])
    rig.clock.advance(31)
    rig.d.reserve(request, [3])
    assert rig.staging.claim(transfer, generation, "D") is Where.NOWHERE  # D must not read
    assert rig.pool.stats["expired"] == 1 and not rig.pool.requests
    assert rig.violations() == []


def test_race_the_lease_expires_under_a_read_the_bound_ended() -> None:
    rig = Rig()
    request, transfer, generation = rig.staged([1])
    rig.d.reserve(request, [3])
    assert rig.staging.claim(transfer, generation, "D") is Where.HOST
    rig.d.start_load(request, transfer, generation=generation)
    rig.d.fail(transfer, "read bound")  # D's read bound ends the read before the lease's expiry
    rig.clock.advance(31)
    assert rig.staging.sweep() == [transfer]
    assert rig.pool.counts()["FREE"] == 8
    assert rig.violations() == []


def test_race_a_failed_copy_is_dropped_and_the_gpu_copy_stays() -> None:
    rig = Rig()
    _, transfer, generation = rig.granted([1])
    rig.clock.advance(0.2)
    rig.staging.begin(transfer)
    assert not rig.staging.copy_done(transfer, ok=False, reason="cudaErrorIllegalAddress")
    assert transfer in rig.p.leases and rig.staging.claim(transfer, generation, "D") is Where.GPU


def test_race_a_crash_mid_staging_leaves_nothing_served(tmp_path: Path) -> None:
    rig = Rig(log_dir=tmp_path)
    _, transfer, generation = rig.granted([1, 2])
    rig.clock.advance(0.2)
    rig.staging.begin(transfer)
    for ledger in (rig.p, rig.pool, rig.d):
        assert ledger.log is not None
        ledger.log.close()  # P dies with its copy in flight
    # P's next incarnation appends to the same logs; its pool starts empty
    again = StagingLedger(8, clock=rig.clock, source_worker="P", log=EventLog(tmp_path / "staging", fsync="never"))
    assert not again.serve(transfer, generation, "D")
    assert again.log is not None
    again.log.close()
    result = replay(tmp_path / "staging")
    assert result.restarts and result.restarts[0]["staged_copies"] == 1
    assert check(result) == []
    assert not result.ledger.requests


# --- the checks catch what the ledgers prevent ---------------------------------------------------------------


def test_checks_flag_a_slot_served_half_written_and_reused_while_held() -> None:
    slots = ev.pack_blocks(np.arange(2))
    events: list[ev.Event] = [
        ev.StgStarted(1, 0.0, "r", "t", 1, slots, slots, 1, 1, 30.0, 30.0),
        ev.StgServed(2, 0.1, "t", 30.1, "D"),
        ev.StgStarted(3, 0.2, "r2", "t2", 2, slots, slots, 1, 1, 30.0, 30.0),
    ]
    rules = {v.rule for v in check_staging_events(events)}
    assert rules == {"served-half-written", "slot-reused"}
    # across a restart the pool is new: the same slots are free again
    assert check_staging_events(events[:1] + events[2:], restarts=[1]) == []


def test_checks_flag_a_hand_over_under_a_reader_and_a_read_of_given_back_blocks() -> None:
    rig = Rig()
    request, transfer, generation = rig.granted([1])
    rig.d.reserve(request, [3])
    rig.d.start_load(request, transfer, generation=generation)  # D reads without claiming (a buggy D)
    rig.clock.advance(0.2)
    rig.staging.begin(transfer)
    rig.staging.copy_done(transfer)
    rig.d.part_done(transfer)
    assert "staged-under-reader" in {v.rule for v in check_staging_merged(
        rig.events["p"], rig.events["staging"], rig.events["d"])}
    _, late, late_generation = rig.staged([2])
    rig.d.reserve("late", [4])
    rig.d.start_load("late", late, generation=late_generation)  # no claim of the staged copy
    assert "staged-read-unserved" in {v.rule for v in check_staging_merged(
        rig.events["p"], rig.events["staging"], rig.events["d"])}


@pytest.mark.mutants
def test_mutant_gpu_blocks_released_before_the_copy_completed_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    def released_first(self: HostStaging, transfer: str, ok: bool = True, reason: str = "") -> bool:
        copy = self.pool.requests[transfer]
        handed = self.source.hand_over_staged(transfer, copy.generation)  # the mutant: before the copy is whole
        self.pool.copy_completed(transfer)
        return handed

    monkeypatch.setattr(HostStaging, "copy_done", released_first)
    rig = Rig(log_dir=tmp_path)
    request, transfer, generation = rig.staged([1, 2])
    rig.p.free(request)
    rig.d_reads(request, transfer, generation, [5, 6])
    assert any(v.startswith("staged-before-copy") for v in rig.violations())
    for ledger in (rig.p, rig.pool, rig.d):
        assert ledger.log is not None
        ledger.log.close()
    assert "staged-before-copy" in {v.rule for v in check_pair(
        [replay(tmp_path / name) for name in ("p", "staging", "d")])}


def test_a_hand_over_without_its_staging_log_is_unaccounted_for(tmp_path: Path) -> None:
    rig = Rig(log_dir=tmp_path)
    request, transfer, generation = rig.staged([1])
    rig.p.free(request)
    rig.d_reads(request, transfer, generation, [5])
    for ledger in (rig.p, rig.pool, rig.d):
        assert ledger.log is not None
        ledger.log.close()
    results = [replay(tmp_path / name) for name in ("p", "staging", "d")]
    assert check_pair(results) == []
    assert "staged-before-copy" in {v.rule for v in check_pair([results[0], results[2]])}


# --- logs: fold == live, the real replay --check ----------------------------------------------------------------


def test_logs_fold_to_the_live_pool_and_replay_check_passes_quiescent(tmp_path: Path) -> None:
    rig = Rig(log_dir=tmp_path)
    for i in range(3):
        request, transfer, generation = rig.staged([2 * i, 2 * i + 1])
        rig.p.free(request)
        rig.d_reads(request, transfer, generation, [10 + 2 * i, 11 + 2 * i], ok=i != 1)
        rig.d.finish(request) if i != 1 else None
    request, transfer, generation = rig.granted([20])
    rig.d_reads(request, transfer, generation, [20])  # claimed before staging: GPU
    rig.p.free(request)
    for ledger in (rig.p, rig.pool, rig.d):
        assert ledger.log is not None
        ledger.log.close()
    folded = replay(tmp_path / "staging").ledger
    assert isinstance(folded, StagingLedger)
    assert np.array_equal(folded.state, rig.pool.state) and folded.stats == rig.pool.stats
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", *(str(tmp_path / n) for n in
                          ("p", "staging", "d")), "--check", "--quiescent"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


# --- a state machine: random interleavings against the rules --------------------------------------------------


class StagingRaces(RuleBasedStateMachine):
    """Grants, staging copies that complete or fail, claims before, during and after a copy, reads that end or
    fail, expiries and cancels, in any order: no check ever fails, and the logs fold to the live state."""

    def __init__(self) -> None:
        super().__init__()
        self.rig = Rig(pool_blocks=6, gpu_blocks=64)
        self.free_gpu = list(range(64))
        self.live: dict[str, tuple[str, int]] = {}  # transfer -> (request, generation)
        self.copying: list[str] = []
        self.reads: dict[str, Where] = {}  # transfer -> where a claimed read is in flight
        self.blocks_of: dict[str, list[int]] = {}

    @rule(n=st.integers(1, 3))
    def grant(self, n: int) -> None:
        if len(self.free_gpu) < n:
            return
        blocks, self.free_gpu = self.free_gpu[:n], self.free_gpu[n:]
        request, transfer, generation = self.rig.granted(blocks, ttl_s=5.0)
        self.live[transfer] = (request, generation)
        self.blocks_of[request] = blocks

    @rule(seconds=st.sampled_from([0.05, 0.5, 6.0]))
    def tick(self, seconds: float) -> None:
        self.rig.clock.advance(seconds)
        self._read_bound()

    def _read_bound(self) -> None:
        """D's read bound: a read ends before the lease it reads under expires, wherever it reads from (D gives
        it up at a fraction of the TTL, so no renewal or sweep ever sees a read outlive its lease)."""
        now = self.rig.clock.now()
        for transfer, where in list(self.reads.items()):
            if where is Where.GPU:
                lease = self.rig.p.leases.get(transfer)
                expired = lease is not None and lease.expires_at <= now
            else:
                copy = self.rig.pool.requests.get(transfer)
                expired = copy is not None and copy.expires_at <= now
            if expired:
                del self.reads[transfer]
                self.rig.staging.read_done(where, transfer, self.live[transfer][1], ok=False, reason="bound")

    @rule()
    def stage_due(self) -> None:
        for transfer in self.rig.staging.due():
            if self.rig.staging.begin(transfer) is not None:
                self.copying.append(transfer)

    @precondition(lambda self: self.copying)
    @rule(ok=st.booleans(), data=st.data())
    def copy_ends(self, ok: bool, data: st.DataObject) -> None:
        transfer = self.copying.pop(data.draw(st.integers(0, len(self.copying) - 1)))
        self.rig.staging.copy_done(transfer, ok=ok)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def claim(self, data: st.DataObject) -> None:
        transfer = data.draw(st.sampled_from(sorted(self.live)))
        if transfer in self.reads:
            return
        _, generation = self.live[transfer]
        where = self.rig.staging.claim(transfer, generation, "D")
        if where is not Where.NOWHERE:
            self.reads[transfer] = where

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        """A keepalive before a read, or the reader's renewal during it: never a read of its own."""
        transfer = data.draw(st.sampled_from(sorted(self.live)))
        _, generation = self.live[transfer]
        copy = self.rig.pool.requests.get(transfer)
        readers = copy.readers if copy is not None else 0
        where = self.rig.staging.renew(transfer, generation, "D", claim=transfer in self.reads)
        copy = self.rig.pool.requests.get(transfer)
        assert (copy.readers if copy is not None else 0) == readers or where is Where.NOWHERE

    @precondition(lambda self: self.reads)
    @rule(ok=st.booleans(), data=st.data())
    def read_ends(self, ok: bool, data: st.DataObject) -> None:
        transfer = data.draw(st.sampled_from(sorted(self.reads)))
        where = self.reads.pop(transfer)
        _, generation = self.live[transfer]
        self.rig.staging.read_done(where, transfer, generation, ok=ok)

    @rule()
    def sweep(self) -> None:
        self._read_bound()
        self.rig.p.sweep(keep=[t for t, w in self.reads.items() if w is Where.GPU])
        self.rig.pool.sweep()
        for transfer in self._ended():
            del self.live[transfer]

    def _ended(self) -> list[str]:
        return [t for t in self.live if t not in self.rig.p.leases and t not in self.rig.pool.requests
                and t not in self.reads]

    @invariant()
    def checks_hold(self) -> None:
        assert self.rig.violations() == []
        for released in self.rig.p.take_released():  # the engine frees what the lease gave back
            if released.request in self.rig.p.requests and not self.rig.p.requests[released.request].leases:
                self.rig.p.free(released.request)
                self.free_gpu += self.blocks_of.pop(released.request)

    @invariant()
    def a_read_in_flight_pins_what_it_reads(self) -> None:
        for transfer, where in self.reads.items():
            if where is Where.GPU:
                assert transfer in self.rig.p.leases
            else:
                assert self.rig.pool.requests[transfer].state == H.SERVING

    def teardown(self) -> None:
        folded = StagingLedger.fold(self.rig.events["staging"], 6)
        assert np.array_equal(folded.state, self.rig.pool.state)


TestStagingRaces = StagingRaces.TestCase
TestStagingRaces.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# --- told: replay --request, explain, the timeline --------------------------------------------------------------


def _one_staged_handoff(log_dir: Path) -> str:
    rig = Rig(log_dir=log_dir)
    request, transfer, generation = rig.staged([1, 2, 3])
    rig.p.free(request)
    rig.clock.advance(0.5)
    rig.d_reads(request, transfer, generation, [5, 6, 7])
    rig.d.finish(request)
    for ledger in (rig.p, rig.pool, rig.d):
        assert ledger.log is not None
        ledger.log.close()
    return request


def test_replay_request_tells_the_staged_copy(tmp_path: Path) -> None:
    request = _one_staged_handoff(tmp_path)
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", str(tmp_path), "--request", request],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for line in ("copy to host", "STAGING → STAGED", "PINNED_FOR_TRANSFER → RELEASABLE", "staged",
                 "serve staged copy", "STAGED → SERVING", "release staged copy",
                 "P~host: staged copy released (completed)"):
        assert line in out.stdout, line


def test_explain_finds_nothing_in_a_clean_staged_handoff_and_tells_a_mutant_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifecycle.explain import explain_logs

    _one_staged_handoff(tmp_path / "clean")
    assert explain_logs([tmp_path / "clean"])[1] == []

    def released_first(self: HostStaging, transfer: str, ok: bool = True, reason: str = "") -> bool:
        copy = self.pool.requests[transfer]
        handed = self.source.hand_over_staged(transfer, copy.generation)
        self.pool.copy_completed(transfer)
        return handed

    monkeypatch.setattr(HostStaging, "copy_done", released_first)
    _one_staged_handoff(tmp_path / "mutant")
    found = explain_logs([tmp_path / "mutant"])[1]
    assert [f.rule for f in found] == ["staged-before-copy"]
    assert "before its copy to host completed" in found[0].sentence


def test_the_timeline_draws_the_host_pool(tmp_path: Path) -> None:
    from kvlifecycle.timeline import timeline_from_logs

    _one_staged_handoff(tmp_path)
    timeline = timeline_from_logs([tmp_path])
    pool = [s for s in timeline.slices if s.track == "host pool"]
    assert [s.category for s in pool] == ["staging", "staged"]
    assert all(not s.open for s in pool) and pool[1].args["reason"] == "completed"


# --- metrics ----------------------------------------------------------------------------------------------------


def test_metrics_count_staged_blocks_pool_occupancy_and_pinned_block_seconds() -> None:
    from kvlifecycle.staging_metrics import StagingMetrics

    rig = Rig()
    metrics = StagingMetrics.attach(rig.p, rig.pool)
    request, transfer, generation = rig.granted([1, 2, 3])
    rig.clock.advance(2.0)  # 3 blocks pinned for 2 s, then staged
    assert rig.staging.begin(transfer) is not None
    assert metrics.pool_occupancy == 3
    rig.staging.copy_done(transfer)
    assert metrics.staged_blocks == 3 and metrics.pinned_block_seconds() == pytest.approx(6.0)
    _, other, other_generation = rig.granted([4])
    rig.staging.claim(other, other_generation, "D")  # claimed at once: stays on the GPU
    rig.clock.advance(1.0)
    assert metrics.pinned_block_seconds(rig.clock.now()) == pytest.approx(7.0)
    rig.staging.read_done(Where.GPU, other, other_generation)
    rig.d_reads(request, transfer, generation, [5, 6, 7])
    assert metrics.as_dict() == {"staged_blocks": 3, "pool_occupancy": 0, "pool_slots": 8,
                                 "pinned_block_seconds": pytest.approx(7.0)}


def test_a_renewal_of_a_staged_copy_moves_its_expiry_and_starts_no_read() -> None:
    rig = Rig()
    _, transfer, generation = rig.granted([1])
    rig.clock.advance(0.2)
    rig.staging.begin(transfer)
    assert rig.staging.where(transfer, generation) is Where.GPU  # not whole yet: the GPU copy is the lease's
    assert not rig.pool.renew(transfer, generation) and rig.pool.refusals == {"renew: copy is STAGING": 1}
    rig.staging.copy_done(transfer)
    assert rig.staging.where(transfer, generation) is Where.HOST
    rig.clock.advance(20)
    assert rig.staging.renew(transfer, generation, "D") is Where.HOST
    copy = rig.pool.requests[transfer]
    assert copy.expires_at == pytest.approx(rig.clock.now() + 30) and copy.readers == 0
    rig.clock.advance(29)  # past the grant's first expiry, inside the renewed one
    assert rig.staging.claim(transfer, generation, "D") is Where.HOST
    assert rig.staging.renew(transfer, generation, "D", claim=True) is Where.HOST and copy.readers == 1
    assert rig.staging.renew(transfer, generation + 1) is Where.NOWHERE  # a stale token
    assert rig.violations() == []
    folded = StagingLedger.fold(rig.events["staging"], 8)
    assert folded.requests[transfer].expires_at == copy.expires_at
