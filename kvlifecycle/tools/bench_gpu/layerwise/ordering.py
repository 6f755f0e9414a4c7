"""How a layer's post is ordered after that layer's work, and how the harness reads the clock on each side of it.

- :class:`CudaOrder`: the layers run on a compute stream; after each one an event is recorded there. The layer's
  post is issued from a copy stream that first waits on that event, so the transport (which orders its own stream
  after the caller's current stream) starts the copy only once the layer's K and V are written, while the host has
  long moved on to enqueue the next layer. The copy's end is an event recorded on the transport's stream right
  after the post: ``last layer's event → that event`` is T_visible in device time.
- :class:`ThreadPoster`: the vLLM adapter's way (``kvlifecycle.adapters.layer_ready``): the forward thread records
  the layer's event and queues the post; a thread of its own waits on the event on the host and only then posts.
  It holds for any transport (NIXL reads the memory straight, ordering after no stream); what it costs is the
  wait's wake-up and the post's host time, which the device-side wait hides and this one adds to T_visible.
  With ``device_order`` (mode ``stream_device``) the thread does not wait: it hands the layer's event to the
  transport's ``post_after``, as the streamer does for a transport that orders on the device (CUDA IPC), so the
  copy starts on the device once the layer is written and the post's host time overlaps the layer.
- :class:`HostOrder`: on CPU a layer's work is done when its call returns, so the post simply follows it; the
  marks are host clock readings and there is no device time.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kvlifecycle.transport import TransferHandle


class CudaOrder:
    device_clock = True

    def __init__(self, torch: Any, device: Any, transfer_stream: Any) -> None:
        self.torch, self.device = torch, device
        self.compute = torch.cuda.Stream(device)
        self.copy = torch.cuda.Stream(device)
        self.transfer_stream = transfer_stream  # the transport's own stream, where its copies run

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        with self.torch.cuda.stream(self.compute):
            yield

    def mark(self) -> Any:
        """An event after everything enqueued on the compute stream so far."""
        event = self.torch.cuda.Event(enable_timing=True)
        event.record(self.compute)
        return event

    def post_after(self, mark: Any, post: Callable[[], TransferHandle]) -> tuple[TransferHandle, Any]:
        """``post()`` issued from the copy stream once it waited on ``mark``; (handle, the copy's end event)."""
        with self.torch.cuda.stream(self.copy):
            self.copy.wait_event(mark)
            handle = post()
        end = self.torch.cuda.Event(enable_timing=True)
        end.record(self.transfer_stream)
        return handle, end

    def done(self, mark: Any) -> bool:
        return bool(mark.query())

    def elapsed_ms(self, first: Any, second: Any) -> float:
        return float(first.elapsed_time(second))

    def synchronize(self) -> None:
        self.torch.cuda.synchronize(self.device)


LayerPost = Callable[[Any], TransferHandle]  # posts a layer, ordered after the event it is given (None: no order)


class ThreadPoster:
    """Posts queued by the forward thread, each made on this poster's thread once its layer's event completed
    (host wait), or at once with the event handed to the post (``device_order``)."""

    def __init__(self, torch: Any, device: Any, transfer_stream: Any, wait_s: float, *,
                 device_order: bool = False) -> None:
        from kvlifecycle.adapters.layer_ready import CudaLayerReady

        self.torch, self.transfer_stream, self.wait_s = torch, transfer_stream, wait_s
        self.device_order = device_order
        self.ready = CudaLayerReady(torch, device)
        self._jobs: queue.SimpleQueue[tuple[Any, LayerPost] | None] = queue.SimpleQueue()
        self._posted: queue.SimpleQueue[tuple[TransferHandle, Any] | BaseException] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="layerwise-poster", daemon=True)
        self._thread.start()

    def queue_post(self, post: LayerPost) -> None:
        """On the forward thread, inside ``computing()``: the layer just enqueued is the one ``post`` moves."""
        self._jobs.put((self.ready.record(), post))

    def take(self, count: int) -> list[tuple[TransferHandle, Any]]:
        """The next ``count`` posts made, in order: (handle, the copy's end event)."""
        out = []
        for _ in range(count):
            item = self._posted.get(timeout=self.wait_s)
            if isinstance(item, BaseException):
                raise RuntimeError(f"a queued post failed: {item!r}") from item
            out.append(item)
        return out

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            ready, post = job
            try:
                after = ready.device_event if self.device_order else None
                if after is None and not ready(self.wait_s):
                    raise TimeoutError(f"layer not computed within {self.wait_s} s")
                handle = post(after)
                end = self.torch.cuda.Event(enable_timing=True)
                end.record(self.transfer_stream)
                self._posted.put((handle, end))
            except BaseException as exc:  # handed to the forward thread, which raises it
                self._posted.put(exc)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(10.0)


class HostOrder:
    device_clock = False

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    @contextlib.contextmanager
    def computing(self) -> Iterator[None]:
        yield

    def mark(self) -> float:
        return time.perf_counter()

    def post_after(self, mark: float, post: Callable[[], TransferHandle]) -> tuple[TransferHandle, None]:
        return post(), None

    def done(self, mark: float) -> bool:
        return True

    def elapsed_ms(self, first: float, second: float) -> float:
        return (second - first) * 1e3

    def synchronize(self) -> None:
        pass
