"""Pushes over the same-node fast path: P and D in two processes, VRAM KV on both sides, NIXL as each side's
transport and CUDA IPC beside it. D's push handshake offers its CUDA IPC metadata; P's ``SameNodeSelector`` picks
CUDA IPC for its writes (self-test passed), and a layer-wise stream lands on D through it, each layer's copy
ordered after the layer's CUDA event (``post_after``: P's streamer never waits on the host). With D's fast path
off, the same selection falls back to NIXL and the bytes still land.

Skipped without CUDA (``pytest -rs`` prints why). Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from typing import Any

import numpy as np
import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False")
BLOCKS, LAYERS, BLOCK_BYTES = 32, 4, 4096
P_BLOCKS, D_BLOCKS = [3, 1, 7, 12], [0, 5, 2, 30]
WAIT_S = 60.0


def _compat() -> Any:
    from kvlifecycle.handshake import CompatInfo

    return CompatInfo(
        model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1, kv_layout="NHD"
    )


def _transports(name: str, tensors: list[torch.Tensor], fast: bool) -> tuple[Any, Any]:
    from kvlifecycle.transports.nixl import NixlTransport
    from kvlifecycle.transports.select import cuda_ipc_fast_path

    from kvlifecycle.transport import KVLayout, MemoryKind

    layout = KVLayout(
        MemoryKind.VRAM,
        tensors[0].device.index or 0,
        BLOCKS,
        tuple(t.data_ptr() for t in tensors),
        (BLOCK_BYTES,) * len(tensors),
    )
    nixl = NixlTransport(f"{name}-{os.getpid()}-{time.monotonic_ns()}", probe_bytes=0)
    nixl.register(layout)
    import logging

    quick = (
        cuda_ipc_fast_path(layout, f"{nixl.agent}-ipc", logger=logging.getLogger("test"), who="test") if fast else None
    )
    assert quick is not None or not fast, "the CUDA IPC fast path could not be built"
    return nixl, quick


def _decode_process(conn: Any, address: str, fast: bool) -> None:
    """D: VRAM zeros, NIXL (+ CUDA IPC if ``fast``), a Consumer connected for push, one stream requested."""
    try:
        from kvlifecycle.transports.select import SameNodeSelector

        from kvlifecycle.handoff import Consumer, HandoffOptions
        from kvlifecycle.ledger import TargetLedger
        from kvlifecycle.streaming import StreamConsumer, StreamOptions

        torch.cuda.set_device(0)
        dst = [torch.zeros((BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda") for _ in range(LAYERS)]
        nixl, quick = _transports("d", dst, fast)
        ledger = TargetLedger(BLOCKS, worker="d")
        cons = Consumer(
            ledger,
            nixl,
            _compat(),
            options=HandoffOptions(probe=False),
            fast_transport=quick,
            path_selector=SameNodeSelector(),
        )
        sc = StreamConsumer(cons, options=StreamOptions(stream_timeout_s=WAIT_S))
        cons.connect(address)
        ledger.reserve("r", D_BLOCKS)
        conn.send(("requested", (sc.request_stream("r", address, layers=LAYERS), nixl.agent, nixl.epoch)))
        cmd = conn.recv()
        assert cmd == "wait", cmd
        deadline = time.monotonic() + WAIT_S
        while sc.pending() and time.monotonic() < deadline:
            time.sleep(0.002)
        torch.cuda.synchronize()
        idx = torch.tensor(D_BLOCKS, device="cuda").long()
        landed = [d[idx].cpu().numpy().tobytes() for d in dst]
        conn.send(("landed", (dict(sc.counts), landed, ledger.requests.get("r") is not None)))
        assert conn.recv() == "stop"
        for part in (sc, cons, nixl, *([quick] if quick is not None else [])):
            part.close()
        conn.send(("bye", None))
    except BaseException as exc:  # report, so the test fails with the reason instead of a timeout
        conn.send(("error", repr(exc)))


class DecodeProcess:
    def __init__(self, address: str, fast: bool) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_decode_process, args=(child, address, fast), daemon=True)
        self.proc.start()

    def recv(self, timeout_s: float = WAIT_S) -> Any:
        assert self.conn.poll(timeout_s), "the decode process did not answer"
        kind, body = self.conn.recv()
        if kind == "error":
            raise AssertionError(f"the decode process failed: {body}")
        return body

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(AssertionError, OSError, EOFError):
                self.conn.send("stop")
                self.recv(15)
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class EventReady:
    """A layer's readiness carrying its CUDA event (a :class:`DeviceLayerReady`); host waits are counted."""

    def __init__(self, event: torch.cuda.Event, waits: list[int], layer: int) -> None:
        self.device_event: object = event
        self._waits, self._layer = waits, layer

    def __call__(self, timeout_s: float, /) -> bool:
        self._waits.append(self._layer)
        self.device_event.synchronize()  # type: ignore[attr-defined]
        return True


def _stream(d_fast: bool) -> tuple[Any, list[torch.Tensor], Any, list[int]]:
    """P in this process streams one request into the D process; returns P's push path, P's KV, D's answer and
    the layers P's streamer waited for on the host."""
    from kvlifecycle.transports.select import SameNodeSelector

    from kvlifecycle.handoff import HandoffOptions, Producer
    from kvlifecycle.ledger import SourceLedger
    from kvlifecycle.streaming import StreamOptions, StreamProducer

    torch.cuda.set_device(0)
    gen = torch.Generator(device="cuda").manual_seed(5)
    src = [
        torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda", generator=gen)
        for _ in range(LAYERS)
    ]
    nixl, quick = _transports("p", src, True)
    ledger = SourceLedger(BLOCKS, worker="p", default_ttl_s=WAIT_S)
    prod = Producer(
        ledger,
        nixl,
        _compat(),
        options=HandoffOptions(probe=False),
        fast_transport=quick,
        path_selector=SameNodeSelector(),
    )
    sp = StreamProducer(prod, layers=LAYERS, options=StreamOptions(stream_timeout_s=WAIT_S))
    d = DecodeProcess(prod.address, d_fast)
    waits: list[int] = []
    try:
        transfer, d_agent, d_epoch = d.recv()
        assert transfer, "P declined the stream"
        path = prod.push_path(d_agent, d_epoch)
        assert path is not None
        ledger.allocate("r", P_BLOCKS)
        assert sp.begin("r")
        for layer in range(LAYERS):
            src[layer][torch.tensor(P_BLOCKS, device="cuda").long()] ^= 0x5A  # the layer's "compute", then its event
            event = torch.cuda.Event()
            event.record()
            sp.layer_done("r", layer, P_BLOCKS, EventReady(event, waits, layer))
        deadline = time.monotonic() + WAIT_S
        while sp.status("r").state != "complete" and time.monotonic() < deadline:
            time.sleep(0.002)
        assert sp.status("r").state == "complete", sp.status("r")
        d.conn.send("wait")
        answer = d.recv()
        return path, src, answer, waits
    finally:
        d.close()
        sp.close()
        prod.close()
        for t in (nixl, quick):
            if t is not None:
                t.close()


def _check_landed(src: list[torch.Tensor], answer: Any) -> None:
    counts, landed, still_reserved = answer
    assert counts["completed"] == 1 and counts["failed"] == 0, counts
    assert still_reserved  # READY_FOR_ATTENTION, not failed back to free
    idx = torch.tensor(P_BLOCKS, device="cuda").long()
    for layer in range(LAYERS):
        want = src[layer][idx].cpu().numpy()
        got = np.frombuffer(landed[layer], dtype=np.uint8).reshape(want.shape)
        assert np.array_equal(got, want), f"layer {layer}: {int(np.count_nonzero(got != want))} bytes differ"


@gpu
@pytest.mark.gpu
def test_a_layer_wise_stream_pushes_over_cuda_ipc_chosen_by_the_same_node_selector() -> None:
    path, src, answer, waits = _stream(d_fast=True)
    assert path.choice is not None and path.choice.backend == "cuda_ipc", path.choice
    assert path.transport.name == "cuda_ipc" and "self_test_us" in path.choice.measured
    _check_landed(src, answer)
    assert waits == []  # each layer's copy was ordered after its event on the device (post_after), no host wait


@gpu
@pytest.mark.gpu
def test_with_the_decodes_fast_path_off_the_selection_falls_back_to_nixl_and_the_bytes_land() -> None:
    path, src, answer, waits = _stream(d_fast=False)
    assert path.transport.name == "nixl" and path.choice is not None
    assert path.choice.backend == "nixl" and "no cuda_ipc metadata" in path.choice.reason, path.choice
    _check_landed(src, answer)
    assert waits == list(range(LAYERS))  # NIXL does not order on the device: the host waited for each layer
