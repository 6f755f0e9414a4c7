"""Layer-wise pushes through the handoff on the path the selector picked, side by side in one run (GPU machine).

P (this process) and D (a spawned process) each hold vLLM-sized VRAM KV regions, NIXL as their transport and CUDA
IPC beside it. For each repetition D reserves, asks P to stream, and P streams every layer (each layer's copy
ordered after its CUDA event, the layers ``--layer-gap-ms`` apart as a forward pass spaces them); once with D
offering its CUDA IPC metadata (``SameNodeSelector`` picks CUDA IPC) and once without (the same selection falls
back to NIXL). Printed: the path each took and why, and T_visible (the last layer's ``layer_done`` to D's load seen
complete on D, one monotonic clock across the two processes): every repetition, the median, and the NIXL / CUDA
IPC ratio of the medians.

    python bench/push_paths.py [--layers 32] [--blocks 64] [--block-bytes 16384] [--reps 5] [--layer-gap-ms 1]
                               [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

WAIT_S = 60.0


def _transports(name: str, tensors: list[Any], blocks: int, fast: bool) -> tuple[Any, Any]:
    from kvlifecycle.transports.nixl import NixlTransport
    from kvlifecycle.transports.select import cuda_ipc_fast_path

    from kvlifecycle.transport import KVLayout, MemoryKind

    layout = KVLayout(MemoryKind.VRAM, 0, blocks, tuple(t.data_ptr() for t in tensors),
                      (tensors[0][0].nbytes,) * len(tensors))
    nixl = NixlTransport(f"{name}-{os.getpid()}-{time.monotonic_ns()}", probe_bytes=0)
    nixl.register(layout)
    quick = cuda_ipc_fast_path(layout, f"{nixl.agent}-ipc", logger=logging.getLogger("bench"), who="bench") \
        if fast else None
    return nixl, quick


def _compat(layers: int) -> Any:
    from kvlifecycle.handshake import CompatInfo

    return CompatInfo(model_id="bench", dtype="bfloat16", num_layers=layers, num_kv_heads=8, head_size=128,
                      block_size=16, kv_layout="HND")


def _decode(conn: Any, address: str, fast: bool, args: argparse.Namespace) -> None:
    import torch
    from kvlifecycle.transports.select import SameNodeSelector

    from kvlifecycle.handoff import Consumer, HandoffOptions
    from kvlifecycle.ledger import TargetLedger
    from kvlifecycle.streaming import StreamConsumer, StreamOptions

    torch.cuda.set_device(0)
    total = 2 * args.blocks * (args.reps + 1)
    dst = [torch.zeros((total, args.block_bytes), dtype=torch.uint8, device="cuda") for _ in range(args.layers)]
    nixl, quick = _transports("d", dst, total, fast)
    ledger = TargetLedger(total, worker="d")
    cons = Consumer(ledger, nixl, _compat(args.layers), options=HandoffOptions(probe=False), fast_transport=quick,
                    path_selector=SameNodeSelector())
    sc = StreamConsumer(cons, options=StreamOptions(stream_timeout_s=WAIT_S))
    if args.d_idle_poll:  # the baseline of D's busy rhythm: notes over CUDA IPC found at D's idle poll
        cons.poll_fast_while.clear()
    cons.connect(address)
    conn.send((nixl.agent, nixl.epoch))
    for rep in range(args.reps + 1):  # the first one warms both sides up
        request = f"r{rep}"
        ledger.reserve(request, list(range(rep * args.blocks, (rep + 1) * args.blocks)))
        conn.send(sc.request_stream(request, address, layers=args.layers))
        deadline = time.monotonic() + WAIT_S
        while sc.pending() and time.monotonic() < deadline:
            time.sleep(0.0001)
        conn.send((time.perf_counter(), dict(sc.counts)))
        ledger.finish(request)  # decoded: its blocks go back
    assert conn.recv() == "stop"
    for part in (sc, cons, nixl, *([quick] if quick is not None else [])):
        part.close()


def measure(args: argparse.Namespace, d_fast: bool) -> dict[str, Any]:
    import torch
    from kvlifecycle.transports.select import SameNodeSelector

    from kvlifecycle.handoff import HandoffOptions, Producer
    from kvlifecycle.ledger import SourceLedger
    from kvlifecycle.streaming import StreamOptions, StreamProducer

    torch.cuda.set_device(0)
    src = [torch.randint(0, 256, (args.blocks, args.block_bytes), dtype=torch.uint8, device="cuda")
           for _ in range(args.layers)]
    nixl, quick = _transports("p", src, args.blocks, True)
    ledger = SourceLedger(args.blocks, worker="p", default_ttl_s=WAIT_S)
    prod = Producer(ledger, nixl, _compat(args.layers), options=HandoffOptions(probe=False), fast_transport=quick,
                    path_selector=SameNodeSelector())
    sp = StreamProducer(prod, layers=args.layers, options=StreamOptions(stream_timeout_s=WAIT_S))
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_decode, args=(child, prod.address, d_fast, args), daemon=True)
    proc.start()
    visible: list[float] = []
    try:
        agent, epoch = conn.recv()
        path = prod.push_path(agent, epoch)
        blocks = list(range(args.blocks))
        for rep in range(args.reps + 1):
            assert conn.recv(), "P declined the stream"
            request = f"r{rep}"
            ledger.allocate(request, blocks)
            assert sp.begin(request)
            last = 0.0
            for layer in range(args.layers):
                time.sleep(args.layer_gap_ms / 1e3)  # the layer's compute, on the host's clock: posts do not pile up
                event = torch.cuda.Event()
                event.record()
                last = time.perf_counter()
                sp.layer_done(request, layer, blocks, _Ready(event))
            done_at, counts = conn.recv()
            assert counts["completed"] == rep + 1, counts
            if rep:
                visible.append(done_at - last)
            deadline = time.monotonic() + WAIT_S
            while sp.status(request).state != "complete" and time.monotonic() < deadline:
                time.sleep(0.001)
            sp.release(request, lambda r=request: ledger.cancel(r))
            while request in ledger.requests and time.monotonic() < deadline:  # its blocks serve the next one
                time.sleep(0.001)
        conn.send("stop")
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        sp.close()
        prod.close()
        for t in (nixl, quick):
            if t is not None:
                t.close()
    nbytes = args.layers * args.blocks * args.block_bytes
    med = statistics.median(visible)
    return {"backend": path.transport.name if path else "none", "reason": path.choice.reason if path and path.choice
            else "", "bytes": nbytes, "t_visible_ms": [round(v * 1e3, 3) for v in visible],
            "t_visible_ms_median": round(med * 1e3, 3)}


class _Ready:
    """A layer's readiness carrying its CUDA event (the stream orders the copy after it where it can)."""

    def __init__(self, event: Any) -> None:
        self.device_event = event

    def __call__(self, timeout_s: float, /) -> bool:
        self.device_event.synchronize()
        return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=64, help="blocks per request")
    ap.add_argument("--block-bytes", type=int, default=16384, help="bytes per block and layer")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layer-gap-ms", type=float, default=1.0, help="time between two layers' ends (their compute)")
    ap.add_argument("--d-idle-poll", action="store_true",
                    help="D polls at its idle rhythm while streaming (the rhythm before Consumer.poll_fast_while)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    fast, slow = measure(args, d_fast=True), measure(args, d_fast=False)
    result = {"cuda_ipc": fast, "nixl": slow,
              "t_visible_ratio_nixl_over_cuda_ipc": round(slow["t_visible_ms_median"] / fast["t_visible_ms_median"], 1)}
    if args.json:
        print(json.dumps(result))
        return
    for name, r in (("offered", fast), ("not offered", slow)):
        print(f"D's CUDA IPC {name}: P pushed over {r['backend']} ({r['reason']}); {r['bytes'] / 2**20:.0f} MiB per "
              f"request; T_visible median {r['t_visible_ms_median']} ms {r['t_visible_ms']}")
    print(f"T_visible NIXL / CUDA IPC: {result['t_visible_ratio_nixl_over_cuda_ipc']}x")


if __name__ == "__main__":
    main()
