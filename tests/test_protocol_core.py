"""The protocol core's decisions alone (kvlifecycle.protocol): no threads, sockets or clocks, state + event + now."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kvlifecycle.protocol import READ_DEADLINE_FRACTION, WRITE_IN_FLIGHT, PushWrites, RenewalClock, is_write_in_flight
from kvlifecycle.protocol.bounds import STREAM_SETTLE_S
from kvlifecycle.protocol.load import PEER_RESTARTED, LoadProgress


@dataclass
class Lease:
    generation: int
    expires_at: float


def test_one_write_per_part_and_a_lease_held_while_it_is_in_flight() -> None:
    w = PushWrites()
    assert not w.is_duplicate("t", 1, 0)
    w.accept("t", 1, 0)
    assert w.is_duplicate("t", 1, 0) and not w.is_duplicate("t", 1, 1) and not w.is_duplicate("t", 2, 0)
    assert w.in_flight("t", 1) and w.held() == {"t"}
    assert w.settled("t", 1) is None  # no hand-back waited for it
    assert not w.in_flight("t", 1) and w.held() == set()
    assert w.is_duplicate("t", 1, 0)  # still one write per part, ever, while the lease lives
    w.prune(lambda _t, _g: False)
    assert not w.accepted


def test_a_hand_back_under_a_write_waits_for_it_then_releases() -> None:
    w = PushWrites()
    assert not w.hand_back("t", 1, "gave up")  # nothing in flight: release now
    w.accept("t", 1, 0)
    assert w.hand_back("t", 1, "gave up")  # in flight: answer WRITE_IN_FLIGHT, release later
    assert is_write_in_flight(WRITE_IN_FLIGHT) and not is_write_in_flight("lease is gone")
    assert "handed the lease back" in w.must_stop("t", 1, Lease(1, 100.0), now=1.0)  # cancel the write
    assert w.settled("t", 1) == "gave up"  # the last write settled: release the lease now
    assert w.must_stop("t", 1, Lease(1, 100.0), now=1.0) == ""


@pytest.mark.parametrize(("lease", "now", "why"), [
    (None, 1.0, "the lease ended"),
    (Lease(2, 100.0), 1.0, "the lease ended"),  # another generation: this write's lease is gone
    (Lease(1, 5.0), 5.0, "the lease expired"),
    (Lease(1, 5.0), 4.9, ""),
])
def test_no_write_outlives_its_lease(lease: Lease | None, now: float, why: str) -> None:
    w = PushWrites()
    w.accept("t", 1, 0)
    assert w.must_stop("t", 1, lease, now) == why


def test_a_read_is_trusted_until_its_last_acknowledged_renewal_plus_most_of_the_ttl() -> None:
    r = RenewalClock()
    assert not r.outlived(1e9)  # nothing claimed yet: no bound
    r.acknowledged(0, 10.0, 30.0)
    r.acknowledged(1, 12.0, 30.0)
    assert r.deadline() == pytest.approx(10.0 + 30.0 * READ_DEADLINE_FRACTION)  # the oldest part bounds the load
    r.acknowledged(0, 9.0, 30.0)  # an older renewal answered late moves nothing
    assert r.deadline() == pytest.approx(10.0 + 30.0 * READ_DEADLINE_FRACTION)
    r.acknowledged(0, 20.0, 30.0)
    assert r.deadline() == pytest.approx(12.0 + 30.0 * READ_DEADLINE_FRACTION)
    assert not r.outlived(12.0 + 26.9) and r.outlived(12.0 + 27.0)
    assert READ_DEADLINE_FRACTION < 1.0  # strictly before P's expiry, which follows D's send


def test_d_decisions_leave_a_push_to_ps_word_and_fail_a_pull_at_once() -> None:
    from kvlifecycle.protocol.consumer import (
        hand_back_settles,
        on_load_timeout,
        on_push_unanswered,
        on_renewal_refused,
    )

    assert on_push_unanswered() == "give_up"  # P may have accepted it: its write may be landing
    assert on_load_timeout("push") == "give_up" and on_load_timeout("pull") == "fail"  # D cancels its own reads
    assert on_renewal_refused("push", WRITE_IN_FLIGHT) == "give_up"
    assert on_renewal_refused("push", "lease is gone") == "drain_then_fail"  # its done may be waiting
    assert on_renewal_refused("pull", "lease is gone") == "fail"
    assert hand_back_settles(True, "") and hand_back_settles(False, "stale token")
    assert not hand_back_settles(False, WRITE_IN_FLIGHT)


def test_a_load_counts_each_part_once_and_settles_with_the_last() -> None:
    load = LoadProgress(size=2)
    assert load.part_done(1) and not load.complete
    assert not load.part_done(1)  # a duplicate completion is no progress
    assert load.part_done(0) and load.complete


def test_a_failure_waits_for_sibling_reads_in_flight_and_keeps_its_first_reason() -> None:
    load = LoadProgress(size=2)
    assert load.pending_failure() == ""
    assert load.failure("part 0 failed", reads_in_flight=1, wait_siblings=True) is None  # the sibling may land
    assert load.failing == "part 0 failed" and load.pending_failure() == "part 0 failed"
    assert load.failure("lease lost", reads_in_flight=1, wait_siblings=True) is None
    assert load.failure("lease lost", reads_in_flight=0, wait_siblings=True) == "part 0 failed"  # settled now
    timed_out = LoadProgress(size=2)
    assert timed_out.failure("read outlived", reads_in_flight=1, wait_siblings=False) == "read outlived"
    restarted = LoadProgress(size=1, failed=True)
    assert restarted.pending_failure() == PEER_RESTARTED


def test_a_load_starts_once_every_lease_is_claimed_and_times_out_unless_handed_back() -> None:
    load = LoadProgress(size=2)
    assert not load.claim_acknowledged(0, sent_at=1.0, ttl_s=10.0, answered_at=1.1)
    assert load.claim_acknowledged(1, sent_at=2.0, ttl_s=10.0, answered_at=2.5) and load.claimed == 2
    assert load.renewals.deadline() == pytest.approx(1.0 + 10.0 * READ_DEADLINE_FRACTION)  # the oldest claim bounds
    # a push's writes: the latest claim answer bounds them (P accepted it before answering)
    assert load.writes.deadline() == pytest.approx(2.5 + 10.0 / READ_DEADLINE_FRACTION + STREAM_SETTLE_S)
    assert not load.times_out(5.0, timeout_s=5.0) and load.times_out(5.1, timeout_s=5.0)
    load.given_up = "push request failed: timed out"  # P's word settles it now, not the timeout
    assert not load.times_out(5.1, timeout_s=5.0)
