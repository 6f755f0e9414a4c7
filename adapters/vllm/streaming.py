"""Layer-wise streaming in the vLLM worker: the glue between vLLM's per-layer hooks and :mod:`kvlifecycle.streaming`.

P: each step's metadata names the streaming requests in its forward and the blocks each layer completes
(:class:`.metadata.StreamStep`); the first step of a request decides whether it streams (D's reservation is there)
or falls back to the post-prefill grant. ``save_kv_layer`` runs after each attention layer returned and only queues
the layer's post for the streamer's thread. On CPU the layer's KV is in the cache then. On a GPU the layer is only
enqueued: save_kv_layer records an event on the forward's current (compute) stream, and the streamer's thread waits
on it (bounded) before posting (:class:`CudaLayerReady`), so no transport, whether it orders after a stream (CUDA
IPC) or reads the memory straight (NIXL), can move the layer's blocks before the layer wrote them. At
``request_finished`` a streamed request is not granted: its blocks go back to vLLM (``finished_sending``) once its
writes settled.

D: a layer-wise recv reserves, then asks P to stream into the reservation; a declined stream (P began first)
falls back to the configured post-prefill path into the same blocks. The load completes through the target
ledger's ``TgtPartDone`` like any other, which the worker already reports as ``finished_recving``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer

from ..layer_ready import CudaLayerReady
from .metadata import StreamStep

log = logging.getLogger("kvlifecycle.adapters.vllm")


def layer_indices(names: list[str], data_ptrs: list[int]) -> dict[str, int]:
    """Layer name -> layer index in the registration order (sorted by name; layers sharing a cache share it)."""

    def key(name: str) -> tuple[Any, ...]:
        return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))

    index: dict[int, int] = {}
    out: dict[str, int] = {}
    for name, ptr in sorted(zip(names, data_ptrs, strict=True), key=lambda pair: key(pair[0])):
        out[name] = index.setdefault(ptr, len(index))
    return out


class LayerStreaming:
    """One worker's streaming state: P's streamer and this step's streaming requests, or D's stream consumer.
    ``kv_device``: the caches' device (a ``torch.device``); on a CUDA device each layer's post waits for the
    layer's event (:class:`CudaLayerReady`)."""

    def __init__(self, *, producer: Any, consumer: Any, layers: int, regions_per_layer: int,
                 layer_of: dict[str, int], stream_timeout_s: float, kv_device: Any = None) -> None:
        # a reservation P keeps unbegun must outlast the write window D asks for (0.8 of its timeout)
        options = StreamOptions(regions_per_layer=regions_per_layer, stream_timeout_s=stream_timeout_s,
                                reservation_ttl_s=max(60.0, stream_timeout_s))
        self.layers, self.layer_of = layers, layer_of
        self._ready: CudaLayerReady | None = None
        if producer is not None and getattr(kv_device, "type", "cpu") == "cuda":
            import torch  # the adapter's side: the core only sees the readiness callable

            self._ready = CudaLayerReady(torch, kv_device)
        self.producer = StreamProducer(producer, layers=layers, options=options) if producer is not None else None
        self.consumer = StreamConsumer(consumer, options=options) if consumer is not None else None
        self._step: list[tuple[str, np.ndarray]] = []  # P: (stream key, complete blocks) in this step's forward
        self._step_meta: object = None  # the metadata ``_step`` was read from (one object per step)
        self._key_of: dict[str, str] = {}  # P: vLLM request -> stream key, while it may stream

    # -- P, forward thread -------------------------------------------------------------------------------------
    def on_step(self, steps: list[StreamStep]) -> None:
        """A forward's first layer returned: which requests stream in it. Never waits: a reservation not there
        yet may join until the request's prefill ended, else it is a fallback."""
        self._step = []
        if self.producer is None:
            return
        for step in steps:
            if step.request not in self._key_of:
                self._key_of[step.request] = step.stream_key
                self.producer.begin(step.stream_key)  # False: D's reservation may still join before the end
            if step.complete:  # also while not streaming yet: a reservation that joins catches up on these
                self._step.append((step.stream_key, np.asarray(step.block_ids[: step.complete], dtype=np.int32)))

    def save_layer(self, layer_name: str, meta: Any) -> None:
        """After attention layer ``layer_name`` of the step ``meta`` describes returned: queue its post for every
        streaming request (the step's first layer also decides which requests stream). On a GPU the post carries
        the layer's event: the streamer hands it to a transport that orders on the device (CUDA IPC) or waits on it
        first (NIXL); this thread never waits."""
        if meta is not self._step_meta:
            self._step_meta = meta
            self.on_step(meta.streams)
        if not self._step or self.producer is None:
            return
        layer = self.layer_of.get(layer_name)
        if layer is None:
            return
        ready = self._ready.record() if self._ready is not None else None
        for key, blocks in self._step:
            self.producer.layer_done(key, layer, blocks, ready)

    def finished(self, request: str, key: str, *, aborted: bool, sending_done: Callable[[], None]) -> bool:
        """P's request ended: True if it streamed (its blocks go back through ``sending_done`` once its writes
        settled; no grant), False for the post-prefill path."""
        self._key_of.pop(request, None)
        if self.producer is None or not self.producer.prefill_ended(key, aborted=aborted):
            if aborted:
                sending_done()  # nothing was written: vLLM frees the blocks now
                return True
            return False
        if aborted:
            self.producer.cancel(key, "aborted on P")
        self.producer.release(key, sending_done)
        return True

    # -- D, adapter thread -------------------------------------------------------------------------------------
    def request(self, request: str, address: str, key: str) -> bool:
        """Ask P to stream into ``request``'s reservation; False when declined (the caller's fallback)."""
        assert self.consumer is not None
        return self.consumer.request_stream(request, address, layers=self.layers, source_request=key) is not None

    def cancel(self, request: str) -> bool:
        """D aborted ``request``: if it is streaming, cancel it (P is told to stop) and return True."""
        if self.consumer is None or not self.consumer.streaming(request):
            return False
        self.consumer.cancel(request, "aborted on D")
        return True

    def close(self) -> None:
        for part in (self.producer, self.consumer):
            if part is not None:
                part.close()
