"""D never frees blocks a write of P may still land in, though it cannot see that write. When the control plane
declares a live P lost (docs/design.md, "A P declared lost may still write"): P's etcd lease lapsed while it was
cut off from etcd only, so P runs on and its push into D's blocks is still in flight. D cannot stop that write;
``invalidate_peer`` keeps the load's blocks LOADING until the bound D takes from what it sent (``WriteBound``), and
P, which refuses any renewal held back past its transit bound, has cancelled the write at its lease's end by then.
When a PushRequest's answer never came: D hands the lease back and keeps the blocks LOADING until P's word
(``WRITE_IN_FLIGHT``, then the cancelled write's ``failed`` note) settles the load. Real Producer and Consumer
threads over the loopback transport, P's write held in flight until P cancels it; all times are ``time.monotonic``
of this process (the ledgers' clocks). The mutant tests put back what this guards against and expect the failure.
Every wait is bounded; nothing asserts on how long anything took."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest
from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.clock import ManualClock
from kvlifecycle.control import Claimed, Heartbeat, PushRequest
from kvlifecycle.handoff import REPLY_TYPES, Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.protocol import RENEWAL_TOO_LATE, WriteBound, renewal_too_late
from kvlifecycle.protocol.bounds import READ_DEADLINE_FRACTION, RENEWAL_TRANSIT_FRACTION, STREAM_SETTLE_S
from kvlifecycle.sidechannel import Ack, SideChannelClient
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, REGIONS, BYTES = 8, 2, 64
TTL_S = 0.6
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
_names = itertools.count()


class CancelTimed(Gated):
    """P's transport: its writes stay in flight (no byte moves) until P releases them, which cancels them; when."""

    def __init__(self, inner: LoopbackTransport) -> None:
        super().__init__(inner)
        self.cancelled_at: list[float] = []

    def release(self, handle) -> None:
        if handle.id in self.pending:
            self.cancelled_at.append(time.monotonic())
        super().release(handle)


@dataclass
class Pair:
    prod: Producer
    cons: Consumer
    writes: CancelTimed
    plog: list = field(default_factory=list)
    dlog: list = field(default_factory=list)
    closers: list = field(default_factory=list)


@pytest.fixture
def pair() -> Iterator[Pair]:
    yield from _pair(request_timeout_s=2.0)


def _pair(*, request_timeout_s: float) -> Iterator[Pair]:
    n = next(_names)
    memory = [np.zeros((BLOCKS, BYTES), dtype=np.uint8) for _ in range(2 * REGIONS)]
    transports = []
    for side, regions in (("p", memory[:REGIONS]), ("d", memory[REGIONS:])):
        t = LoopbackTransport(f"{side}-lost-writer-{n}")
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(r.ctypes.data for r in regions), (BYTES,) * REGIONS))
        transports.append(t)
    writes = CancelTimed(transports[0])
    prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=TTL_S), writes, COMPAT)
    cons = Consumer(TargetLedger(BLOCKS, worker="d"), transports[1], COMPAT,
                    options=HandoffOptions(probe=False, load_timeout_s=30.0, request_timeout_s=request_timeout_s))
    p = Pair(prod, cons, writes)
    prod.ledger.listeners.append(p.plog.append)
    cons.ledger.listeners.append(p.dlog.append)
    yield p
    cons.close()
    prod.close()
    for t in transports:
        t.close()
    memory.clear()


def _lost_while_writing(p: Pair) -> tuple[float, float]:
    """D asks P to push, P's write stays in flight, and D's control plane declares P lost (P runs on). Returns when
    P cancelled its write and when D recorded the load's failure; asserts the blocks stayed LOADING meanwhile."""
    p.prod.ledger.allocate("r", [0, 1])
    p.prod.ledger.prefill_done("r")
    grant = p.prod.grant("r")
    p.cons.ledger.reserve("r", [0, 1])
    link = p.cons.connect(p.prod.address)
    p.cons.request_push("r", grant, address=p.prod.address)
    assert until(lambda: len(p.writes.pending) == 1, timeout_s=5.0), "P never posted its write"
    assert until(lambda: any(isinstance(e, ev.SrcLeaseRenewed) for e in list(p.plog)), timeout_s=5.0)
    assert p.cons.invalidate_peer(link.agent, link.epoch, "membership: lease lapsed") == [grant.transfer]
    # P is alive and its write may land: D keeps the blocks LOADING, neither freed nor given to a recompute
    held = p.cons.ledger.requests.get("r")
    assert held is not None and held.state == TargetState.LOADING, "D freed blocks a live P still writes"
    assert until(lambda: any(isinstance(e, ev.TgtLoadFailed) for e in list(p.dlog)), timeout_s=10 * TTL_S)
    failed_at = next(e.at for e in list(p.dlog) if isinstance(e, ev.TgtLoadFailed))
    assert until(lambda: p.writes.cancelled_at, timeout_s=10 * TTL_S), "P never cancelled its write"
    return p.writes.cancelled_at[0], failed_at


def test_d_keeps_a_lost_writers_blocks_loading_until_p_cancelled_its_write_at_lease_end(pair: Pair) -> None:
    cancelled_at, failed_at = _lost_while_writing(pair)
    assert cancelled_at < failed_at, f"D failed the load {cancelled_at - failed_at:+.4f} s before P's cancel"
    print(f"TTL {TTL_S} s: D failed the load {failed_at - cancelled_at:.3f} s after P cancelled its write")  # -s
    expired = [e for e in pair.plog if isinstance(e, ev.SrcLeaseReleased)]
    assert expired and expired[0].at <= failed_at  # P's lease ended (its write settled) before D let go
    assert "r" not in pair.cons.ledger.requests or pair.cons.ledger.requests["r"].state != TargetState.LOADING
    assert pair.cons.pending() == 0


@pytest.mark.mutants
def test_mutant_a_lost_p_taken_for_dead_frees_blocks_under_its_write(pair: Pair,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WriteBound, "deadline", lambda self: -math.inf)
    with pytest.raises(AssertionError, match="D freed blocks a live P still writes"):
        _lost_while_writing(pair)


# -- a push whose answer never came: P may have accepted it ------------------------------------------------------
UNANSWERED_TIMEOUT_S = 0.5  # D's wait for the PushRequest's answer; P answers only after it


@pytest.fixture
def unanswered() -> Iterator[Pair]:
    for p in _pair(request_timeout_s=UNANSWERED_TIMEOUT_S):
        p.prod.server.handlers = {**p.prod.server.handlers,
                                  PushRequest: _answered_late(p.prod.server.handlers[PushRequest])}
        yield p


def _answered_late(served):
    def accepted_then_silent(msg: PushRequest, peer: bytes):  # the write is queued; the answer comes too late
        answer = served(msg, peer)
        time.sleep(2 * UNANSWERED_TIMEOUT_S)
        return answer

    return accepted_then_silent


def _push_unanswered(p: Pair) -> tuple[float, float]:
    """D's PushRequest is accepted and its write held in flight, but its answer reaches D only after D stopped
    waiting. Returns when P cancelled its write and when D recorded the load's failure."""
    p.prod.ledger.allocate("r", [0, 1])
    p.prod.ledger.prefill_done("r")
    grant = p.prod.grant("r")
    p.cons.ledger.reserve("r", [0, 1])
    p.cons.connect(p.prod.address)
    p.cons.request_push("r", grant, address=p.prod.address)
    assert until(lambda: any(isinstance(e, ev.TgtLoadFailed) for e in list(p.dlog)), timeout_s=10 * TTL_S)
    failed_at = next(e.at for e in list(p.dlog) if isinstance(e, ev.TgtLoadFailed))
    assert p.writes.cancelled_at, "D failed the load while P's write was still in flight"
    return p.writes.cancelled_at[0], failed_at


def test_an_unanswered_push_is_handed_back_and_its_blocks_stay_loading_until_p_cancelled(unanswered: Pair) -> None:
    cancelled_at, failed_at = _push_unanswered(unanswered)
    assert cancelled_at < failed_at


@pytest.mark.mutants
def test_mutant_a_push_timeout_failing_the_load_frees_blocks_under_the_write(
        unanswered: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    import kvlifecycle.protocol.consumer as rules

    monkeypatch.setattr(rules, "on_push_unanswered", lambda: "fail")
    with pytest.raises(AssertionError, match="still in flight"):
        _push_unanswered(unanswered)


# -- P refuses a renewal held back past its transit bound ----------------------------------------------------------
@pytest.fixture
def manual_p() -> Iterator[tuple[Producer, ManualClock]]:
    clock = ManualClock(100.0)
    t = LoopbackTransport(f"p-manual-{next(_names)}")
    kv = [np.zeros((BLOCKS, BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(r.ctypes.data for r in kv), (BYTES,) * REGIONS))
    prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=2.0, clock=clock), t, COMPAT)
    yield prod, clock
    prod.close()
    t.close()


def test_p_renews_on_a_timely_renewal_and_refuses_one_held_back_past_half_the_ttl(
        manual_p: tuple[Producer, ManualClock]) -> None:
    _renewals_against_the_transit_bound(*manual_p)


@pytest.mark.mutants
def test_mutant_p_renewing_on_a_late_renewal_lets_a_lease_outlive_ds_write_bound(
        manual_p: tuple[Producer, ManualClock], monkeypatch: pytest.MonkeyPatch) -> None:
    """(The simulation reaches late renewals of a lost writer's lease, ``late_renewal``, but rarely while the write
    still runs: this test is the mutant's catch.)"""
    import kvlifecycle.handoff.producer as producer

    monkeypatch.setattr(producer, "renewal_too_late", lambda *args: False)
    with pytest.raises(AssertionError):
        _renewals_against_the_transit_bound(*manual_p)


def _renewals_against_the_transit_bound(prod: Producer, clock: ManualClock) -> None:
    recorded: list = []
    prod.ledger.listeners.append(recorded.append)
    prod.ledger.allocate("r", [0, 1])
    prod.ledger.prefill_done("r")
    grant = prod.grant("r")
    client = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=2.0)
    try:
        claimed = client.request(Heartbeat(grant.transfer, grant.generation, "d"))
        assert isinstance(claimed, Claimed) and claimed.ok

        def renew(since_claim: float) -> Ack:
            return client.request(Heartbeat(grant.transfer, grant.generation, "d", token=claimed.token,
                                            since_claim=since_claim))

        clock.advance(1.5)  # built 0.1 s after the claim was sent, it reached P 1.4 s late: past TTL/2 = 1.0 s
        expires = prod.ledger.leases[grant.transfer].expires_at
        late = renew(0.1)
        assert not late.ok and late.detail == RENEWAL_TOO_LATE
        assert prod.ledger.leases[grant.transfer].expires_at == expires  # it renewed nothing
        for hostile in (math.nan, math.inf):
            assert renew(hostile).detail == RENEWAL_TOO_LATE
        assert renew(1.4).ok  # built 1.4 s after the claim: on time
        assert prod.ledger.leases[grant.transfer].expires_at == pytest.approx(clock.now() + 2.0)
        assert renew(-1.0).ok  # an older D sends none: unchecked, as before
        clock.advance(1.5)
        push = client.request(PushRequest(grant.transfer, grant.generation, "d", 0, [0, 1], "r", 0, claimed.token,
                                          0.2))
        assert not push.ok and push.detail == RENEWAL_TOO_LATE  # a push request is held to the same bound
        refused = [e for e in recorded if isinstance(e, ev.Refused) and RENEWAL_TOO_LATE in e.reason]
        assert {e.command for e in refused} == {"heartbeat", "push"}
    finally:
        client.close()


def test_the_transit_bound_and_the_write_bound_agree() -> None:
    ttl = 2.0
    assert not renewal_too_late(10.0, claimed_at=5.0, since_claim=4.5, ttl_s=ttl)
    assert renewal_too_late(10.0, claimed_at=5.0, since_claim=5.0 - ttl * RENEWAL_TRANSIT_FRACTION - 0.01, ttl_s=ttl)
    assert not renewal_too_late(10.0, claimed_at=5.0, since_claim=-1.0, ttl_s=ttl)
    bound = WriteBound()
    assert bound.deadline() == -math.inf  # nothing claimed: no write was asked for
    bound.claimed(0, sent_at=1.0, answered_at=1.2, ttl_s=ttl)
    assert bound.deadline() == pytest.approx(1.2 + ttl / READ_DEADLINE_FRACTION + STREAM_SETTLE_S)
    assert bound.since_claim(0, now=3.0) == pytest.approx(2.0)
    # the renewal built at 3.0 reached P by 3.0 + the claim's round trip + the transit bound at the latest
    latest = 3.0 + 0.2 + ttl * RENEWAL_TRANSIT_FRACTION
    assert bound.deadline() == pytest.approx(latest + ttl / READ_DEADLINE_FRACTION + STREAM_SETTLE_S)
    assert bound.since_claim(1, now=3.0) == -1.0  # a part not claimed yet carries none
