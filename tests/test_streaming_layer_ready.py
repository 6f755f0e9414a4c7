"""A layer's readiness is awaited before its post: P's streamer waits on the callable the engine handed with the
layer (on a GPU, an event after the layer on the compute stream) and posts only once it said the KV is written; a
layer that never becomes ready, or whose wait fails, stops the stream and D is told.

Over the loopback transport in one process (the fast double). The vLLM adapter's CUDA readiness is checked in
tests/transports/test_vllm_layer_ready.py, and on a GPU in tests/transports/test_cuda_layer_stream_order.py.
Every wait is bounded.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, LAYERS, BYTES = 16, 3, 64
TIMEOUT_S = 7.5
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


def until(fn: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False


@pytest.fixture
def pd(request: pytest.FixtureRequest) -> Any:
    """P's streamer over a transport whose posts are recorded in ``order``; D's stream consumer."""
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    order: list[tuple[str, int]] = []
    post = tp.post

    def recorded_post(*args: Any, regions: Any = None, **kwargs: Any) -> Any:
        order.append(("post", int(regions[0])))  # one region per layer: the region is the layer
        return post(*args, regions=regions, **kwargs)

    tp.post = recorded_post  # type: ignore[method-assign]
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d")
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    cons.connect(prod.address)
    options = StreamOptions(stream_timeout_s=TIMEOUT_S)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=options), StreamConsumer(cons, options=options)
    yield SimpleNamespace(sp=sp, sc=sc, src=src, dst=dst, order=order)
    for part in (sc, sp, cons, prod, tp, td):
        part.close()


def start(pd: Any) -> None:
    pd.sp.ledger.allocate("r", [1, 2, 3])
    pd.sc.ledger.reserve("r", [7, 8, 9])
    assert pd.sc.request_stream("r", pd.sp.producer.address, layers=LAYERS)
    assert pd.sp.begin("r")


def test_each_layers_readiness_is_awaited_before_its_post(pd: Any) -> None:
    start(pd)
    gates = [threading.Event() for _ in range(LAYERS)]
    timeouts: list[float] = []

    def ready(layer: int) -> Any:
        def wait(timeout_s: float) -> bool:
            timeouts.append(timeout_s)
            pd.order.append(("ready", layer))
            return gates[layer].wait(timeout_s)

        return wait

    for layer in range(LAYERS):
        pd.sp.layer_done("r", layer, [1, 2, 3], ready(layer))
    # the layers are queued but layer 0 is not written yet: its post waits (and so does every later one)
    assert until(lambda: pd.order == [("ready", 0)])
    time.sleep(0.05)
    assert pd.order == [("ready", 0)] and pd.sp.counts["layers_posted"] == 0
    for gate in gates:
        gate.set()
    assert until(lambda: pd.sc.pending() == 0)
    assert pd.order == [(step, layer) for layer in range(LAYERS) for step in ("ready", "post")]
    window_s = pd.sp.options.write_window_s  # each wait is bounded by what is left of P's write window
    assert len(timeouts) == LAYERS and all(0 < t <= window_s < TIMEOUT_S for t in timeouts), timeouts
    assert pd.sc.counts["completed"] == 1
    for layer in range(LAYERS):
        assert np.array_equal(pd.dst[layer][[7, 8, 9]].numpy(), pd.src[layer][[1, 2, 3]].numpy())


@pytest.mark.parametrize("outcome", ["not ready", "raises"])
def test_a_layer_that_is_never_written_stops_the_stream_and_d_is_told(pd: Any, outcome: str) -> None:
    start(pd)

    def never(_timeout_s: float) -> bool:
        if outcome == "raises":
            raise RuntimeError("device fault")
        return False

    pd.sp.layer_done("r", 0, [1, 2, 3], lambda _t: True)
    pd.sp.layer_done("r", 1, [1, 2, 3], never)
    pd.sp.layer_done("r", 2, [1, 2, 3], lambda _t: True)
    assert until(lambda: pd.sc.pending() == 0)
    assert pd.order == [("post", 0)]  # nothing after the layer that never became ready
    assert pd.sc.counts["completed"] == 0 and not pd.dst[2].any()
