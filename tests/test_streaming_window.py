"""A stream's write window bounds P's writes (docs/design.md, "A lease bounds its transfers", streams): with the real
StreamProducer and StreamConsumer over the loopback transport, a layer's WRITE is held in flight by a gate and P's
``failed`` note is lost, so D's only way out is its timeout. P cancels the write when its window ends; D fails the
stream only after its (longer) timeout, when nothing of P's is in flight. Every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("torch")

from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamRequest
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol.bounds import min_stream_timeout
from kvlifecycle.sidechannel import SideChannelClient
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.streaming.wire import NOTE_FAILED
from kvlifecycle.transport import KVLayout, MemoryKind, Notification

BLOCKS, LAYERS, BYTES = 8, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
OPTIONS = StreamOptions(stream_timeout_s=1.0)  # P's window: 0.8 s


class HeldWrites(Gated):
    """Writes held PENDING (the gate stays shut) until ``let_go``; ``failed`` notes are lost on the way to D."""

    def send_notification(self, peer: str, note: Notification) -> None:
        if note.kind != NOTE_FAILED:
            self.inner.send_notification(peer, note)


@pytest.fixture(params=["fail", "recompute"])
def pd(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(1, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    held = HeldWrites(tp)
    sl = SourceLedger(BLOCKS, worker="p")
    tl = TargetLedger(BLOCKS, worker="d", failure_policy=request.param)
    prod, cons = Producer(sl, held, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions(probe=False))
    cons.connect(prod.address)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=OPTIONS), StreamConsumer(cons, options=OPTIONS)
    yield sp, sc, held, dst
    for part in (sc, sp, cons, prod, tp, td):
        part.close()
    assert check_source(sl) == [] and check_target(tl) == []


def test_d_times_out_a_held_write_only_after_p_cancelled_it(pd) -> None:
    sp, sc, held, dst = pd
    in_flight_at_d_end: list[int] = []  # P's writes in flight when D's ledger ended the stream's load
    sc.ledger.listeners.append(
        lambda e: in_flight_at_d_end.append(len(held.pending)) if isinstance(e, ev.TgtLoadFailed) else None)
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    sp.layer_done("r", 0, [1, 2])
    assert until(lambda: len(held.pending) == 1)  # layer 0's write is in flight, held
    assert until(lambda: sc.pending() == 0, timeout_s=3 * OPTIONS.stream_timeout_s)
    assert sc.counts["timed_out"] == 1 and sc.counts["failed"] == 0  # the failed note was lost: D timed out
    assert in_flight_at_d_end == [0]  # D failed the load once, with nothing of P's in flight
    assert sp.counts["window_cancelled"] == 1 and held.cancelled == 1  # P cancelled it at its window's end
    sp.layer_done("r", 1, [1, 2])  # after the window: never posted
    assert held.let_go() == 0 and sp.counts["layers_posted"] == 1
    assert not any(region[[3, 4]].any() for region in dst)  # no byte of P's landed in D's blocks
    sp.release("r", lambda: sp.ledger.cancel("r"))
    assert until(lambda: sp.pending() == 0) and "r" not in sp.ledger.requests
    if "r" in sc.ledger.requests:  # recompute: RESERVED again, for a local prefill
        sc.ledger.cancel("r")


def test_a_write_its_transport_cannot_cancel_is_waited_for_not_released(pd) -> None:
    """A CUDA IPC copy runs to its end once launched: releasing its handle at the window's end would let P settle
    (and D free the blocks) while the copy still writes them. P keeps it, counts it, and settles once it ended."""
    sp, sc, held, _ = pd
    held.cancels_in_flight = False  # as CudaIpcTransport says
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    assert sp.begin("r")
    sp.layer_done("r", 0, [1, 2])
    assert until(lambda: len(held.pending) == 1)
    assert until(lambda: sp.counts["waited_uncancellable"] == 1)  # the window ended with the copy running
    assert held.cancelled == 0 and len(held.pending) == 1 and sp.counts["window_cancelled"] == 0
    assert sp.status("r").in_flight == 1  # not settled: the engine may not free P's blocks either
    assert held.let_go() == 1  # the copy ends
    assert until(lambda: sp.status("r").in_flight == 0)
    assert sp.counts["waited_uncancellable"] == 1  # counted once, however many sweeps saw it
    sp.release("r", lambda: sp.ledger.cancel("r"))
    assert until(lambda: sp.pending() == 0) and "r" not in sp.ledger.requests
    assert until(lambda: sc.pending() == 0, timeout_s=3 * OPTIONS.stream_timeout_s)
    if "r" in sc.ledger.requests:
        sc.ledger.cancel("r")


def test_a_prefill_begun_after_the_window_takes_the_post_prefill_path(pd) -> None:
    sp, sc, held, _ = pd
    sp.ledger.allocate("r", [1, 2])
    sc.ledger.reserve("r", [3, 4])
    assert sc.request_stream("r", sp.producer.address, layers=LAYERS)
    time.sleep(OPTIONS.write_window_s)  # the reservation's window passes before P's prefill begins
    assert not sp.begin("r")  # not streaming: its window closed; nothing may join it either
    assert not sp.prefill_ended("r") and sp.counts["fallback"] == 1 and sp.counts["streamed"] == 0
    sc.cancel("r")
    assert until(lambda: sc.pending() == 0) and not held.pending
    sp.ledger.cancel("r")


def test_a_stream_request_that_reaches_p_after_ds_cancel_is_declined(pd) -> None:
    """D's request failed (no answer) and its cancel reached P first, answered ``settled``: D may free at once, so
    the request, arriving late, must not start a stream into those blocks."""
    sp, sc, _, _ = pd
    token = b"\x05" * TOKEN_BYTES
    ask = StreamRequest("late", "stream:late:9", sc.transport.agent, sc.transport.epoch, [5], LAYERS, token,
                        OPTIONS.write_window_s)
    client = SideChannelClient(sp.producer.address, (), timeout_s=5.0)
    try:
        assert client.request(StreamCancel("late", "stream:late:9", token, "request unanswered")).detail == "settled"
        answer = client.request(ask)
        assert not answer.ok and "post-prefill path" in answer.detail
    finally:
        client.close()
    assert "late" not in sp._reservations and sp.counts["declined"] == 1


@pytest.mark.parametrize("kwargs", [
    {"stream_timeout_s": 0.3},  # the default window (0.8 of it) plus the settle bound does not fit
    {"stream_timeout_s": 60.0, "write_window_s": 55.0},
    {"stream_timeout_s": 60.0, "write_window_s": 48.0, "reservation_ttl_s": 30.0},
    {"write_window_s": float("inf")},
])
def test_options_that_would_let_a_write_outlive_d_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="write_window_s"):
        StreamOptions(**kwargs)


def test_the_default_timeout_outlasts_the_default_window() -> None:
    options = StreamOptions()
    assert options.write_window_s < options.stream_timeout_s
    assert min_stream_timeout(options.write_window_s) < options.stream_timeout_s
    assert np.isclose(StreamOptions(stream_timeout_s=1.0).write_window_s, 0.8)
