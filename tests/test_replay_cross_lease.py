"""``replay --check`` across P's and D's logs: a lease P expired while D's read under it had not ended (and the blocks
P reallocated meanwhile) is a violation naming the transfer, the blocks and both times; ``explain`` tells the story.
The logs are written by the real ledgers through the real event log, on one manual clock and one HLC."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS, START_S, Pair

from kvlifecycle import invariants
from kvlifecycle.cli import main
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.explain import READ_OUTLIVED_LEASE, explain_logs
from kvlifecycle.ledger import open_ledger
from kvlifecycle.transfer_ids import load_id


def expired_while_loading(root: Path) -> tuple[Path, Path, str]:
    """D claims a 20 ms lease and starts reading; P's sweep expires it at +28 ms, P frees the blocks and gives them
    to req-2 at +29 ms; D fails the load only at +33 ms. Returns the logs and the transfer."""
    pair = Pair(root)
    g = pair.grant("req-1", [17, 18], [3, 4], ttl_s=0.02)  # granted at +2 ms, D reserves at +3 ms
    pair.pull("req-1", g)  # claimed and LOADING at +3 ms
    pair.ms(25)
    assert pair.p.sweep() == [g.transfer]
    pair.p.take_released()
    pair.p.free("req-1")
    pair.ms(1)
    pair.p.allocate("req-2", [17, 18])  # the blocks' next owner
    pair.ms(4)
    pair.d.fail(g.transfer, "read timed out")  # D records the end of its read only now
    pair.p.prefill_done("req-2")
    pair.p.free("req-2")
    p_log, d_log = pair.close()
    return p_log, d_log, g.transfer


def replay_check(*logs: Path) -> tuple[int, str]:
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = main(["replay", *map(str, logs), "--check"])
    return code, buffer.getvalue()


def test_check_flags_an_expiry_under_a_read_that_ended_later(tmp_path: Path) -> None:
    p_log, d_log, transfer = expired_while_loading(tmp_path)
    code, out = replay_check(p_log, d_log)
    assert code == 1
    (line,) = [line for line in out.splitlines() if "VIOLATION" in line]
    assert f"read-outlived-lease: p0 / d0: P's lease of transfer {transfer} (blocks 17-18 of req-1)" in line
    assert "expired at 2027-01-15T08:00:00.028Z" in line  # P's time ...
    assert "D's read ended at 2027-01-15T08:00:00.033Z (failed: read timed out)" in line  # ... and D's
    assert "P reallocated block(s) 17-18 to req-2 at 2027-01-15T08:00:00.029Z" in line


def test_explain_tells_the_story_of_the_expiry_under_the_read(tmp_path: Path) -> None:
    expired_while_loading(tmp_path)
    _, (finding,) = explain_logs([tmp_path])
    assert finding.rule == READ_OUTLIVED_LEASE and finding.request == "req-1" and finding.worker == "p0"
    assert finding.sentence.startswith("blocks 17-18 of req-1 were freed at +28.000 ms on p0 while transfer ")
    assert "(its lease ended: expired), and given to req-2 at +29.000 ms" in finding.sentence
    assert finding.sentence.endswith("its load failed (read timed out) 5.0 ms later")
    assert [(s.worker, s.label) for s in finding.chain] == [
        ("p0", "grant"), ("p0", "renew"), ("d0", "load start"), ("p0", "release"), ("p0", "free"),
        ("p0", "allocate"), ("d0", "load failed")]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        assert main(["explain", str(tmp_path)]) == 1
    assert f"1. [{READ_OUTLIVED_LEASE}] {finding.sentence}" in buffer.getvalue()


def test_a_normal_handoff_pair_checks_clean(tmp_path: Path) -> None:
    SCENARIOS["clean"](tmp_path)
    code, out = replay_check(tmp_path / "p0", tmp_path / "d0")
    assert code == 0 and "invariants: OK" in out
    assert explain_logs([tmp_path])[1] == []


def test_an_expiry_after_the_read_ended_is_fine(tmp_path: Path) -> None:
    """D cancels its read at its bound (before P's expiry), then P expires and reuses the blocks."""
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [5, 6], [7, 8], ttl_s=0.02)
    pair.pull("req-1", g)
    pair.ms(17)
    pair.d.fail(g.transfer, "read bound reached")
    pair.ms(8)
    assert pair.p.sweep() == [g.transfer]
    pair.p.take_released()
    pair.p.free("req-1")
    pair.p.allocate("req-2", [5, 6])
    code, out = replay_check(*pair.close())
    assert code == 0, out


def test_a_lease_released_at_the_completion_is_fine_whatever_the_stamps(tmp_path: Path) -> None:
    """P's release at D's completion is stamped on P's clock, which may run behind D's: still fine, D's read ended
    before it sent the completion."""
    clock = ManualClock(START_S)
    p_hlc = HybridLogicalClock(wall_ms=lambda: int(clock.now() * 1000))
    d_hlc = HybridLogicalClock(wall_ms=lambda: int(clock.now() * 1000) + 50)  # D's clock 50 ms ahead
    p = open_ledger("source", 8, str(tmp_path / "p0"), worker="p0", clock=clock, hlc=p_hlc, fsync="never")
    d = open_ledger("target", 8, str(tmp_path / "d0"), worker="d0", clock=clock, hlc=d_hlc, fsync="never")
    p.allocate("r", [1, 2])
    p.prefill_done("r")
    g = p.grant("r")
    d.reserve("r", [3, 4])
    assert p.heartbeat(g.transfer, g.generation, peer="d0")
    d.start_load("r", g.transfer, generation=g.generation, peer="p0")
    clock.advance(0.002)
    d.part_done(g.transfer, 0)
    assert p.consumer_done(g.transfer, g.generation)
    p.free("r")
    p.allocate("s", [1, 2])
    p.log.close()
    d.log.close()
    code, out = replay_check(tmp_path / "p0", tmp_path / "d0")
    assert code == 0, out


def test_a_load_never_started_is_fine(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [5, 6], [7, 8], ttl_s=0.02)
    assert pair.p.heartbeat(g.transfer, g.generation, peer="d0")  # claimed, but D never starts its read
    pair.ms(25)
    assert pair.p.sweep() == [g.transfer]
    pair.ms(1)
    pair.d.cancel("req-1")
    code, out = replay_check(*pair.close())
    assert code == 0, out


def test_a_read_whose_log_stops_first_is_not_proven_to_outlive_the_lease(tmp_path: Path) -> None:
    """D's log ends with the load in flight (D died) and P expires it afterwards: the logs cannot show a read then."""
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [5, 6], [7, 8], ttl_s=0.02)
    pair.pull("req-1", g)
    pair.ms(25)
    assert pair.p.sweep() == [g.transfer]
    pair.p.take_released()
    pair.p.free("req-1")
    code, out = replay_check(*pair.close())
    assert code == 0, out


def test_an_unended_read_is_flagged_when_d_logs_on_after_the_expiry(tmp_path: Path) -> None:
    """D still alive (it reserves another request) after P's expiry, the load still LOADING: the read outlived it."""
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [5, 6], [7, 8], ttl_s=0.02)
    pair.pull("req-1", g)
    pair.ms(25)
    assert pair.p.sweep() == [g.transfer]
    pair.ms(2)
    pair.d.reserve("req-9", [20])
    code, out = replay_check(*pair.close())
    assert code == 1
    assert "D's read had not ended at 2027-01-15T08:00:00.030Z (D's last event; never ended)" in out


def test_a_restarted_d_does_not_keep_its_old_read_alive(tmp_path: Path) -> None:
    """D crashed with the load in flight; its new incarnation logs on after P's expiry: that proves nothing about
    the old incarnation's read (it died with its process)."""
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [5, 6], [7, 8], ttl_s=0.02)
    pair.pull("req-1", g)
    pair.d.log.close()  # the crash
    pair.ms(25)
    assert pair.p.sweep() == [g.transfer]
    pair.ms(2)
    d2 = open_ledger("target", 32, str(tmp_path / "d0"), worker="d0", clock=pair.clock, hlc=pair.hlc,
                     fsync="never")
    d2.reserve("req-9", [20])
    d2.log.close()
    pair.p.log.close()
    code, out = replay_check(tmp_path / "p0", tmp_path / "d0")
    assert code == 0, out


class TwoRanks:
    """P ranks p0 and p1 each grant a 20 ms lease of request r; D reads rank i's in part i of one load."""

    def __init__(self, root: Path, *, claim: bool = True) -> None:
        self.root = root
        self.clock = ManualClock(START_S)
        hlc = HybridLogicalClock(wall_ms=lambda: int(self.clock.now() * 1000))
        common = {"clock": self.clock, "hlc": hlc, "fsync": "never", "default_ttl_s": 0.02}
        self.p = [open_ledger("source", 8, str(root / f"p{i}"), worker=f"p{i}", **common) for i in range(2)]
        self.d = open_ledger("target", 8, str(root / "d0"), worker="d0", clock=self.clock, hlc=hlc, fsync="never")
        self.grants = []
        for p in self.p:
            p.allocate("r", [1, 2])
            p.prefill_done("r")
            self.grants.append(p.grant("r"))
        self.d.reserve("r", [3, 4])
        if claim:
            for p, g in zip(self.p, self.grants, strict=True):
                assert p.heartbeat(g.transfer, g.generation, peer="d0")
        self.load = load_id("r", [g.transfer for g in self.grants])
        self.d.start_load("r", self.load, parts=2, generation=self.grants[0].generation, peer="p0")

    def check(self) -> tuple[int, str]:
        for ledger in (*self.p, self.d):
            ledger.log.close()
        return replay_check(self.root / "p0", self.root / "p1", self.root / "d0")


def test_a_multi_rank_load_is_checked_part_by_part(tmp_path: Path) -> None:
    """Part 0 ended before p0's expiry (fine); part 1 was still reading when p1's lease expired: only p1's lease is
    flagged, with the part."""
    ranks = TwoRanks(tmp_path)
    ranks.clock.advance(0.005)
    ranks.d.part_done(ranks.load, 0)
    ranks.clock.advance(0.020)
    assert [p.sweep() for p in ranks.p] == [[g.transfer] for g in ranks.grants]
    ranks.clock.advance(0.003)
    ranks.d.fail(ranks.load, "rank 1 read timed out")
    code, out = ranks.check()
    assert code == 1
    (line,) = [line for line in out.splitlines() if "VIOLATION" in line]
    assert f"read-outlived-lease: p1 / d0: P's lease of transfer {ranks.grants[1].transfer} (blocks 1-2 of r)" in line
    assert f"expired at 2027-01-15T08:00:00.025Z while D was reading it part(s) 1 of load {ranks.load}" in line


def test_a_multi_rank_lease_released_under_its_part_is_flagged(tmp_path: Path) -> None:
    """Nobody claimed rank 1's lease, so P1's cancel releases it at once while part 1 reads it: released under a
    reader, found part by part (the load's name is not P's transfer)."""
    ranks = TwoRanks(tmp_path, claim=False)
    ranks.clock.advance(0.002)
    assert ranks.p[1].cancel("r")
    ranks.clock.advance(0.002)
    ranks.d.part_done(ranks.load, 0)
    ranks.d.part_done(ranks.load, 1)
    code, out = ranks.check()
    assert code == 1
    (line,) = [line for line in out.splitlines() if "VIOLATION" in line]
    assert f"released-under-reader: p1 / d0: P's lease of transfer {ranks.grants[1].transfer}" in line
    assert "was released (cancelled) at 2027-01-15T08:00:00.002Z" in line
    assert "D's read ended at 2027-01-15T08:00:00.004Z (part done)" in line


@pytest.mark.mutants
def test_without_the_cross_log_rule_the_crafted_pair_checks_clean(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: ``replay --check`` without the read-outlived-lease rule. The crafted pair then checks clean, so
    the rule is what catches it."""
    p_log, d_log, _ = expired_while_loading(tmp_path)
    assert replay_check(p_log, d_log)[0] == 1
    monkeypatch.setattr(invariants, "check_read_outlived_lease", lambda *args, **kwargs: [])
    code, out = replay_check(p_log, d_log)
    assert code == 0 and "invariants: OK" in out


class TwoConsumers:
    """P rank p0 grants one lease of request r for two consumers: D ranks d0 and d1 each read their head slice of
    its blocks 1-2 (D TP 2 over P TP 1), each claiming and loading under the same transfer."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.clock = ManualClock(START_S)
        hlc = HybridLogicalClock(wall_ms=lambda: int(self.clock.now() * 1000))
        self.p = open_ledger("source", 8, str(root / "p0"), worker="p0", clock=self.clock, hlc=hlc, fsync="never")
        self.d = [open_ledger("target", 8, str(root / f"d{i}"), worker=f"d{i}", clock=self.clock, hlc=hlc,
                              fsync="never") for i in range(2)]
        self.p.allocate("r", [1, 2])
        self.p.prefill_done("r")
        self.grant = self.p.grant("r", consumers=2)
        for i, d in enumerate(self.d):
            d.reserve("r", [3, 4])
            assert self.p.heartbeat(self.grant.transfer, self.grant.generation, peer=f"d{i}")
            d.start_load("r", self.grant.transfer, generation=self.grant.generation, peer="p0")

    def done(self, consumer: int) -> None:
        """D rank ``consumer``'s read landed and P counted its completion."""
        self.clock.advance(0.001)
        self.d[consumer].part_done(self.grant.transfer, 0)
        self.p.consumer_done(self.grant.transfer, self.grant.generation, consumer)

    def check(self) -> tuple[int, str]:
        for ledger in (self.p, *self.d):
            ledger.log.close()
        return replay_check(self.root / "p0", self.root / "d0", self.root / "d1")


def test_a_lease_of_two_consumers_released_when_both_completed_is_fine(tmp_path: Path) -> None:
    pair = TwoConsumers(tmp_path)
    pair.done(0)
    pair.done(1)
    assert pair.grant.transfer not in pair.p.leases
    pair.p.take_released()
    pair.p.free("r")
    pair.p.allocate("s", [1, 2])
    code, out = pair.check()
    assert code == 0, out


def test_a_lease_of_two_consumers_released_at_the_first_completion_is_flagged(tmp_path: Path) -> None:
    """The release at d0's completion (what a ledger counting one completion for the lease would record) freed the
    blocks, and P gave them to s, while d1 still read them: released under d1's read, with the reuse."""
    pair = TwoConsumers(tmp_path)
    pair.done(0)
    lease = pair.p.leases[pair.grant.transfer]
    with pair.p._lock:
        pair.p._release(lease, "completed")
    pair.p.take_released()
    pair.p.free("r")
    pair.clock.advance(0.001)
    pair.p.allocate("s", [1, 2])
    pair.clock.advance(0.002)
    pair.d[1].part_done(pair.grant.transfer, 0)  # d1's read ends only now
    code, out = pair.check()
    assert code == 1
    (line,) = [line for line in out.splitlines() if "VIOLATION" in line]
    assert f"released-under-reader: p0 / d1: P released {pair.grant.transfer} (completed before every consumer) " \
           "while D's load was in flight" in line


def test_a_shared_lease_failed_after_one_consumer_completed_checks_clean_when_its_d_records_late(
        tmp_path: Path) -> None:
    """d0's read landed and P counted it; d1 failed its load (recorded before telling P) and P released the lease as
    failed; d0 records its part done only at its next poll, after the release: that read had ended already."""
    pair = TwoConsumers(tmp_path)
    pair.clock.advance(0.001)
    pair.p.consumer_done(pair.grant.transfer, pair.grant.generation, 0)
    pair.d[1].fail(pair.grant.transfer, "post failed")
    assert pair.p.fail(pair.grant.transfer, pair.grant.generation, "consumer: [1]: post failed")
    pair.clock.advance(0.002)
    pair.d[0].part_done(pair.grant.transfer, 0)
    code, out = pair.check()
    assert code == 0, out
    assert [f.rule for f in explain_logs([tmp_path])[1] if f.transfer] == []  # r is left allocated: not a reader's


def test_a_shared_lease_failed_under_a_sibling_still_reading_is_flagged(tmp_path: Path) -> None:
    """d0 completed and recorded it; P released the lease as failed (a failure of d1's that did not wait) while d1's
    read was still open: one completion, and it is d0's, so d1's read is under the release."""
    pair = TwoConsumers(tmp_path)
    pair.done(0)
    assert pair.p.fail(pair.grant.transfer, pair.grant.generation, "consumer: [1]: gave up")
    pair.p.take_released()
    pair.p.free("r")
    pair.clock.advance(0.002)
    pair.d[1].part_done(pair.grant.transfer, 0)
    code, out = pair.check()
    assert code == 1
    (line,) = [line for line in out.splitlines() if "VIOLATION" in line]
    assert f"released-under-reader: p0: P's lease of transfer {pair.grant.transfer} (blocks 1-2 of r, 1 of 2 " \
           "consumers completed) was released (failed)" in line
    assert "while 1 D read(s) of it had not ended (d1)" in line
    (finding,) = [f for f in explain_logs([tmp_path])[1] if f.transfer]
    assert finding.rule == "released-under-reader" and "(d1)" in finding.sentence
