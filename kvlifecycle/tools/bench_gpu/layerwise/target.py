"""D's half: a spawned process that owns the destination caches, exports them (CUDA IPC) or registers them (NIXL on
DRAM), and notes when each copy's notification arrives. P pushes into its blocks; D only answers P's commands:

- ``("poison", ids)``: fill those blocks with the poison value (before a checked run), reply when done;
- ``("digest", ids)``: per layer, a SHA-256 of those blocks (compared with P's);
- ``("arrival", transfer)``: the host clock (``time.perf_counter``, system-wide monotonic on Linux, so comparable
  with P's) when the notification of ``transfer`` arrived, waiting for it if need be (bounded);
- ``("stop",)``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

WAIT_S = 30.0


def d_main(conn: Any, cfg: dict[str, Any]) -> None:
    try:
        _serve(conn, cfg)
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _serve(conn: Any, cfg: dict[str, Any]) -> None:
    import msgspec
    import torch

    from kvlifecycle.transport import PeerMetadata

    from .model import ModelShape, caches_layout, digests, poison, vllm_caches

    shape = ModelShape(**cfg["shape"])
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    caches = vllm_caches(torch, shape, device)
    transport = _transport(device, f"layerwise-d-{os.getpid()}")
    transport.register(caches_layout(caches))
    conn.send(("meta", msgspec.msgpack.encode(transport.local_metadata())))
    transport.add_peer(msgspec.msgpack.decode(conn.recv(), type=PeerMetadata))
    arrived: dict[str, float] = {}
    # spin where cores are plenty (the GPU host): an arrival is then seen within microseconds
    pause = 0.0 if cfg.get("spin") else 20e-6
    try:
        while True:
            for _sender, note in transport.notifications():
                arrived[note.transfer] = time.perf_counter()
            if not conn.poll(0):
                time.sleep(pause)
                continue
            cmd, *args = conn.recv()
            if cmd == "poison":
                ids = torch.as_tensor(args[0], device=device, dtype=torch.long)
                poison(caches, ids)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                conn.send(("poisoned", None))
            elif cmd == "digest":
                conn.send(("digest", digests(torch, caches, torch.as_tensor(args[0], device=device,
                                                                             dtype=torch.long))))
            elif cmd == "arrival":
                conn.send(("arrival", _arrival(transport, arrived, args[0])))
            elif cmd == "stop":
                break
    finally:
        transport.close()
    conn.send(("bye", None))


def _arrival(transport: Any, arrived: dict[str, float], transfer: str) -> float | None:
    deadline = time.monotonic() + WAIT_S
    while transfer not in arrived and time.monotonic() < deadline:
        for _sender, note in transport.notifications():
            arrived[note.transfer] = time.perf_counter()
        time.sleep(20e-6)
    return arrived.pop(transfer, None)


def _transport(device: Any, agent: str) -> Any:
    """CUDA IPC for VRAM; NIXL (UCX) for DRAM, where the harness runs without a GPU."""
    if device.type == "cuda":
        from kvlifecycle.transports.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(agent)
    from kvlifecycle.transports.nixl import NixlTransport

    return NixlTransport(agent)
