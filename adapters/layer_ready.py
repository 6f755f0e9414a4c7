"""A layer's readiness on a CUDA device, for engines that stream KV layer by layer (the core's ``LayerReady``).

An engine's layer hook returns once the layer's kernels are enqueued, not done: a transport that posted the layer's
blocks then could move them before the layer wrote them (NIXL reads the memory straight; the CUDA IPC transport
orders after the posting thread's current stream, which is not the forward's). So the hook records an event on
the forward's current stream and hands its wait with the post; the streamer's thread waits on it before posting,
or, where the transport orders its copies on the device (CUDA IPC), hands the event with the post and does not
wait at all (the readiness carries it as ``device_event``).
Importable without the engine (the layer-wise GPU benchmark runs this very path).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kvlifecycle.streaming.producer import DeviceLayerReady


class CudaLayerReady:
    """A layer's readiness on a CUDA device: :meth:`record` (forward thread) puts an event on the current stream,
    the one the layer's kernels were just enqueued on; the callable it returns (streamer's thread) polls that event
    until a deadline. Polled, not ``Event.synchronize()``: that has no bound, and a device fault would hang the
    streamer's thread, and with it every release waiting behind it.

    The thread that waits gets a stream of its own as its current stream: the CUDA IPC transport orders each copy
    after the posting thread's current stream, which would otherwise be the device's default stream, where vLLM's
    forward runs; the copy would then wait for every layer enqueued by the time of the post, not just its own."""

    POLL_S = 20e-6  # between queries: a layer's copy starts at most about this (plus the sleep's slack) late

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch, self._device = torch, device
        self._idle_stream = torch.cuda.Stream(device)
        self._waiter = threading.local()

    def record(self) -> DeviceLayerReady:
        """After a layer was enqueued: its readiness (one event serves every request of the step), a host wait
        that also carries the event for a transport that orders after it on the device."""
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self._device))
        return _LayerEvent(self, event)

    def _wait(self, event: Any, timeout_s: float) -> bool:
        if not getattr(self._waiter, "stream_set", False):
            self._torch.cuda.set_stream(self._idle_stream)
            self._waiter.stream_set = True
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(self.POLL_S)
        return True


class _LayerEvent:
    """One layer's readiness: called, the bounded host wait; ``device_event``, the event itself."""

    __slots__ = ("_owner", "device_event")

    def __init__(self, owner: CudaLayerReady, event: Any) -> None:
        self._owner, self.device_event = owner, event

    def __call__(self, timeout_s: float, /) -> bool:
        return self._owner._wait(self.device_event, timeout_s)
