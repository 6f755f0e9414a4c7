"""A load from its grants to its start, owned by the Consumer (the engine only names P's request and P's ranks):
announced grants renewed from the service thread until the load, every rank's grant fetched before any
handshake, the grant-count check, a load that cannot start failed in the ledger and handed back, a skip released
now, and invalidate_peer telling the streams. A real Producer and its side channel, the loopback transport."""

from __future__ import annotations

import time

import msgspec
import pytest

pytest.importorskip("torch")

import test_handoff_unclaimed as unclaimed
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.handoff import Consumer
from kvlifecycle.machines import TargetState
from kvlifecycle.protocol.launch import CLAIM_PAST_BOUND, NOT_RESERVED, LaunchStep, LoadLaunch

pd = unclaimed.pd  # the fixture: a Producer and a Consumer not connected yet
grant, releases = unclaimed.grant, unclaimed.releases


def renewals(plog: list[ev.Event], transfer: str) -> int:
    """Keepalives (no agent, no claim) P took for ``transfer``."""
    return sum(1 for e in plog if isinstance(e, ev.SrcLeaseRenewed) and e.transfer == transfer and e.peer == "")


def failures(dlog: list[ev.Event]) -> list[str]:
    return [e.reason for e in dlog if isinstance(e, ev.TgtLoadFailed)]


def test_an_announced_grant_is_renewed_until_its_load_starts_and_the_load_completes(pd) -> None:
    prod, cons, plog, _ = pd
    prod.ledger.allocate("p-req", [1, 2])
    prod.ledger.prefill_done("p-req")
    g = prod.grant("p-req", ttl_s=0.6)  # renewed every 0.1 s while D reserves
    assert cons.announce("d-req", "p-req", [prod.address]) == 1
    assert until(lambda: renewals(plog, g.transfer) >= 2)  # from the service thread: nobody else calls
    cons.ledger.reserve("d-req", [5, 6])
    transfer = cons.load("d-req", "p-req", [prod.address])
    assert transfer == g.transfer
    assert cons.wait_idle(10)
    assert cons.ledger.requests["d-req"].state == TargetState.READY_FOR_ATTENTION
    assert failures(pd[3]) == []


def test_a_grant_counted_for_another_d_tp_size_fails_the_load_before_it_starts(pd) -> None:
    load_of_a_lease_counted_for_two(pd)


@pytest.mark.mutants
def test_mutant_without_the_grant_count_check_is_caught(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the check, D reads a lease P counts for two consumers as its only one: caught above."""
    monkeypatch.setattr(Consumer, "_check_grant_count", staticmethod(lambda link, remote, grant: None))
    with pytest.raises(AssertionError):
        load_of_a_lease_counted_for_two(pd)
    assert pd[1].wait_idle(10)


def load_of_a_lease_counted_for_two(pd) -> None:
    prod, cons, _, dlog = pd
    grant(prod, "p-two", [3], consumers=2)  # P counts two D ranks; this D reads with one
    cons.ledger.reserve("d-two", [0])
    assert cons.load("d-two", "p-two", [prod.address]) is None
    [reason] = failures(dlog)
    assert reason.startswith("GrantCountError") and "2 consumer(s)" in reason
    assert "d-two" not in cons.ledger.requests  # policy "fail": the reservation went back
    assert not [e for e in dlog if isinstance(e, ev.TgtPartDone)]  # nothing was read


def test_a_grant_p_never_published_fails_the_load_in_the_ledger(pd) -> None:
    _, cons, _, dlog = pd
    cons.ledger.reserve("d-none", [1])
    assert cons.load("d-none", "never-granted", [pd[0].address]) is None
    assert [e.transfer for e in dlog if isinstance(e, ev.TgtLoadFailed)] == ["d-none/refused-by-d"]
    assert "unknown_request" in failures(dlog)[0]


def test_a_refused_handshake_hands_every_fetched_grant_back(pd) -> None:
    prod, cons, plog, dlog = pd
    grant(prod, "p-ok", [4])
    cons.compat = msgspec.structs.replace(cons.compat, model_id="another")  # P refuses the handshake
    cons.ledger.reserve("d-ok", [2])
    assert cons.load("d-ok", "p-ok", [prod.address]) is None
    [reason] = failures(dlog)
    assert reason.startswith("CompatMismatchError")
    assert until(lambda: len(releases(plog)) == 1) and releases(plog)[0][0] == "failed"


def test_skip_releases_p_now(pd) -> None:
    prod, cons, plog, _ = pd
    grant(prod, "p-skip", [5])
    cons.skip("d-skip", "p-skip", [prod.address])
    assert releases(plog) == [("failed", "consumer: not needed by D")]


def test_invalidate_peer_tells_every_peer_lost_sink(pd) -> None:
    _, cons, _, _ = pd
    told: list[tuple[str, int, str]] = []
    cons.peer_lost_sinks.append(lambda agent, epoch, reason, _may_write: told.append((agent, epoch, reason)))
    cons.invalidate_peer("p-agent", 3, "etcd lease expired")
    assert told == [("p-agent", 3, "etcd lease expired")]


def claim_answered_late(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim's answer reaches D past the read bound of the lease it claims (D's clock jumps by the TTL while
    the answer is on its way): the load is abandoned, nothing is read, and the lease goes back to P at once."""
    prod, cons, plog, dlog = pd
    offset = [0.0]
    monkeypatch.setattr(cons, "_now", lambda: time.monotonic() + offset[0])
    answered = cons._claim_answered

    def late(load, part, beat, sent) -> None:
        offset[0] += 30.0  # the grant's TTL (the fixture's default_ttl_s): the bound is 0.9 of it after the send
        answered(load, part, beat, sent)

    monkeypatch.setattr(cons, "_claim_answered", late)
    g = grant(prod, "p-late", [2, 3])
    cons.ledger.reserve("d-late", [4, 5])
    cons.load("d-late", "p-late", [prod.address])
    assert cons.wait_idle(10)
    assert cons.abandoned["d-late"].startswith(CLAIM_PAST_BOUND)
    assert not [e for e in dlog if isinstance(e, ev.TgtPartDone)]  # no read was posted
    assert "d-late" not in cons.ledger.requests  # policy "fail": the reservation went back
    assert until(lambda: g.transfer not in prod.ledger.leases)  # handed back, not left to expire
    assert any(CLAIM_PAST_BOUND in detail for _, detail in releases(plog)), releases(plog)


def test_a_claim_answered_past_its_read_bound_posts_no_read(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    claim_answered_late(pd, monkeypatch)


@pytest.mark.mutants
def test_mutant_posting_a_read_after_a_late_claim_is_caught(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that ignores when the claim's answer came posts a read whose lease may already be gone at P."""
    def ignoring_now(self, part, *, ok, detail, sent_at, ttl_s, reserved, now):  # the launch before the check
        if not ok:
            return LaunchStep("abandon", reason=f"lease refused: {detail}")
        if not self.claim_acknowledged(part, sent_at, ttl_s, now):
            return LaunchStep("claim", self.claimed)
        return LaunchStep("start") if reserved else LaunchStep("abandon", reason=NOT_RESERVED)

    monkeypatch.setattr(LoadLaunch, "claim_answered", ignoring_now)
    with pytest.raises((AssertionError, KeyError)):
        claim_answered_late(pd, monkeypatch)
    assert pd[1].wait_idle(10)
