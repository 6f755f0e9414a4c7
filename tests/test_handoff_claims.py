"""Claim tokens: without a side-channel secret, only the consumer that claimed a lease can renew, fail, push into
or complete it. A rogue local process that knows the transfer id (it can ask P for the grant) is refused, its
attempt is recorded as the ledger's refusal, and the claimant's own messages still work."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.handoff import REPLY_TYPES, Claimed, GetGrant, Heartbeat, LoadFailed, Producer, PushRequest
from kvlifecycle.handshake import CompatInfo, GetMeta
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.sidechannel import Ack, SideChannelClient
from kvlifecycle.transport import KVLayout, MemoryKind, Notification

BLOCKS, BYTES = 8, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=16, block_size=1,
                    kv_layout="NHD")


@pytest.fixture
def p(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    kv = torch.zeros((BLOCKS, BYTES), dtype=torch.uint8)
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    dkv = torch.zeros((BLOCKS, BYTES), dtype=torch.uint8)
    for t, mem in ((tp, kv), (td, dkv)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (mem.data_ptr(),), (BYTES,)))
    td.add_peer(tp.local_metadata())
    prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0), tp, COMPAT)
    legit = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=5.0)
    rogue = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=5.0)
    yield prod, legit, rogue, td, (kv, dkv)
    legit.close()
    rogue.close()
    prod.close()
    tp.close()
    td.close()


def granted(prod: Producer, request: str, blocks: list[int], consumers: int = 1):
    prod.ledger.allocate(request, blocks)
    prod.ledger.prefill_done(request)
    return prod.grant(request, consumers=consumers)


def claim(client: SideChannelClient, g, consumer: int = 0, agent: str = "d") -> Claimed:
    return client.request(Heartbeat(g.transfer, g.generation, agent, consumer=consumer))


def refusals(prod: Producer, command: str) -> int:
    return prod.ledger.refusals.get(f"{command}: claim token", 0)


def test_a_claim_returns_a_fresh_token_per_claim(p) -> None:
    prod, legit, _, _, _ = p
    a, b = granted(prod, "a", [1]), granted(prod, "b", [2])
    ca, cb = claim(legit, a), claim(legit, b)
    assert ca.ok and cb.ok and len(ca.token) == len(cb.token) == TOKEN_BYTES and ca.token != cb.token


def test_spoofed_load_failed_cannot_release_a_claimed_lease(p) -> None:
    prod, legit, rogue, _, _ = p
    g = granted(prod, "victim", [1, 2])
    token = claim(legit, g).token
    seen = rogue.request(GetGrant("victim"))  # anyone who reaches the port learns the transfer id
    assert seen.transfer == g.transfer
    for forged in (b"", bytes(TOKEN_BYTES), token[:-1] + bytes([token[-1] ^ 1])):
        ack = rogue.request(LoadFailed(seen.transfer, seen.generation, "spoofed", token=forged))
        assert ack == Ack(False, ack.detail) and "claim token" in ack.detail
    assert g.transfer in prod.ledger.leases  # the lease survived every forgery
    assert refusals(prod, "fail") == 3  # each one recorded where the ledger records refusals
    # the claimant itself still can
    assert legit.request(LoadFailed(g.transfer, g.generation, "really failed", token=token)).ok
    assert g.transfer not in prod.ledger.leases
    assert [r.reason for r in prod.ledger.take_released()] == ["failed"]


def test_a_second_claim_and_a_tokenless_renewal_are_refused_once_claimed(p) -> None:
    prod, legit, rogue, _, _ = p
    g = granted(prod, "r", [3])
    token = claim(legit, g).token
    again = claim(rogue, g, agent="rogue")
    assert not again.ok and again.token == b"" and "claimed already" in again.detail
    keepalive = rogue.request(Heartbeat(g.transfer, g.generation))  # agent-less, token-less
    assert not keepalive.ok
    assert not rogue.request(Heartbeat(g.transfer, g.generation, "d", token=b"x" * TOKEN_BYTES)).ok
    assert claim(rogue, g, consumer=5, agent="rogue").ok is False  # no such consumer index
    assert refusals(prod, "heartbeat") == 4
    assert legit.request(Heartbeat(g.transfer, g.generation, "d", token=token)).ok  # the claimant renews


def test_spoofed_push_request_is_refused(p) -> None:
    prod, legit, rogue, td, _ = p
    g = granted(prod, "push", [4])
    claim(legit, g)
    legit.request(GetMeta(COMPAT, 0, td.agent, td.epoch, td.local_metadata()))  # D's handshake: push is possible
    ack = rogue.request(PushRequest(g.transfer, g.generation, td.agent, td.epoch, [0], "push", 0, b""))
    assert not ack.ok and "claim token" in ack.detail
    assert refusals(prod, "push") == 1
    assert g.transfer in prod.ledger.leases and prod._pushes == []  # nothing was written


def test_completion_notification_needs_the_claimants_token(p) -> None:
    prod, legit, _, td, _ = p
    g = granted(prod, "done", [5])
    token = claim(legit, g).token
    for payload in (b"", bytes(TOKEN_BYTES)):  # a forged completion over the data plane's notifications
        td.send_notification(prod.transport.agent, Notification("done", g.transfer, g.generation, payload=payload))
    assert until(lambda: refusals(prod, "consumer_done") == 2)
    assert g.transfer in prod.ledger.leases
    td.send_notification(prod.transport.agent, Notification("done", g.transfer, g.generation, payload=token))
    assert until(lambda: g.transfer not in prod.ledger.leases)
    assert [r.reason for r in prod.ledger.take_released()] == ["completed"]
    assert until(lambda: len(prod.claims) == 0)  # the ended lease's claim is forgotten


def test_each_consumer_index_has_its_own_token(p) -> None:
    """D TP > P TP: two D ranks read one lease; each completes only its own consumer index."""
    prod, legit, rogue, td, _ = p
    g = granted(prod, "two", [6], consumers=2)
    t0, t1 = claim(legit, g, 0).token, claim(rogue, g, 1, agent="d1").token
    td.send_notification(prod.transport.agent, Notification("two", g.transfer, g.generation, part=1, payload=t0))
    assert until(lambda: refusals(prod, "consumer_done") == 1)
    for part, token in ((0, t0), (1, t1)):
        td.send_notification(prod.transport.agent,
                             Notification("two", g.transfer, g.generation, part=part, payload=token))
    assert until(lambda: g.transfer not in prod.ledger.leases)
    assert [r.reason for r in prod.ledger.take_released()] == ["completed"]


def test_an_unclaimed_lease_can_still_be_kept_alive_and_handed_back_without_a_token(p) -> None:
    """The engine's path before any claim (a grant it holds while reserving, a load it never starts)."""
    prod, legit, _, _, _ = p
    g = granted(prod, "skip", [7])
    assert legit.request(Heartbeat(g.transfer, g.generation)).ok  # keepalive
    assert legit.request(LoadFailed(g.transfer, g.generation, "not needed by D")).ok
    assert g.transfer not in prod.ledger.leases
    assert refusals(prod, "fail") == 0 and refusals(prod, "heartbeat") == 0


def test_a_push_request_delivered_twice_writes_once(p) -> None:
    """A retried or duplicated PushRequest is acknowledged without a second WRITE: a second one would read the
    source blocks after the first completion freed them, or land in blocks D recomputed (found by the simulation,
    seeds 889 and 6542). Two consumers, so the lease outlives the first write and the duplicate meets it live."""
    prod, legit, _, td, (kv, dkv) = p
    kv[5].fill_(7)
    g = granted(prod, "twice", [5], consumers=2)
    token = claim(legit, g).token
    legit.request(GetMeta(COMPAT, 0, td.agent, td.epoch, td.local_metadata()))
    first = legit.request(PushRequest(g.transfer, g.generation, td.agent, td.epoch, [2], "twice", 0, token))
    assert first.ok
    assert until(lambda: prod.ledger.leases[g.transfer].done == {0})  # the write landed and counted
    assert int(dkv[2].sum()) == 7 * BYTES
    dkv[2].zero_()
    again = legit.request(PushRequest(g.transfer, g.generation, td.agent, td.epoch, [2], "twice", 0, token))
    assert again.ok and "duplicate" in again.detail
    assert prod._jobs.empty() and prod._pushes == []  # nothing queued or in flight for it
    assert int(dkv[2].sum()) == 0 and prod.ledger.leases[g.transfer].done == {0}


def test_a_keepalive_does_not_make_a_cancel_wait_for_a_reader_that_never_claimed(p) -> None:
    """A keepalive renews a lease D holds while it reserves its blocks; nobody reads yet, so P's cancel must free
    the pins at once instead of deferring them to the lease's end."""
    import kvlifecycle.events as ev

    prod, legit, _, _, _ = p
    seen: list[ev.Event] = []
    prod.ledger.listeners.append(seen.append)
    kept, claimed = granted(prod, "kept", [1, 2]), granted(prod, "claimed", [3])
    assert legit.request(Heartbeat(kept.transfer, kept.generation, "")).ok  # a keepalive: no agent, no token
    assert claim(legit, claimed).ok
    assert prod.ledger.cancel("kept") and prod.ledger.cancel("claimed")
    assert kept.transfer not in prod.ledger.leases  # released now
    assert claimed.transfer in prod.ledger.leases  # deferred: its claimant may be reading
    deferred = [e.transfer for e in seen if isinstance(e, ev.SrcCancelDeferred)]
    assert deferred == [claimed.transfer]
    renewals = {e.transfer: e.claims for e in seen if isinstance(e, ev.SrcLeaseRenewed)}
    assert renewals == {kept.transfer: False, claimed.transfer: True}


def test_a_grant_whose_lease_ended_is_refused_as_ended_not_as_unpublished(p) -> None:
    """A D that asks late for a grant (its lease expired before D saw the request) learns at once that it ended;
    ``unknown_request`` (publication may still come, so D keeps asking) is only for a grant never published."""
    from kvlifecycle.sidechannel import SideChannelRefused

    prod, legit, _, _, _ = p
    with pytest.raises(SideChannelRefused) as early:
        legit.request(GetGrant("late"))
    assert early.value.code == "unknown_request"
    g = granted(prod, "late", [3])
    assert legit.request(GetGrant("late")) == g
    assert prod.ledger.cancel("late")  # the lease ends (expiry ends it the same way)
    prod.ledger.free("late")
    assert prod.forget("late") == g  # what the engine does once a lease ended
    with pytest.raises(SideChannelRefused) as late:
        legit.request(GetGrant("late"))
    assert late.value.code == "grant_ended" and g.transfer in late.value.message
    assert granted(prod, "late", [4]) is not None  # the id granted again is published again
    assert legit.request(GetGrant("late")).block_ids == [4]
