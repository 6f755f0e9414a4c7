"""Layer-wise streaming on a GPU: each layer's post is ordered after that layer's kernels.

P's forward enqueues each layer on its compute stream (a long kernel, then a fill of the layer's blocks with the
layer's tag) and calls the adapter's ``save_layer`` right after enqueuing it, while the kernel still runs. The
layer's post goes through the vLLM adapter's ``LayerStreaming`` (which records the layer's event on the current
stream) and a real ``StreamProducer`` over CUDA IPC into D's reserved blocks, D a real ``StreamConsumer``: every
block that lands at D holds its layer's final tag, never the poison the blocks held before the layer wrote them.
A post not ordered after the layer reads the poison while the kernel runs. Both ways of ordering: the CUDA IPC
transport's own (the streamer hands the layer's event to ``post_after`` and posts at once, while the layer still
runs) and the host wait every other transport gets (the streamer posts once the event completed).

Needs a GPU; skipped with the reason printed (``pytest -rs``) when CUDA is absent.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_stubs import vllm_or_stubs

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.streaming import StreamConsumer, StreamOptions
from kvlifecycle.transport import KVLayout, MemoryKind, orders_on_device

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (the CUDA IPC transport moves VRAM only)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)]

LAYERS, BLOCKS, BLOCK_BYTES = 4, 32, 64 * 1024
P_IDS, D_IDS = [3, 17, 4, 29, 0, 11], [8, 1, 30, 12, 21, 5]
POISON = 0xEE  # what P's blocks hold until their layer writes them
SLEEP_CYCLES = 100_000_000  # a layer's long kernel: ~50 ms at 2 GHz, far longer than the host's calls
WAIT_S = 60.0
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


def tag(layer: int) -> int:
    return 0x40 + layer


def until(fn: Any, timeout_s: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False


def layer_work(weights: torch.Tensor, cache: torch.Tensor, ids: torch.Tensor, *, cycles: int, fill: int) -> Any:
    """A layer on the current stream: its matmul, a long kernel, then its KV (``cache``'s blocks ``ids`` = ``fill``)."""
    weights = torch.tanh(weights @ weights)
    torch.cuda._sleep(cycles)
    cache.index_fill_(0, ids, fill)
    return weights


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's streaming module, imported against vLLM or its stubs."""
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm import streaming

        yield streaming


@pytest.mark.parametrize("order", ["device", "host wait"])
@pytest.mark.parametrize("compute", ["own stream", "default stream"])
def test_every_layer_lands_with_its_final_bytes_though_posted_while_it_ran(streaming: Any, compute: str,
                                                                           order: str) -> None:
    from kvlifecycle.adapters.vllm.metadata import StreamStep
    from kvlifecycle.transports.cuda_ipc import CudaIpcTransport

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    src = [torch.full((BLOCKS, BLOCK_BYTES), POISON, dtype=torch.uint8, device=device) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device=device) for _ in range(LAYERS)]
    suffix = time.monotonic_ns()
    tp, td = CudaIpcTransport(f"order-p-{suffix}"), CudaIpcTransport(f"order-d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.VRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BLOCK_BYTES,) * LAYERS))
    torch.cuda.synchronize()
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d")
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    layered = sc = None
    try:
        cons.connect(prod.address)
        layered = streaming.LayerStreaming(producer=prod, consumer=None, layers=LAYERS, regions_per_layer=1,
                                           layer_of={f"model.layers.{i}.self_attn.attn": i for i in range(LAYERS)},
                                           stream_timeout_s=WAIT_S, kv_device=device)
        sc = StreamConsumer(cons, options=StreamOptions(stream_timeout_s=WAIT_S))
        assert orders_on_device(tp)  # CUDA IPC orders on the device: the streamer hands it the event
        if order == "host wait":
            layered.producer._order_on_device = False  # as for NIXL: wait on the host, then a plain post
        fired_at_post: list[bool] = []  # per post_after: whether its layer's event had fired when it was made
        post_after = tp.post_after

        def watched_post_after(after: Any, *args: Any, **kwargs: Any) -> Any:
            fired_at_post.append(bool(after.query()))
            return post_after(after, *args, **kwargs)

        tp.post_after = watched_post_after  # type: ignore[method-assign]
        sl.allocate("key-r", P_IDS)
        tl.reserve("d-r", D_IDS)
        assert sc.request_stream("d-r", prod.address, layers=LAYERS, source_request="key-r")
        meta = SimpleNamespace(streams=[StreamStep("r", "key-r", tuple(P_IDS), len(P_IDS))])
        ids = torch.tensor(P_IDS, dtype=torch.long, device=device)
        weights = torch.randn((2048, 2048), device=device)
        stream = torch.cuda.Stream(device) if compute == "own stream" else torch.cuda.default_stream(device)
        running: list[bool] = []
        with torch.cuda.stream(stream):
            # each kernel's first launch loads its module, which may wait for the device: load them all first
            layer_work(weights, torch.zeros_like(src[0]), ids, cycles=1000, fill=POISON)
            torch.cuda.synchronize()
            for layer in range(LAYERS):
                weights = layer_work(weights, src[layer], ids, cycles=SLEEP_CYCLES, fill=tag(layer))
                layered.save_layer(f"model.layers.{layer}.self_attn.attn", meta)
                written = torch.cuda.Event()
                written.record(stream)
                running.append(not written.query())
        assert running[0], "the first layer finished before save_layer returned: the test proves nothing"
        done = threading.Event()
        assert layered.finished("r", "key-r", aborted=False, sending_done=done.set)
        assert until(lambda: sc.pending() == 0) and done.wait(WAIT_S)
        assert sc.counts["completed"] == 1 and (tl.state[D_IDS] == 3).all()
        d_ids = torch.tensor(D_IDS, dtype=torch.long, device=device)
        others = torch.tensor(sorted(set(range(BLOCKS)) - set(D_IDS)), dtype=torch.long, device=device)
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            landed = dst[layer][d_ids]
            poisoned = int((landed == POISON).sum())
            assert poisoned == 0, f"layer {layer}: {poisoned} bytes left P before the layer wrote them"
            assert bool((landed == tag(layer)).all()), f"layer {layer}: D's blocks do not hold the layer's tag"
            assert not dst[layer][others].any()  # no other D block written
        assert layered.producer.counts["layers_posted"] == LAYERS
        if order == "device":
            assert len(fired_at_post) == LAYERS
            # posted while its layer still ran: no host wait, the copy ordered on the device alone
            assert not all(fired_at_post), "every layer was done when posted: the device order went untested"
        else:
            assert fired_at_post == []
        sl.prefill_done("key-r")
        sl.free("key-r")
        tl.finish("d-r")
    finally:
        for part in (sc, layered, cons, prod, tp, td):
            if part is not None:
                part.close()
