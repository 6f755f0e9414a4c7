"""A stream's write never outlives its window while another stream waits for its layer (docs/design.md, streams):
P's stream service thread waits on the host for a layer's KV (a ``LayerReady`` the transport cannot order on the
device); that wait must not keep a second stream's write in flight past the second stream's window. Real
StreamProducer and StreamConsumer over the loopback transport, the write held in flight by a gate. Times are this
process's ``time.monotonic`` (P's stream clock). The mutant test puts the single long wait back and expects the
failure. Every wait is bounded."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol.bounds import STREAM_SETTLE_S
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, LAYERS, BYTES = 8, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
OPTIONS = StreamOptions(stream_timeout_s=1.0)  # P's window: 0.8 s


class TimedGate(Gated):
    """Writes held in flight; records when P released (cancelled) each pending one."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.cancelled_at: list[float] = []

    def release(self, handle) -> None:
        if handle.id in self.pending:
            self.cancelled_at.append(time.monotonic())
        super().release(handle)


def run_two_streams() -> tuple[float, list[float]]:
    """Stream ``r`` has a write held in flight; stream ``q``, asked for later, waits on the host for a layer that
    is never written. Returns ``r``'s window deadline and when P cancelled ``r``'s write."""
    import torch

    suffix = time.monotonic_ns()
    src = [torch.randint(1, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    tp, td = LoopbackTransport(f"p-wait-{suffix}"), LoopbackTransport(f"d-wait-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    held = TimedGate(tp)
    prod = Producer(SourceLedger(BLOCKS, worker="p"), held, COMPAT)
    cons = Consumer(TargetLedger(BLOCKS, worker="d"), td, COMPAT, options=HandoffOptions(probe=False))
    cons.connect(prod.address)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=OPTIONS), StreamConsumer(cons, options=OPTIONS)
    never = threading.Event()
    try:
        sp.ledger.allocate("r", [1, 2])
        sc.ledger.reserve("r", [1, 2])
        assert sc.request_stream("r", prod.address, layers=LAYERS)
        assert sp.begin("r")
        sp.layer_done("r", 0, [1, 2])
        assert until(lambda: len(held.pending) == 1)  # r's layer 0 in flight, held
        (r_stream,) = [s for s in sp._streams.values() if s.request == "r"]
        time.sleep(0.2)  # q's window ends well after r's (a wait on the clock, not a timed assertion)
        sp.ledger.allocate("q", [3, 4])
        sc.ledger.reserve("q", [3, 4])
        assert sc.request_stream("q", prod.address, layers=LAYERS)
        assert sp.begin("q")
        sp.layer_done("q", 0, [3, 4], ready=lambda timeout_s: never.wait(timeout_s))  # never written
        assert until(lambda: sp.counts["window_cancelled"] >= 1, timeout_s=5.0)
        return r_stream.window.deadline, list(held.cancelled_at)
    finally:
        never.set()
        held.gate_open = True
        for part in (sc, sp, cons, prod, tp, td):
            part.close()


def check(deadline: float, cancelled_at: list[float]) -> None:
    assert cancelled_at, "r's write was never cancelled"
    late = cancelled_at[0] - deadline
    assert late < STREAM_SETTLE_S, f"r's write was cancelled {late:.3f} s after its window ended"


def test_one_streams_wait_for_its_layer_keeps_no_other_write_past_its_window() -> None:
    check(*run_two_streams())


@pytest.mark.mutants
def test_mutant_one_long_host_wait_keeps_a_write_past_its_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StreamProducer, "_wait_for_layer", lambda self, ready, wait_s: ready(wait_s))
    with pytest.raises(AssertionError, match="after its window ended"):
        check(*run_two_streams())
