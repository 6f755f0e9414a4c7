"""The handoff worker with the layer-wise stream's commands, run in its own process (real NIXL, DRAM)."""

from __future__ import annotations

import time
from typing import Any

from kvlifecycle.tools.workers import HandoffWorker, WorkerConfig, WorkerProcess


class _FailingPosts:
    """The transport, except that posting a WRITE of ``layer``'s regions raises (a failure injected at layer k)."""

    def __init__(self, inner: Any, regions: list[int]) -> None:
        self._inner, self._regions = inner, set(regions)

    def post(self, op: Any, plan: Any, local: Any, remote: Any, *, regions: Any = None, **kw: Any) -> Any:
        from kvlifecycle.transport import TransferFailedError

        if regions is not None and set(int(r) for r in regions) == self._regions:
            raise TransferFailedError("injected: the write of this layer fails")
        return self._inner.post(op, plan, local, remote, regions=regions, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StreamWorker(HandoffWorker):
    streamer: Any = None

    def stream_setup(self, layers: int, regions_per_layer: int, stream_timeout_s: float = 60.0) -> None:
        from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer

        options = StreamOptions(regions_per_layer=regions_per_layer, stream_timeout_s=stream_timeout_s)
        if self.cfg.side == "producer":
            self.streamer = StreamProducer(self.role, layers=layers, options=options)
        else:
            self.streamer = StreamConsumer(self.role, options=options)

    def fail_writes_of_layer(self, layer: int) -> None:
        """Posts of ``layer``'s WRITE raise from now on (-1: none do), on every D's push path (streams begun
        after the call take it)."""
        import dataclasses

        rpl = self.streamer.options.regions_per_layer
        plans = self.role._push_plans
        for key, path in plans.items():
            inner = getattr(path.transport, "_inner", path.transport)
            failing = _FailingPosts(inner, list(range(layer * rpl, (layer + 1) * rpl)))
            plans[key] = dataclasses.replace(path, transport=inner if layer < 0 else failing)

    # -- P ----------------------------------------------------------------------------------------------------
    def allocate(self, request: str, blocks: list[int]) -> None:
        self.ledger.allocate(request, blocks)

    def begin(self, request: str) -> bool:
        return bool(self.streamer.begin(request))

    def prefill_ended(self, request: str) -> bool:
        return bool(self.streamer.prefill_ended(request))

    def layer(self, request: str, layer: int, blocks: list[int]) -> None:
        self.streamer.layer_done(request, layer, blocks)

    def prefill_done_release(self, request: str) -> None:
        self.ledger.prefill_done(request)
        self.streamer.release(request, lambda: self.ledger.free(request))

    def abort_release(self, request: str) -> None:
        self.streamer.cancel(request)
        self.streamer.release(request, lambda: self.ledger.cancel(request))

    def counts(self) -> dict[str, int]:
        return dict(self.streamer.counts)

    def wait_streams(self, timeout_s: float = 30.0) -> bool:
        """Until every stream settled (P: and was released), bounded."""
        deadline = time.monotonic() + timeout_s
        while self.streamer.pending() and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self.streamer.pending()

    def held(self) -> int:
        """Blocks not FREE in this side's ledger."""
        return int((self.ledger.state != 0).sum())

    # -- D ----------------------------------------------------------------------------------------------------
    def stream(self, request: str, address: str, layers: int, source: str | None = None) -> str | None:
        return self.streamer.request_stream(request, address, layers=layers, source_request=source)

    def stream_cancel(self, request: str) -> bool:
        return bool(self.streamer.cancel(request))

    def landed(self, transfer: str) -> int:
        """How many (block, layer) flags of ``transfer`` are set (-1: the load is no longer live)."""
        progress = self.ledger.layer_progress.get(transfer)
        return -1 if progress is None else int(progress.landed.sum())

    def wait_landed(self, transfer: str, want: int, timeout_s: float = 30.0) -> int:
        deadline = time.monotonic() + timeout_s
        got = self.landed(transfer)
        while 0 <= got < want and time.monotonic() < deadline:
            time.sleep(0.005)
            got = self.landed(transfer)
        return got

    def stop(self) -> dict[str, Any]:
        if self.streamer is not None:
            self.streamer.close()
        return super().stop()


class StreamWorkerProcess(WorkerProcess):
    """:class:`WorkerProcess` running a :class:`StreamWorker`."""

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg, StreamWorker)
