"""Run ``kvlifecycle bench gpu`` end to end without a GPU: a fast double, in a process of its own.

torch runs on the CPU with the few CUDA calls the benchmark makes stubbed (synchronize, events, streams, pinned
memory); the CUDA IPC transport is replaced by :class:`CopyingTransport`, which copies the blocks with torch at
``post`` and delivers its notification when ``poll`` first reports DONE. It plugs in at the seam the benchmark
has for it, :mod:`kvlifecycle.tools.bench_gpu.fastpath`, and the copy kernel runs its torch fallback. Everything
else is real: both ledgers with their logs, P in its own thread standing in for the spawned process, the rounds,
the replay and check, the summary and the verb's output. Usage: ``python tests/bench_gpu_on_cpu.py [ARGS]``;
prints what ``--json`` prints.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import multiprocessing
import queue
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvlifecycle.transport import LayoutWire, Notification, PeerMetadata, XferStatus


def _stub_cuda() -> None:
    cpu = torch.device("cpu")
    zeros = torch.zeros
    torch.device = lambda *args, **kwargs: cpu  # type: ignore[assignment,misc]
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *args: "CPU (bench_gpu_on_cpu)"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.set_device = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: SimpleNamespace(cuda_stream=0)  # type: ignore[assignment]
    torch.cuda.Event = _Event  # type: ignore[misc,assignment]
    torch.cuda._sleep = lambda cycles: None
    torch._C._cuda_getCurrentRawStream = lambda device: 0
    torch.zeros = lambda *args, pin_memory=False, **kwargs: zeros(*args, **kwargs)


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.1


def _view(addr: int, shape: tuple[int, ...], strides: Any = None) -> Any:
    """The CPU bytes at ``addr`` as a ``shape`` uint8 tensor (P and D share this process)."""
    n = int(np.prod(shape))
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=torch.uint8).view(*shape)


_AGENTS: dict[str, CopyingTransport] = {}
_HANDLE_IDS = itertools.count()


class CopyingTransport:
    """A same-process stand-in for the CUDA IPC transport: the same calls, torch copies on the CPU."""

    def __init__(self, agent: str, compiled_post: bool = True, **kwargs: Any) -> None:
        self.agent, self.epoch, self.compiled_post = agent, 1, compiled_post
        self.peers: dict[str, list[int]] = {}
        self.live: dict[int, SimpleNamespace] = {}
        self.inbox: list[tuple[str, Notification]] = []
        self.lock = threading.Lock()
        _AGENTS[agent] = self

    def register(self, layout: Any) -> None:
        self.layout = layout

    def local_metadata(self) -> PeerMetadata:
        lay = self.layout
        return PeerMetadata(self.agent, 1, "cuda_ipc", b"",
                            LayoutWire(lay.kind.value, 0, lay.num_blocks, list(lay.base_addrs), list(lay.block_bytes)))

    def add_peer(self, meta: PeerMetadata) -> str:
        self.peers[meta.agent] = list(meta.layout.base_addrs)
        self.peer = meta.agent
        return meta.agent

    def peer_info(self, peer: str) -> dict[str, Any]:
        return {"epoch": 1, "ipc_mappings": len(self.peers[peer])}

    def prepare(self, peer: str) -> Any:
        return SimpleNamespace(key=peer)

    def post(self, op: str, plan: Any, local: Any, remote: Any, notification: Any = None, transfer: Any = None) -> Any:
        shape = (self.layout.num_blocks, self.layout.block_bytes[0])
        for mine, theirs in zip(self.layout.base_addrs, self.peers[self.peer], strict=True):
            _view(mine, shape)[torch.from_numpy(np.asarray(local)).long()] = \
                _view(theirs, shape)[torch.from_numpy(np.asarray(remote)).long()]
        handle = SimpleNamespace(id=next(_HANDLE_IDS))
        now = time.perf_counter()
        self.live[handle.id] = SimpleNamespace(t_done=now, t_launched=now, note=notification, blocks=len(local),
                                               polls=0)
        return handle

    def post_batch(self, op: str, plan: Any, batch: list[Any]) -> list[Any]:
        return [self.post(op, plan, local, remote, note, transfer) for local, remote, note, transfer in batch]

    def poll(self, handle: Any) -> XferStatus:
        rec = self.live[handle.id]
        rec.polls += 1
        if rec.polls == 1:
            return XferStatus.PENDING  # the benchmark's poll loop goes round once
        if rec.polls == 2:
            peer = _AGENTS[self.peer]
            with peer.lock:
                peer.inbox.append((self.agent, rec.note))
        return XferStatus.DONE

    def error(self, handle: Any) -> str:
        return "no error"

    def stats(self, handle: Any) -> Any:
        blocks = self.live[handle.id].blocks
        return SimpleNamespace(t_post_s=1e-5, t_xfer_s=2e-5, bytes=blocks * sum(self.layout.block_bytes),
                               desc_count=blocks, backend="cpu-double")

    def stage_times(self, handle: Any) -> dict[str, float] | None:
        return {"to_launch": 1.0, "after_launch": 2.0}

    def release(self, handle: Any) -> None:
        pass

    def notifications(self) -> list[tuple[str, Notification]]:
        with self.lock:
            out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        pass


class _Driver:
    fast = SimpleNamespace(cuMemcpyDtoDAsync_v2=lambda *args: 0, cuEventRecord=lambda *args: 0,
                           cuEventQuery=lambda *args: 0)

    def event_create(self, timing: bool = False) -> int:
        return 1

    def event_destroy(self, event: int) -> None:
        pass


def _plug_in_the_double() -> None:
    from kvlifecycle.tools.bench_gpu import fastpath

    fastpath.CudaIpcTransport = CopyingTransport  # type: ignore[misc,assignment]
    fastpath.raw_cuda_array = _view
    fastpath.trace_stages = lambda transport: None
    fastpath.mapped_base_addrs = lambda transport, peer: transport.peers[peer]
    fastpath.driver = lambda transport: _Driver()
    fastpath.compiled_post_bound = lambda transport, plan: transport.compiled_post
    fastpath.launched_at = lambda transport, handle_id, default: transport.live[handle_id].t_launched
    fastpath.stage_marks = lambda transport: ("native", time.perf_counter()) if transport.compiled_post else ()
    fastpath.done_at = lambda transport, handle_id: transport.live[handle_id].t_done
    fastpath.BlockCopier.launch_ptrs = lambda self, *args: True  # no direct launch on the CPU: a no-op
    # the copy kernel's torch fallback views its regions through __cuda_array_interface__: on the CPU, directly
    from kvlifecycle.transports.cuda_ipc import triton_copy

    triton_copy._RawCudaArray = _view  # type: ignore[assignment,misc]


class _End:
    """One end of a two-queue pipe with ``multiprocessing.Connection``'s send/recv/poll."""

    def __init__(self, inbox: queue.Queue[Any], outbox: queue.Queue[Any]) -> None:
        self.inbox, self.outbox = inbox, outbox

    def send(self, msg: Any) -> None:
        self.outbox.put(msg)

    def recv(self) -> Any:
        return self.inbox.get(timeout=60)

    def poll(self, timeout: float = 0) -> bool:
        deadline = time.monotonic() + timeout
        while self.inbox.empty():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True


class _Thread:
    """P in a thread of this process, where the benchmark spawns a process."""

    def __init__(self, target: Any, args: tuple[Any, ...], daemon: bool = True) -> None:
        self.thread = threading.Thread(target=target, args=args, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: float | None = None) -> None:
        self.thread.join(timeout)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def kill(self) -> None:
        pass


def _pipe() -> tuple[_End, _End]:
    a: queue.Queue[Any] = queue.Queue()
    b: queue.Queue[Any] = queue.Queue()
    return _End(a, b), _End(b, a)


def main() -> int:
    _stub_cuda()
    multiprocessing.get_context = lambda method=None: SimpleNamespace(Pipe=_pipe, Process=_Thread)  # type: ignore
    _plug_in_the_double()
    from kvlifecycle.tools.bench_gpu import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(["--json", "--regions", "4", "--blocks", "8", "--small-blocks", "2", "--block-kib", "1",
                              "--pool-blocks", "64", "--reps", "4", "--pipeline", "4", "--no-nixl",
                              "--dir", tempfile.mkdtemp(prefix="kvl-bench-gpu-cpu-"), *sys.argv[1:]])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
