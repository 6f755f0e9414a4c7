"""The Consumer's calls before a claim, which an engine makes instead of speaking to P's side channel itself: fetch a
grant P publishes late, keep its lease alive, hand it back, fail a load that never started. One process, a real
Producer and its zmq side channel, the loopback transport; every wait bounded, no assertion on a duration."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.handoff import (
    REPLY_TYPES,
    Consumer,
    HandoffOptions,
    Heartbeat,
    Producer,
    SideChannelError,
    SideChannelRefused,
)
from kvlifecycle.handoff.unclaimed_grants import REASON_CHARS
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_merged, check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sidechannel import SideChannelClient, SideChannelServer
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, BYTES = 8, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


@pytest.fixture
def pd(request: pytest.FixtureRequest):
    """A Producer and a Consumer that has not connected to it (nothing before the claim needs the handshake)."""
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    kv = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(2)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for transport, tensor in ((tp, kv[0]), (td, kv[1])):
        transport.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (tensor.data_ptr(),), (BYTES,)))
    plog: list[ev.Event] = []
    dlog: list[ev.Event] = []
    source = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    target = TargetLedger(BLOCKS, worker="d")
    source.listeners.append(plog.append)
    target.listeners.append(dlog.append)
    prod = Producer(source, tp, COMPAT)
    cons = Consumer(target, td, COMPAT, options=HandoffOptions(request_timeout_s=2.0, heartbeat_every_s=0.01))
    yield prod, cons, plog, dlog
    cons.close()
    prod.close()
    tp.close()
    td.close()
    assert check_source(source) == [] and check_target(target) == []
    assert check_merged(plog, dlog) == []


def grant(prod: Producer, request: str, blocks: list[int], consumers: int = 1):
    prod.ledger.allocate(request, blocks)
    prod.ledger.prefill_done(request)
    return prod.grant(request, consumers=consumers)


def releases(plog: list[ev.Event]) -> list[tuple[str, str]]:
    return [(e.reason, e.detail) for e in plog if isinstance(e, ev.SrcLeaseReleased)]


def test_a_grant_published_after_d_asks_is_fetched_within_the_wait(pd) -> None:
    prod, cons, _, _ = pd
    with pytest.raises(SideChannelRefused) as info:
        cons.fetch_grant(prod.address, "late")  # no wait: P's refusal reaches the caller
    assert info.value.code == "unknown_request"
    asked_again = threading.Event()
    prod.server.add_refusal_listener(lambda code: asked_again.set() if code == "unknown_request" else None)
    got: list[object] = []
    fetch = threading.Thread(target=lambda: got.append(cons.fetch_grant(prod.address, "late", wait_s=30.0)))
    fetch.start()
    assert asked_again.wait(10)  # D asked while nothing was published: it keeps asking
    published = grant(prod, "late", [2, 3])
    fetch.join(30)
    assert got == [published]


def test_keep_alive_renews_a_lease_nobody_claimed_and_says_when_it_is_gone(pd) -> None:
    prod, cons, plog, _ = pd
    g = grant(prod, "held", [1])
    before = prod.ledger.leases[g.transfer].expires_at
    ack = cons.keep_alive(prod.address, g)
    assert ack.ok
    [renewed] = [e for e in plog if isinstance(e, ev.SrcLeaseRenewed)]
    assert renewed.expires_at >= before and renewed.peer == ""  # no agent: a keepalive, not a claim
    assert prod.ledger.fail(g.transfer, g.generation, "P gave up")
    gone = cons.keep_alive(prod.address, g)
    assert not gone.ok and "gone" in gone.detail


def test_keep_alive_of_a_claimed_lease_is_refused(pd) -> None:
    """Once a load claimed the lease, only its token renews it: a token-less keepalive changes nothing."""
    prod, cons, plog, _ = pd
    g = grant(prod, "claimed", [4])
    reader = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=5.0)
    try:
        assert reader.request(Heartbeat(g.transfer, g.generation, "another-d", consumer=0)).ok  # a load's claim
    finally:
        reader.close()
    renewals = sum(isinstance(e, ev.SrcLeaseRenewed) for e in plog)
    refused = cons.keep_alive(prod.address, g)
    assert not refused.ok and "the lease is claimed" in refused.detail
    assert sum(isinstance(e, ev.SrcLeaseRenewed) for e in plog) == renewals
    assert prod.ledger.fail(g.transfer, g.generation, "test over")


def test_hand_back_releases_the_lease_now_with_the_reason_cut(pd) -> None:
    prod, cons, plog, _ = pd
    g = grant(prod, "unneeded", [6, 7])
    cons.hand_back([(prod.address, g)], "not needed by D " + "x" * 1000, consumer=0)
    assert g.transfer not in prod.ledger.leases
    [(reason, detail)] = releases(plog)
    assert reason == "failed" and detail == "consumer: " + ("not needed by D " + "x" * 1000)[:REASON_CHARS]


def test_hand_back_of_one_consumer_of_two_waits_for_its_sibling(pd) -> None:
    """P TP 1 -> D TP 2: the lease is read by two D ranks; one handing back must not free blocks the other reads."""
    prod, cons, plog, _ = pd
    g = grant(prod, "shared", [1, 2], consumers=2)
    cons.hand_back([(prod.address, g)], "not needed by D", consumer=1)
    assert g.transfer in prod.ledger.leases  # consumer 0 has not settled
    assert prod.ledger.consumer_done(g.transfer, g.generation, 0)
    assert until(lambda: g.transfer not in prod.ledger.leases)
    assert [reason for reason, _ in releases(plog)] == ["failed"]


def test_hand_back_to_a_silent_p_is_logged_not_raised(pd) -> None:
    prod, cons, _, _ = pd
    g = grant(prod, "orphan", [0])
    silent = SideChannelServer({})
    address = silent.address
    silent.close()  # nothing answers there any more
    cons.hand_back([(address, g)], "not needed by D", consumer=0)  # returns after its bounded wait
    assert g.transfer in prod.ledger.leases  # left to expire
    with pytest.raises(SideChannelError):
        cons.keep_alive(address, g, timeout_s=0.2)
    prod.ledger.cancel("orphan")


def test_fail_unstarted_records_a_load_of_ds_own_id_and_releases_p(pd) -> None:
    prod, cons, plog, dlog = pd
    g = grant(prod, "p-req", [3])
    cons.ledger.reserve("d-req", [0])
    cons.fail_unstarted("d-req", [(prod.address, g)], "handshake refused", consumer=0)
    started = [e for e in dlog if isinstance(e, ev.TgtLoadStarted)]
    failed = [e for e in dlog if isinstance(e, ev.TgtLoadFailed)]
    assert [(e.request, e.transfer, e.generation) for e in started] == [("d-req", f"{g.transfer}/refused-by-d",
                                                                          g.generation)]
    assert [(e.transfer, e.reason) for e in failed] == [(f"{g.transfer}/refused-by-d", "handshake refused")]
    assert "d-req" not in cons.ledger.requests  # policy "fail": the reservation went back
    assert releases(plog) == [("failed", "consumer: handshake refused")]


def test_fail_unstarted_without_a_grant_names_the_load_after_the_request(pd) -> None:
    _, cons, _, dlog = pd
    cons.ledger.reserve("no-grant", [1, 2])
    cons.fail_unstarted("no-grant", [], "no grant from P", consumer=0)
    assert [e.transfer for e in dlog if isinstance(e, ev.TgtLoadFailed)] == ["no-grant/refused-by-d"]
    assert cons.ledger.counts()["FREE"] == BLOCKS
