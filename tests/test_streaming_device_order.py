"""Which way a layer's post is ordered after the layer: on the device where the transport can, else on the host.

A transport that orders its copies on the device (``post_after``, :class:`DeviceOrderedPost`) gets the layer's
event with the post and the streamer's thread never waits for the layer; any other transport (NIXL, loopback) gets
the host wait first, then a plain post. A readiness without a device event is waited on whatever the transport.

Over the loopback transport in one process (the fast double), with a subclass that says it orders on the device
and records the events it was handed. The CUDA IPC transport's own ``post_after`` is checked on a GPU in
tests/transports/test_cuda_layer_stream_order.py. Every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
from kvlifecycle.streaming.producer import DeviceLayerReady
from kvlifecycle.transport import (
    DeviceOrderedPost,
    KVLayout,
    MemoryKind,
    Notification,
    PreparedPlan,
    TransferHandle,
    XferOp,
    orders_on_device,
)

BLOCKS, LAYERS, BYTES = 16, 3, 64
TIMEOUT_S = 7.5
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


class DeviceOrderedLoopback(LoopbackTransport):
    """Loopback that says it orders on the device: records each ``post_after``'s event and layer, then posts (the
    fake events have all fired)."""

    def __init__(self, agent: str) -> None:
        super().__init__(agent)
        self.afters: list[tuple[object, int]] = []

    def post_after(self, after: object, op: XferOp | str, plan: PreparedPlan,
                   local_blocks: np.ndarray | Sequence[int], remote_blocks: np.ndarray | Sequence[int], *,
                   regions: np.ndarray | Sequence[int] | None = None, notification: Notification | None = None,
                   transfer: str = "") -> TransferHandle:
        assert regions is not None
        self.afters.append((after, int(regions[0])))  # one region per layer: the region is the layer
        return self.post(op, plan, local_blocks, remote_blocks, regions=regions, notification=notification,
                         transfer=transfer)


class FakeLayerReady:
    """A layer's readiness carrying a device event; its host wait is counted (and always succeeds)."""

    def __init__(self, layer: int, waits: list[int]) -> None:
        self.device_event: object = ("event", layer)
        self._layer, self._waits = layer, waits

    def __call__(self, timeout_s: float, /) -> bool:
        self._waits.append(self._layer)
        return True


def until(fn: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False


@pytest.fixture(params=["device-ordered", "host-ordered"])
def pd(request: pytest.FixtureRequest) -> Any:
    """P's streamer over a transport that orders on the device (or not), D's stream consumer, one stream begun."""
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    kind = DeviceOrderedLoopback if request.param == "device-ordered" else LoopbackTransport
    tp, td = kind(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d")
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    cons.connect(prod.address)
    options = StreamOptions(stream_timeout_s=TIMEOUT_S)
    sp, sc = StreamProducer(prod, layers=LAYERS, options=options), StreamConsumer(cons, options=options)
    sl.allocate("r", [1, 2, 3])
    tl.reserve("r", [7, 8, 9])
    assert sc.request_stream("r", prod.address, layers=LAYERS)
    assert sp.begin("r")
    yield SimpleNamespace(sp=sp, sc=sc, src=src, dst=dst, tp=tp, device=request.param == "device-ordered")
    for part in (sc, sp, cons, prod, tp, td):
        part.close()


def landed(pd: Any) -> bool:
    return all(np.array_equal(pd.dst[layer][[7, 8, 9]].numpy(), pd.src[layer][[1, 2, 3]].numpy())
               for layer in range(LAYERS))


def test_the_layers_event_goes_with_the_post_only_where_the_transport_orders_on_the_device(pd: Any) -> None:
    assert orders_on_device(pd.tp) is pd.device
    waits: list[int] = []
    readies = [FakeLayerReady(layer, waits) for layer in range(LAYERS)]
    assert all(isinstance(r, DeviceLayerReady) for r in readies)
    for layer in range(LAYERS):
        pd.sp.layer_done("r", layer, [1, 2, 3], readies[layer])
    assert until(lambda: pd.sc.pending() == 0)
    assert pd.sc.counts["completed"] == 1 and landed(pd)
    if pd.device:
        assert waits == []  # the streamer's thread never waited for a layer on the host
        assert pd.tp.afters == [(("event", layer), layer) for layer in range(LAYERS)]
    else:
        assert waits == list(range(LAYERS))  # NIXL, loopback: the host wait, then a plain post


def test_a_readiness_without_a_device_event_is_waited_on_the_host_whatever_the_transport(pd: Any) -> None:
    waits: list[int] = []

    def host_only(layer: int) -> Any:
        def wait(_timeout_s: float) -> bool:
            waits.append(layer)
            return True

        return wait

    for layer in range(LAYERS):
        pd.sp.layer_done("r", layer, [1, 2, 3], host_only(layer))
    assert until(lambda: pd.sc.pending() == 0)
    assert waits == list(range(LAYERS)) and landed(pd)
    assert not getattr(pd.tp, "afters", [])


def test_only_a_transport_with_post_after_says_it_orders_on_the_device() -> None:
    suffix = time.monotonic_ns()
    plain, device = LoopbackTransport(f"plain-{suffix}"), DeviceOrderedLoopback(f"dev-{suffix}")
    try:
        assert not orders_on_device(plain) and not orders_on_device(object())
        assert isinstance(device, DeviceOrderedPost) and orders_on_device(device)
    finally:
        plain.close()
        device.close()
