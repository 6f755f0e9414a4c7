"""Consumer.invalidate_peer in one process over the loopback transport: what D does when the control plane says a P
is gone, and D's fence when its own etcd lease is found expired. (The same runs across hosts, driven by etcd, in
test_hosts.py.) Every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import etcd_harness as eh
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.transport import KVLayout, MemoryKind, Notification, XferStatus, encode_notification

BLOCKS, REGIONS, BYTES = 8, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


@dataclass
class Pair:
    prod: Producer
    cons: Consumer
    sl: SourceLedger
    tl: TargetLedger
    td: LoopbackTransport


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[Pair]:
    import torch

    kv = {side: [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)] for side in "pd"}
    tp, td = LoopbackTransport(f"p-inv-{time.monotonic_ns()}"), LoopbackTransport(f"d-inv-{time.monotonic_ns()}")
    for t, side in ((tp, "p"), (td, "d")):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv[side]), (BYTES,) * REGIONS))
    sl, tl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0), TargetLedger(BLOCKS, worker="d")
    prod = Producer(sl, tp, COMPAT)
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05))
    try:
        yield Pair(prod, cons, sl, tl, td)
    finally:
        cons.close()
        prod.close()
        tp.close()
        td.close()
    for lease in list(sl.leases.values()):  # P was never told of D's failed loads: end what is left
        sl.fail(lease.transfer, lease.generation, "test end")
    assert check_source(sl) == [] and check_target(tl) == []


def stall_reads(transport: LoopbackTransport, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads through ``transport`` never complete and never notify P (a loopback read is otherwise instant)."""
    post = transport.post
    monkeypatch.setattr(transport, "post", lambda *a, **kw: post(*a, **{**kw, "notification": None}))
    monkeypatch.setattr(transport, "poll", lambda _handle: XferStatus.PENDING)


def start_stuck_load(pair: Pair, monkeypatch: pytest.MonkeyPatch, request: str = "r") -> tuple[str, object]:
    """A pull claimed and posted whose read never completes."""
    stall_reads(pair.td, monkeypatch)
    pair.sl.allocate(request, [1, 2])
    pair.sl.prefill_done(request)
    grant = pair.prod.grant(request)
    pair.tl.reserve(request, [3, 4])
    transfer = pair.cons.pull(request, grant, address=pair.prod.address)
    deadline = time.monotonic() + 10
    while transfer not in pair.tl.loads and time.monotonic() < deadline:
        time.sleep(0.005)
    assert transfer in pair.tl.loads  # claimed, posted, in flight
    return transfer, grant


def test_a_lost_p_fails_its_live_load_drops_its_link_and_its_late_notification_is_ignored(
        pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    cons, tl = pair.cons, pair.tl
    link = cons.connect(pair.prod.address)
    transfer, grant = start_stuck_load(pair, monkeypatch)
    assert cons.invalidate_peer(link.agent, link.epoch, "etcd lease gone") == [transfer]
    assert cons.pending() == 0 and cons.links == {}
    assert "r" not in tl.requests and tl.counts()["FREE"] == BLOCKS  # policy "fail": the blocks went back
    assert tl.stats["failed"] == 1
    # a late completion from the lost incarnation matches no load: nothing changes
    pair.td.receive_raw(link.agent, encode_notification(
        Notification("r", grant.transfer, grant.generation, link.epoch, "done", 0)))
    time.sleep(0.1)
    assert tl.stats["loaded"] == 0 and tl.counts()["READY_FOR_ATTENTION"] == 0
    # an epoch newer than the invalidated one is not touched by it, and a new handshake works
    assert cons.invalidate_peer(link.agent, link.epoch - 1) == []
    monkeypatch.undo()
    again = cons.connect(pair.prod.address)
    assert again.agent == link.agent and pair.prod.address in cons.links


@pytest.mark.multihost
def test_a_d_that_finds_its_own_etcd_lease_expired_fences_its_loads(
        pair: Pair, monkeypatch: pytest.MonkeyPatch, local_etcd: eh.EtcdServer) -> None:
    from kvlifecycle.membership import ConsumerPresence, EtcdOptions, EtcdSession

    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="f", lease_ttl_s=2, request_timeout_s=1.0))
    presence = ConsumerPresence(pair.cons, session, "d-fence")
    presence.register()
    try:
        pair.cons.connect(pair.prod.address)
        transfer, _ = start_stuck_load(pair, monkeypatch)
        lease_id = presence.registration.lease_id
        session.call("revoke", lambda c: c.revoke_lease(lease_id))  # as if D had been cut off past the TTL
        deadline = time.monotonic() + 10
        while not presence.registration.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert presence.registration.lost
        assert pair.cons.wait_idle(10)
        assert transfer not in pair.tl.loads and pair.tl.stats["failed"] == 1 and pair.cons.links == {}
    finally:
        presence.close()
        session.close()


def test_losing_one_p_rank_of_a_two_part_load_fails_it_and_the_other_rank_releases_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """P TP 2 → D TP 1: D's load reads both P ranks; one is lost: the load fails and the surviving rank is told."""
    import torch

    hnd = {"kv_layout": "HND", "num_kv_heads": 4, "head_size": 8, "block_size": 4, "dtype": "float16",
           "model_id": "m", "num_layers": 2}
    tag = time.monotonic_ns()
    ps, ledgers, transports = [], [], []
    for rank in (0, 1):
        kv = [torch.zeros((BLOCKS, 128), dtype=torch.uint8) for _ in range(REGIONS)]
        t = LoopbackTransport(f"p{rank}-mp-{tag}")
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (128,) * REGIONS))
        led = SourceLedger(BLOCKS, worker=f"p{rank}", default_ttl_s=30.0)
        ps.append(Producer(led, t, CompatInfo(tp_size=2, **hnd), tp_rank=rank,
                           options=HandoffOptions(unit_bytes=16)))
        ledgers.append(led)
        transports.append((t, kv))
    dkv = [torch.zeros((BLOCKS, 256), dtype=torch.uint8) for _ in range(REGIONS)]
    td = LoopbackTransport(f"d-mp-{tag}")
    td.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in dkv), (256,) * REGIONS))
    tl = TargetLedger(BLOCKS, worker="d")
    cons = Consumer(tl, td, CompatInfo(tp_size=1, **hnd), options=HandoffOptions(unit_bytes=16,
                                                                                  heartbeat_every_s=0.05))
    try:
        links = [cons.connect(p.address, push=False) for p in ps]
        stall_reads(td, monkeypatch)
        grants = []
        for p, led in zip(ps, ledgers, strict=True):
            led.allocate("tp", [1, 2])
            led.prefill_done("tp")
            grants.append(p.grant("tp"))
        tl.reserve("tp", [3, 4])
        transfer = cons.pull("tp", [(p.address, g) for p, g in zip(ps, grants, strict=True)])
        deadline = time.monotonic() + 10
        while transfer not in tl.loads and time.monotonic() < deadline:
            time.sleep(0.005)
        assert transfer in tl.loads
        assert cons.invalidate_peer(links[0].agent, links[0].epoch) == [transfer]
        assert tl.stats["failed"] == 1 and [lk.agent for lk in cons.links.values()] == [links[1].agent]
        # the surviving rank was told (LoadFailed, sent off D's service thread) and released its lease now, not at
        # its TTL (30 s): a bounded wait for the message's answer
        deadline = time.monotonic() + 10
        while grants[1].transfer in ledgers[1].leases and time.monotonic() < deadline:
            time.sleep(0.005)
        assert grants[1].transfer not in ledgers[1].leases
        assert [r.reason for r in ledgers[1].take_released()] == ["failed"]
        assert grants[0].transfer in ledgers[0].leases  # the lost one was not waited for
    finally:
        cons.close()
        for p in ps:
            p.close()
        for t, _ in transports:
            t.close()
        td.close()
    ledgers[0].fail(grants[0].transfer, grants[0].generation, "test end")
    assert all(check_source(led) == [] for led in ledgers) and check_target(tl) == []
