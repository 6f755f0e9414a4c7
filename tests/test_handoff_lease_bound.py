"""A lease bounds the transfers under it (docs/design.md, "A lease bounds its transfers"), with the real Producer
and Consumer over the loopback transport. The simulation found each of these (tests/sim/test_sim_findings.py names
the seeds); here a gate holds a transfer in flight so that the race is certain. Every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("torch")

from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.control import Heartbeat, PushRequest
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_merged, check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import SourceState
from kvlifecycle.sidechannel import SideChannelError
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, REGIONS, BYTES = 8, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


class Lossy:
    """Wraps a side-channel client: the chosen requests are lost on the way to P (``requests``), or their replies
    are lost after P handled them (``replies``)."""

    def __init__(self, client, *, requests=lambda _m: False, replies=lambda _m: False) -> None:
        self.client, self.lose_request, self.lose_reply = client, requests, replies

    def __getattr__(self, name: str):
        return getattr(self.client, name)

    def request(self, message, timeout_s: float | None = None):
        if self.lose_request(message):
            raise SideChannelError("injected: the request was lost (timed out)")
        reply = self.client.request(message, timeout_s=timeout_s)
        if self.lose_reply(message):
            raise SideChannelError("injected: the reply was lost (timed out)")
        return reply


def renewal(message) -> bool:
    return isinstance(message, Heartbeat) and bool(message.token)


@pytest.fixture
def cluster(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(1, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * REGIONS))
    gp, gd = Gated(tp), Gated(td)
    plog: list = []
    dlog: list = []
    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(BLOCKS, worker="d")
    sl.listeners.append(plog.append)
    tl.listeners.append(dlog.append)
    prod = Producer(sl, gp, COMPAT)
    cons = Consumer(tl, gd, COMPAT, options=HandoffOptions(heartbeat_every_s=0.02, probe=False))
    cons.connect(prod.address)
    yield prod, cons, gp, gd, dst, plog, dlog
    gp.gate_open = gd.gate_open = True
    cons.close()
    prod.close()
    tp.close()
    td.close()
    assert check_source(sl) == [] and check_target(tl) == []
    assert check_merged(plog, dlog) == []


def grant(prod: Producer, request: str, blocks: list[int], ttl_s: float | None = None):
    prod.ledger.allocate(request, blocks)
    prod.ledger.prefill_done(request)
    return prod.grant(request, ttl_s=ttl_s)


def released(plog: list, transfer: str) -> list[str]:
    return [e.reason for e in plog if isinstance(e, ev.SrcLeaseReleased) and e.transfer == transfer]


def test_push_reply_lost_keeps_d_blocks_loading_until_p_cancelled_its_write(cluster) -> None:
    """Seed 290's shape: P accepted the push and its WRITE is in flight, but the reply was lost. D hands the lease
    back and keeps its blocks LOADING; P cancels the write first, then releases and tells D, which fails the
    load. The blocks never held a byte of the cancelled write."""
    prod, cons, gp, _, dst, plog, _ = cluster
    link = cons.links[prod.address]
    # the reply is lost once P's WRITE is in flight (behind the gate)
    link.client = Lossy(link.client, replies=lambda m: isinstance(m, PushRequest) and until(lambda: gp.pending))
    writes_at_release: list[int] = []
    writes_when_d_let_go: list[int] = []
    prod.ledger.listeners.append(
        lambda e: writes_at_release.append(len(gp.pending)) if isinstance(e, ev.SrcLeaseReleased) else None)
    cons.ledger.listeners.append(
        lambda e: writes_when_d_let_go.append(len(gp.pending)) if isinstance(e, ev.TgtLoadFailed) else None)
    g = grant(prod, "r", [1, 2])
    cons.ledger.reserve("r", [3, 4])
    cons.request_push("r", g, address=prod.address)
    assert until(lambda: gp.cancelled == 1)  # P's service thread cancelled the write D gave up on
    assert cons.wait_idle(10)
    assert cons.ledger.stats["failed"] == 1 and cons.ledger.stats["loaded"] == 0
    assert until(lambda: released(plog, g.transfer) == ["failed"]) and until(lambda: writes_at_release)
    assert writes_at_release == [0]  # the lease ended only after its write was cancelled
    assert writes_when_d_let_go == [0]  # and D let go of its blocks only then
    assert int(dst[0][[3, 4]].sum()) == 0  # nothing landed


def test_push_write_in_flight_at_expiry_is_cancelled_before_the_lease_is_released(cluster) -> None:
    """The lease runs out (D's renewals are lost) while P's WRITE is in flight: the sweep keeps the lease, P cancels
    the write, and only then is the lease released as expired; D keeps its blocks LOADING until P's word."""
    prod, cons, gp, _, dst, plog, dlog = cluster
    link = cons.links[prod.address]
    link.client = Lossy(link.client, requests=renewal)
    writes_at_release: list[int] = []
    writes_when_d_let_go: list[int] = []  # D's blocks leave LOADING with its load's failure
    prod.ledger.listeners.append(
        lambda e: writes_at_release.append(len(gp.pending)) if isinstance(e, ev.SrcLeaseReleased) else None)
    cons.ledger.listeners.append(
        lambda e: writes_when_d_let_go.append(len(gp.pending)) if isinstance(e, ev.TgtLoadFailed) else None)
    g = grant(prod, "r", [1, 2], ttl_s=0.3)
    cons.ledger.reserve("r", [5, 6])
    cons.request_push("r", g, address=prod.address)
    assert until(lambda: gp.cancelled == 1)
    assert cons.wait_idle(10)
    assert until(lambda: released(plog, g.transfer) == ["expired"]) and until(lambda: writes_at_release)
    assert writes_at_release == [0]
    assert writes_when_d_let_go == [0]  # D let go of its blocks only once P's write was cancelled
    assert any(isinstance(e, ev.TgtLoadFailed) and "write cancelled" in e.reason for e in dlog)
    assert int(dst[0][[5, 6]].sum()) == 0


def test_read_outliving_its_lease_is_cancelled_by_d_before_p_expires_it(cluster) -> None:
    """Seed 73's shape: D's READ is in flight and its renewals are lost. D gives the read up at the lease's
    deadline (the last acknowledged renewal's send time + 0.9 TTL), before P could expire the lease and reuse
    its blocks: when P releases the lease, no read of it is in flight."""
    prod, cons, _, gd, dst, plog, dlog = cluster
    link = cons.links[prod.address]
    link.client = Lossy(link.client, requests=renewal)
    reads_at_release: list[int] = []
    prod.ledger.listeners.append(
        lambda e: reads_at_release.append(len(gd.pending)) if isinstance(e, ev.SrcLeaseReleased) else None)
    g = grant(prod, "r", [1, 2], ttl_s=0.3)
    cons.ledger.reserve("r", [5, 6])
    cons.pull("r", g, address=prod.address)
    assert cons.wait_idle(10)
    assert gd.cancelled == 1
    assert any(isinstance(e, ev.TgtLoadFailed) and "outlived its lease" in e.reason for e in dlog)
    assert until(lambda: released(plog, g.transfer) != []) and until(lambda: reads_at_release)
    assert reads_at_release == [0]
    assert int(dst[0][[5, 6]].sum()) == 0
    prod.ledger.free("r")


def test_push_job_run_after_its_lease_expired_posts_no_write(cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Seed 36's shape: P accepted the push, but its job ran only after the lease expired: no WRITE is posted, D is
    told the push failed, and the lease is released as expired."""
    prod, cons, gp, _, dst, plog, _ = cluster
    real_start = prod._start_push
    held: list = []
    monkeypatch.setattr(prod, "_start_push", lambda *args: held.append(args))
    link = cons.links[prod.address]
    link.client = Lossy(link.client, requests=renewal)
    g = grant(prod, "r", [3], ttl_s=0.2)
    cons.ledger.reserve("r", [7])
    cons.request_push("r", g, address=prod.address)
    assert until(lambda: held)
    time.sleep(0.25)  # the lease runs out (a wait on the clock, not a timed assertion)
    prod._jobs.put(lambda: real_start(*held[0]))
    assert cons.wait_idle(10)
    assert not gp.pending and gp.cancelled == 0  # nothing was posted
    assert cons.ledger.stats["failed"] == 1
    assert until(lambda: released(plog, g.transfer) == ["expired"])
    assert int(dst[0][[7]].sum()) == 0


def test_deferred_cancel_then_completion_ends_under_no_reader(cluster) -> None:
    """Seed 49's shape: P cancels while D reads (the release waits for D); the read completes and P drains its
    notification and releases before D records its DONE. The lease ended under no reader: the logs pass
    check_merged (the fixture checks)."""
    prod, cons, _, gd, _, plog, dlog = cluster
    link = cons.links[prod.address]
    link.client = Lossy(link.client, requests=renewal)  # else D learns of the release first and fails the load
    g = grant(prod, "r", [1])
    cons.ledger.reserve("r", [2])
    cons.pull("r", g, address=prod.address)
    assert until(lambda: gd.pending)  # claimed and posted, behind the gate
    assert prod.ledger.cancel("r")
    assert int(prod.ledger.block_states(np.array([1]))[0]) == int(SourceState.PINNED_FOR_TRANSFER)
    gd.hold_done = True
    gd.gate_open = True  # the bytes move and P is notified, while D still polls PENDING
    assert until(lambda: released(plog, g.transfer) == ["cancelled"])
    assert not any(isinstance(e, ev.TgtPartDone) for e in dlog)  # P released first
    time.sleep(0.005)  # D's DONE in a later millisecond than P's release: the HLCs order by wall ms first
    gd.hold_done = False
    assert cons.wait_idle(10)
    assert cons.ledger.stats["loaded"] == 1  # D took the read's DONE after P's release
    assert check_merged(plog, dlog) == []
    cons.ledger.finish("r")
    prod.ledger.free("r")


def test_a_failing_load_still_gives_a_read_up_at_its_lease_bound(cluster) -> None:
    """A load whose failure waits for a sibling read in flight (several P ranks: vLLM #56104) keeps that read
    under the same bound: when its renewals are lost, D cancels the read at the lease's deadline instead of
    waiting for it while P expires the lease and reuses the blocks."""
    prod, cons, _, gd, dst, plog, dlog = cluster
    link = cons.links[prod.address]
    link.client = Lossy(link.client, requests=renewal)
    reads_at_release: list[int] = []
    prod.ledger.listeners.append(
        lambda e: reads_at_release.append(len(gd.pending)) if isinstance(e, ev.SrcLeaseReleased) else None)
    g = grant(prod, "r", [1, 2], ttl_s=0.3)
    cons.ledger.reserve("r", [5, 6])
    cons.pull("r", g, address=prod.address)
    assert until(lambda: gd.pending)
    with cons._lock:  # a sibling part failed: the load now waits for this read to settle
        (load,) = cons._loads.values()
        load.failing = "sibling read failed"
    assert cons.wait_idle(10)
    assert gd.cancelled == 1  # the read was given up, not waited for
    assert any(isinstance(e, ev.TgtLoadFailed) and e.reason == "sibling read failed" for e in dlog)  # first reason
    assert until(lambda: released(plog, g.transfer) != []) and until(lambda: reads_at_release)
    assert reads_at_release == [0]
    assert int(dst[0][[5, 6]].sum()) == 0
    prod.ledger.free("r")
