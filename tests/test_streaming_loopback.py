"""The stream's edge cases in one process over the loopback transport (the fast double; the main flows run over real
NIXL in two processes in test_streaming_nixl.py). Every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamRequest
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_quiescent, check_source, check_target, check_target_events
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sidechannel import SideChannelClient
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.streaming.wire import NOTE_LAYERS, LayerBatch, encode_batch
from kvlifecycle.transport import KVLayout, MemoryKind, Notification

BLOCKS, LAYERS, BYTES = 16, 3, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


@pytest.fixture(params=["fail", "recompute"])
def pd(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    events: list = []
    sl = SourceLedger(BLOCKS, worker="p")
    tl = TargetLedger(BLOCKS, worker="d", failure_policy=request.param)
    tl.listeners.append(events.append)
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    cons.connect(prod.address)
    options = StreamOptions(stream_timeout_s=10.0)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=options), StreamConsumer(cons, options=options)
    yield sp, sc, src, dst
    for part in (sc, sp, cons, prod, tp, td):
        part.close()
    assert check_source(sl) == [] and check_target(tl) == [] and check_target_events(events) == []


def test_a_stream_copies_every_layer_exactly(pd) -> None:
    sp, sc, src, dst = pd
    sp.ledger.allocate("r", [1, 2, 3])
    sc.ledger.reserve("r", [7, 8, 9])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    for layer in range(LAYERS):
        sp.layer_done("r", layer, [1, 2, 3])
    assert until(lambda: sc.pending() == 0)
    assert sc.counts["completed"] == 1 and (sc.ledger.state[[7, 8, 9]] == 3).all()
    for layer in range(LAYERS):
        assert np.array_equal(dst[layer][[7, 8, 9]].numpy(), src[layer][[1, 2, 3]].numpy())
    sp.ledger.prefill_done("r")
    sp.release("r", lambda: sp.ledger.free("r"))
    assert until(lambda: sp.pending() == 0) and not sp.ledger.requests
    sc.ledger.finish("r")


def test_a_cancel_before_p_begins_frees_at_once_and_the_prefill_takes_the_usual_path(pd) -> None:
    sp, sc, _, _ = pd
    sc.ledger.reserve("r", [4])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sc.cancel("r")
    assert until(lambda: sc.pending() == 0)
    assert "r" not in sc.ledger.requests and not check_quiescent(sc.ledger)
    assert not sp.begin("r") and not sp.prefill_ended("r") and sp.counts["fallback"] == 1


def test_a_reservation_arriving_mid_prefill_joins_it_and_catches_up_on_the_layers_computed(pd) -> None:
    sp, sc, src, dst = pd
    sp.ledger.allocate("r", [1, 2, 3])
    assert not sp.begin("r")  # P's prefill starts before D's reservation is there: it goes on regardless
    sp.layer_done("r", 0, [1, 2])  # chunk 1, every layer
    sp.layer_done("r", 1, [1, 2])
    sp.layer_done("r", 2, [1, 2])
    sp.layer_done("r", 0, [1, 2, 3])  # chunk 2, layer 0
    sc.ledger.reserve("r", [7, 8, 9])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)  # joins: not declined
    assert sp.streaming("r") and sp.counts["joined_late"] == 1
    sp.layer_done("r", 1, [1, 2, 3])
    sp.layer_done("r", 2, [1, 2, 3])
    assert sp.prefill_ended("r")
    assert until(lambda: sc.pending() == 0)
    assert sc.counts["completed"] == 1 and sp.counts["fallback"] == 0 and (sc.ledger.state[[7, 8, 9]] == 3).all()
    for layer in range(LAYERS):
        assert np.array_equal(dst[layer][[7, 8, 9]].numpy(), src[layer][[1, 2, 3]].numpy())
    sp.ledger.prefill_done("r")
    sp.release("r", lambda: sp.ledger.free("r"))
    assert until(lambda: sp.pending() == 0) and not sp.ledger.requests
    sc.ledger.finish("r")


def test_a_duplicated_stream_request_starts_one_stream(pd) -> None:
    sp, sc, _, _ = pd
    sc.ledger.reserve("r", [4, 5])
    transfer = sc.request_stream("r", sp.producer.address, layers=LAYERS)
    (held, _, _), = sp._reservations["r"].values()
    client = SideChannelClient(sp.producer.address, (), timeout_s=5.0)
    try:
        assert client.request(held).ok  # the same request again (a retry): acknowledged, not a second stream
        other = StreamRequest("r", "another", held.agent, held.epoch, held.blocks, LAYERS, held.token,
                              held.write_window_s)
        assert not client.request(other).ok
    finally:
        client.close()
    assert sp.begin("r") and sp.counts["streamed"] == 1
    sp.cancel("r")
    sp.release("r", lambda: None)
    assert until(lambda: sc.pending() == 0 and sp.pending() == 0)
    assert transfer not in sc.ledger.loads and sc.counts["failed"] == 1
    if "r" in sc.ledger.requests:  # policy recompute: the reservation stays for a local prefill
        sc.ledger.cancel("r")


def test_a_note_without_the_streams_token_changes_nothing(pd) -> None:
    sp, sc, _, _ = pd
    sc.ledger.reserve("r", [6])
    transfer = sc.request_stream("r", sp.producer.address, layers=1 * LAYERS)
    forged = Notification(transfer, transfer, 0, sp.transport.epoch, NOTE_LAYERS, 0,
                          encode_batch(b"x" * TOKEN_BYTES, LayerBatch(0, LAYERS, 0, 1)))
    sp.transport.send_notification(sc.transport.agent, forged)
    assert until(lambda: sc.counts["forged"] == 1)
    assert not sc.ledger.layer_progress[transfer].landed.any()
    sc.cancel("r")
    assert until(lambda: sc.pending() == 0) and "r" not in sc.ledger.requests


def test_p_aborts_mid_stream_d_is_told_after_the_writes_settled(pd) -> None:
    sp, sc, _, _ = pd
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    transfer = sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    sp.layer_done("r", 0, [1, 2])
    assert until(lambda: sp.counts["layers_posted"] == 1)  # a cancel drops the posts still queued
    sp.cancel("r", "client disconnected")
    sp.layer_done("r", 1, [1, 2])  # after the stop: not posted
    sp.release("r", lambda: sp.ledger.cancel("r"))
    assert until(lambda: sc.pending() == 0 and sp.pending() == 0)
    assert sp.counts["layers_posted"] == 1 and not sp.ledger.requests
    assert transfer not in sc.ledger.loads
    recompute = sc.ledger.failure_policy == "recompute"
    assert ("r" in sc.ledger.requests) == recompute  # fail: FREE; recompute: RESERVED, for a local prefill
    if recompute:
        sc.ledger.cancel("r")


def test_a_prefill_released_before_every_layer_was_posted_fails_the_stream(pd) -> None:
    sp, sc, _, _ = pd
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    for layer in range(LAYERS):
        sp.layer_done("r", layer, [1])  # block 2 is never posted
    sp.ledger.prefill_done("r")
    sp.release("r", lambda: sp.ledger.free("r"))
    assert until(lambda: sc.pending() == 0 and sp.pending() == 0)
    assert sc.counts["failed"] == 1 and not (sc.ledger.state == 3).any()
    if "r" in sc.ledger.requests:
        sc.ledger.cancel("r")


def test_a_cancel_from_d_drops_the_layer_posts_already_queued_at_p(pd) -> None:
    """The cancel stops the stream where it is received: layers queued behind a busy stream thread are not posted
    after it (they were, when the stop itself queued behind them)."""
    import threading

    sp, sc, _, _ = pd
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    transfer = sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    busy = threading.Event()
    sp._jobs.put(lambda: busy.wait(10))  # P's stream thread is behind: the layers queue up
    for layer in range(LAYERS):
        sp.layer_done("r", layer, [1, 2])
    assert sc.cancel("r")
    assert until(lambda: sp.counts["cancelled_by_d"] == 1)
    busy.set()
    sp.release("r", lambda: sp.ledger.cancel("r"))
    assert until(lambda: sc.pending() == 0 and sp.pending() == 0)
    assert sp.counts["layers_posted"] == 0
    assert transfer not in sc.ledger.loads and "r" not in sc.ledger.requests  # cancelled: FREE under both policies
