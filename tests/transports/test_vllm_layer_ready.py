"""The vLLM adapter's layer readiness (no GPU, no vLLM needed: the adapter's vLLM imports are stubbed when vLLM is
absent, and ``torch.cuda`` is a fake): on a CUDA device ``save_kv_layer`` records an event on the forward's current
stream and hands its wait with the layer's post; the wait is bounded and runs on the streamer's thread from a
stream of its own; on CPU no readiness is handed (the KV is written when the layer returns). The GPU run of the
same path is test_cuda_layer_stream_order.py.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from vllm_stubs import vllm_or_stubs


@pytest.fixture
def streaming(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's streaming module, imported against vLLM or its stubs."""
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm import streaming

        yield streaming


class FakeEvent:
    """Done after ``polls`` queries, or never (``None``)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.queries, self.recorded_on = polls, 0, None

    def record(self, stream: Any) -> None:
        self.recorded_on = stream

    def query(self) -> bool:
        self.queries += 1
        return self.polls is not None and self.queries > self.polls


def fake_torch(events: list[FakeEvent], current: dict[int, Any]) -> Any:
    def set_stream(stream: Any) -> None:
        current[threading.get_ident()] = stream

    cuda = SimpleNamespace(Stream=lambda device: ("idle", device), Event=lambda: events.pop(0),
                           current_stream=lambda device: current.get(threading.get_ident(), ("default", device)),
                           set_stream=set_stream)
    return SimpleNamespace(cuda=cuda)


def test_cuda_readiness_records_on_the_forward_stream_and_polls_on_an_idle_one(streaming: Any) -> None:
    events, current = [FakeEvent(3), FakeEvent(None)], {}
    ready = streaming.CudaLayerReady(fake_torch(list(events), current), "cuda:1")
    current[threading.get_ident()] = ("compute", "cuda:1")  # the forward thread's current stream
    layer_a, layer_b = ready.record(), ready.record()
    assert [e.recorded_on for e in events] == [("compute", "cuda:1")] * 2
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.extend([layer_a(5.0), layer_b(0.05)]))
    waiter.start()
    waiter.join(10.0)
    assert results == [True, False]  # the second never completes: the wait gives up at its bound
    assert events[0].queries == 4 and events[1].queries > 1
    # the waiting thread posts from a stream of its own; the forward thread's stream is untouched
    assert current[waiter.ident] == ("idle", "cuda:1")
    assert current[threading.get_ident()] == ("compute", "cuda:1")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_save_layer_hands_one_readiness_per_layer_on_cuda_and_none_on_cpu(streaming: Any, device: str) -> None:
    from kvlifecycle.adapters.vllm.metadata import StreamStep

    seen: list[Any] = []
    producer = SimpleNamespace(begin=lambda key: True, streaming=lambda key: True,
                               layer_done=lambda key, layer, blocks, ready: seen.append((key, layer, ready)))
    layered = streaming.LayerStreaming(producer=None, consumer=None, layers=2, regions_per_layer=1,
                                       layer_of={"l0": 0, "l1": 1}, stream_timeout_s=1.0,
                                       kv_device=SimpleNamespace(type="cpu"))
    layered.producer = producer  # the step logic alone, without a side channel
    events: list[FakeEvent] = []
    if device == "cuda":  # what the constructor builds for a CUDA device, over the fake torch
        events = [FakeEvent(0), FakeEvent(0)]
        layered._ready = streaming.CudaLayerReady(fake_torch(list(events), {}), "cuda:0")
    meta = SimpleNamespace(streams=[StreamStep("a", "key-a", (4, 5), 2), StreamStep("b", "key-b", (6,), 1)])
    layered.save_layer("l0", meta)
    layered.save_layer("l1", meta)
    assert [(key, layer) for key, layer, _ in seen] == [("key-a", 0), ("key-b", 0), ("key-a", 1), ("key-b", 1)]
    readies = [ready for _, _, ready in seen]
    if device == "cpu":
        assert readies == [None] * 4  # the KV is written when the layer returns
    else:  # one event per layer, shared by the step's requests, recorded on the forward's stream
        assert readies[0] is readies[1] and readies[2] is readies[3] and readies[0] is not readies[2]
        assert [e.recorded_on for e in events] == [("default", "cuda:0")] * 2
        assert all(ready(1.0) for ready in readies)
