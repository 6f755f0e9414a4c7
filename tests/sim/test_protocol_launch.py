"""D's launch and service duties (``kvlifecycle.protocol.launch``), the decisions the Consumer and the simulated D
takes (the simulator runs the Consumer itself): claims in part order before the start, what a claim's answer means,
what a step owes a load first."""

from __future__ import annotations

from kvlifecycle.handoff import consumer
from kvlifecycle.protocol.launch import CLAIM_PAST_BOUND, NOT_RESERVED, LoadLaunch, beat_every


def test_the_consumers_loads_are_the_core_class() -> None:
    assert issubclass(consumer._Load, LoadLaunch)


def test_every_lease_is_claimed_in_order_before_the_start() -> None:
    load = LoadLaunch(size=2)
    assert load.begin(reserved=True).action == "claim" and load.begin(reserved=True).part == 0
    step = load.claim_answered(0, ok=True, detail="", sent_at=1.0, ttl_s=10.0, reserved=True, now=2.5)
    assert (step.action, step.part) == ("claim", 1) and not load.live
    assert load.claim_answered(1, ok=True, detail="", sent_at=2.0, ttl_s=10.0, reserved=True, now=2.5).action == "start"
    assert load.renewals.deadline() == 1.0 + 10.0 * 0.9  # the earliest claim bounds the reads


def test_a_refused_or_unanswered_claim_abandons_and_hands_back_what_was_claimed() -> None:
    load = LoadLaunch(size=3)
    load.claim_answered(0, ok=True, detail="", sent_at=0.0, ttl_s=5.0, reserved=True, now=2.5)
    step = load.claim_answered(1, ok=False, detail="gone", sent_at=0.0, ttl_s=5.0, reserved=True, now=2.5)
    assert (step.action, step.reason) == ("abandon", "lease refused: gone")
    assert list(load.hand_back_parts()) == [0] and list(load.hand_back_parts(every_lease=True)) == [0, 1, 2]
    assert load.claim_unanswered("timed out").reason == "claim failed: timed out"


def test_a_claim_answered_past_its_read_bound_abandons_and_hands_its_lease_back() -> None:
    load = LoadLaunch(size=2)
    load.claim_answered(0, ok=True, detail="", sent_at=0.0, ttl_s=10.0, reserved=True, now=1.0)
    step = load.claim_answered(1, ok=True, detail="", sent_at=8.0, ttl_s=10.0, reserved=True, now=9.0)
    assert step.action == "abandon" and step.reason.startswith(CLAIM_PAST_BOUND)  # part 0's bound was 9.0
    assert list(load.hand_back_parts()) == [0, 1] and not load.live
    late = LoadLaunch(size=1)
    assert late.claim_answered(0, ok=True, detail="", sent_at=0.0, ttl_s=10.0, reserved=True, now=8.99).action \
        == "start"
    late = LoadLaunch(size=1)
    assert late.claim_answered(0, ok=True, detail="", sent_at=0.0, ttl_s=10.0, reserved=True, now=9.0).action \
        == "abandon"


def test_a_reservation_gone_while_claiming_abandons() -> None:
    load = LoadLaunch(size=1)
    assert load.begin(reserved=False).reason == NOT_RESERVED
    step = load.claim_answered(0, ok=True, detail="", sent_at=0.0, ttl_s=5.0, reserved=False, now=0.5)
    assert (step.action, step.reason) == ("abandon", NOT_RESERVED)


def test_a_step_cancels_a_read_past_its_lease_before_anything_else() -> None:
    load = LoadLaunch(size=2, live=True, started=0.0)
    load.renewals.acknowledged(0, 0.0, 10.0)
    load.failing = "part 1 failed"
    assert load.duty(5.0, reading=True, timeout_s=60.0).action == "fail"  # waits for its sibling's read
    assert load.duty(5.0, reading=True, timeout_s=60.0).wait_siblings
    duty = load.duty(9.5, reading=True, timeout_s=60.0)
    assert (duty.action, duty.wait_siblings) == ("cancel_reads", False)
    assert duty.reason == "part 1 failed: read cancelled at its lease's bound"
    assert not load.duty(61.0, reading=False, timeout_s=60.0).wait_siblings  # past the load timeout: fail now
    assert LoadLaunch(size=1).duty(0.0, reading=False, timeout_s=1.0).action == "idle"


def test_the_timeout_and_the_heartbeat() -> None:
    load = LoadLaunch(size=1, live=True, started=0.0, last_beat=0.0)
    assert load.duty(1.0, reading=True, timeout_s=60.0).action == "poll"
    assert load.after_poll(1.0, 60.0) == "heartbeat" and load.after_poll(61.0, 60.0) == "timeout"
    assert load.beat(0.5, 1.0) == "wait" and load.beat(1.0, 1.0) == "renew" and load.last_beat == 1.0
    load.given_up = "push request failed"
    assert load.after_poll(61.0, 60.0) == "heartbeat"  # a handed-back push waits for P's word, not the timeout
    assert load.beat(2.0, 1.0) == "hand_back"
    assert beat_every(30.0) == 5.0 and beat_every(30.0, 2.0) == 2.0
