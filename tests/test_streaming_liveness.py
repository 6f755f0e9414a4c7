"""A stream's liveness: D heartbeats each P for its open streams over the real side channel (127.0.0.1), P ends the
streams of a D it no longer hears, D those of a P that no longer answers, and a live pair outlasts the timeout.

Both sides read one :class:`~kvlifecycle.clock.ManualClock`, moved only by the test once the heartbeats it waits for
were seen: no outcome depends on how fast this machine runs. Bytes move over the loopback transport (the fast
double); every wait is bounded."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.clock import ManualClock
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target, check_target_events
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, LAYERS, BYTES = 16, 3, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
OPTIONS = StreamOptions(stream_timeout_s=60.0, heartbeat_interval_s=0.1, peer_timeout_s=1.0)


@pytest.fixture
def pd(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    events: list = []
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d", failure_policy="fail")
    tl.listeners.append(events.append)
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    cons.connect(prod.address)
    clock = ManualClock(100.0)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=OPTIONS), StreamConsumer(cons, options=OPTIONS)
    sp._now = sc._now = clock.now
    yield sp, sc, clock, src, dst
    for part in (sc, sp, cons, prod, tp, td):
        part.close()
    assert check_source(sl) == [] and check_target(tl) == [] and check_target_events(events) == []


def _stream_first_layer(sp: StreamProducer, sc: StreamConsumer) -> None:
    sp.ledger.allocate("r", [1, 2, 3])
    sc.ledger.reserve("r", [7, 8, 9])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    sp.layer_done("r", 0, [1, 2, 3])
    assert until(lambda: sp.counts["layers_posted"] == 1 and sp.status("r").in_flight == 0)


def _beats(sp: StreamProducer, clock: ManualClock, seconds: float) -> None:
    """Move the clock ``seconds`` one heartbeat interval at a time, each step once P heard the beat it allows."""
    step = OPTIONS.heartbeat_interval_s * 1.01  # a hair over: 100.1 - 100.0 is below 0.1 in floating point
    for _ in range(round(seconds / step)):
        heard = sp.counts["heartbeats"]
        clock.advance(step)
        assert until(lambda heard=heard: sp.counts["heartbeats"] > heard)


def _release_p(sp: StreamProducer) -> None:
    sp.ledger.prefill_done("r")
    sp.release("r", lambda: sp.ledger.free("r"))
    assert until(lambda: sp.pending() == 0) and not sp.ledger.requests


def test_a_stream_whose_d_went_silent_ends_on_p_with_the_peer_timeout(pd) -> None:
    sp, sc, clock, _, _ = pd
    _stream_first_layer(sp, sc)
    _beats(sp, clock, 0.5)
    sc.close()  # D's stream service stops: no more heartbeats
    sp.layer_done("r", 1, [1, 2, 3])
    assert until(lambda: sp.counts["layers_posted"] == 2)
    clock.advance(OPTIONS.peer_timeout_s + 0.1)
    assert until(lambda: sp.status("r").state == "stopped")
    status = sp.status("r")
    assert status.reason.startswith("peer timeout: D ") and status.in_flight == 0
    assert sp.counts["peer_timed_out"] == 1
    sp.layer_done("r", 2, [1, 2, 3])  # no new post once stopped
    assert until(lambda: sc.counts["failed"] == 1)  # P's failed note, sent once its writes settled, reached D
    assert sp.counts["layers_posted"] == 2 and not sc.ledger.loads and "r" not in sc.ledger.requests  # failed, freed
    _release_p(sp)


def test_a_stream_whose_p_stopped_answering_ends_on_d_as_peer_lost(pd) -> None:
    sp, sc, clock, _, _ = pd
    _stream_first_layer(sp, sc)
    _beats(sp, clock, 0.5)
    sp.close()  # P hangs: its stream service stops, its side channel answers no more
    sp.producer.server.close()
    clock.advance(OPTIONS.peer_timeout_s * 2)
    assert until(lambda: sc.pending() == 0)
    assert sc.counts["peer_lost"] == 1 and sc.counts["failed"] == 1 and sc.counts["heartbeats_unanswered"] >= 1
    assert not sc.ledger.loads and "r" not in sc.ledger.requests  # failed under the ledger's policy, freed
    sp.ledger.prefill_done("r")
    sp.ledger.free("r")


def test_a_live_pair_streaming_past_the_peer_timeout_is_not_ended(pd) -> None:
    sp, sc, clock, src, dst = pd
    _stream_first_layer(sp, sc)
    _beats(sp, clock, 3 * OPTIONS.peer_timeout_s)
    sp.layer_done("r", 1, [1, 2, 3])
    _beats(sp, clock, 3 * OPTIONS.peer_timeout_s)
    sp.layer_done("r", 2, [1, 2, 3])
    assert until(lambda: sc.pending() == 0)
    assert sc.counts["completed"] == 1 and sc.counts["peer_lost"] == 0 and sp.counts["peer_timed_out"] == 0
    for layer in range(LAYERS):
        assert np.array_equal(dst[layer][[7, 8, 9]].numpy(), src[layer][[1, 2, 3]].numpy())
    _release_p(sp)
    sc.ledger.finish("r")


def test_a_malformed_heartbeat_is_refused_and_counted_by_p(pd) -> None:
    from kvlifecycle.sidechannel import SideChannelClient, SideChannelRefused, encode_frame

    sp, _, _, _, _ = pd
    client = SideChannelClient(sp.producer.address, [], timeout_s=5.0)
    body = msgspec.msgpack.encode({"type": "StreamHeartbeat", "agent": "d", "epoch": -1, "tokens": [b"x" * 65]})
    before = sp.producer.server.refused.get("malformed", 0)
    try:
        with pytest.raises(SideChannelRefused) as refused:
            client.request_raw(encode_frame(body, 1, None))
    finally:
        client.close()
    assert refused.value.code == "malformed" and sp.producer.server.refused["malformed"] == before + 1
    assert sp.counts["heartbeats"] == 0


def test_a_reservation_of_a_silent_d_is_dropped_before_its_prefill_begins(pd) -> None:
    sp, sc, clock, _, _ = pd
    sp.ledger.allocate("r", [1, 2, 3])
    sc.ledger.reserve("r", [7, 8, 9])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.status("r").state == "reserved"
    _beats(sp, clock, 0.5)  # D's heartbeats keep the unbegun reservation
    assert sp.status("r").state == "reserved"
    sc.close()
    clock.advance(OPTIONS.peer_timeout_s + 0.1)
    assert until(lambda: sp.status("r").state == "stopped")
    assert sp.status("r").reason.startswith("peer timeout: D ") and sp.counts["peer_timed_out"] == 1
    assert not sp.begin("r")  # D may free those blocks: the prefill takes the post-prefill path
    assert sp.prefill_ended("r") is False
    _release_p(sp)
    assert sc.peer_lost(sp.transport.agent, "P dropped the reservation") == 1  # D's side, as its peer timeout would
    assert not sc.ledger.loads and "r" not in sc.ledger.requests
