"""(a), P's half: a spawned process that owns the source regions, exports them through the CUDA IPC transport and
runs a :class:`SourceLedger` with a log: it grants what D asks for and releases each lease on D's notification."""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import numpy as np


def p_main(conn: Any, cfg: dict[str, Any]) -> None:
    """P: regions in their own allocations, a SourceLedger with a log, the CUDA IPC transport."""
    try:
        transport, ledger, _regions = _p_connect(conn, cfg)  # the exported allocations: alive until P returns
        rng = np.random.default_rng(cfg["seed"])
        counter = 0
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, count, n = msg
            counter = _p_round(conn, transport, ledger, rng, cfg["pool"], count, n, counter)
        transport.close()
        ledger.log.close()
        conn.send(("bye", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _p_connect(conn: Any, cfg: dict[str, Any]) -> tuple[Any, Any, list[Any]]:
    """P's regions, registered (IPC export), its ledger, and D added as a peer: (transport, ledger, regions)."""
    import msgspec
    import torch

    from kvlifecycle.ledger import open_ledger
    from kvlifecycle.transport import KVLayout, MemoryKind, PeerMetadata

    from .fastpath import CudaIpcTransport

    device = torch.device("cuda", cfg["device"])
    torch.cuda.set_device(device)
    pool, bb = cfg["pool"], cfg["block_bytes"]
    gen = torch.Generator(device=device).manual_seed(cfg["seed"])
    regions = [torch.randint(0, 256, (pool, bb), dtype=torch.uint8, device=device, generator=gen)
               for _ in range(cfg["regions"])]
    torch.cuda.synchronize(device)
    layout = KVLayout(MemoryKind.VRAM, device.index or 0, pool, tuple(t.data_ptr() for t in regions),
                      tuple(bb for _ in regions))
    transport = CudaIpcTransport(f"bench-p-{os.getpid()}")
    transport.register(layout)
    ledger = open_ledger("source", pool, cfg["log_dir"] + "/p", worker="p0")
    conn.send(("meta", msgspec.msgpack.encode(transport.local_metadata())))
    _, raw = conn.recv()
    transport.add_peer(msgspec.msgpack.decode(raw, type=PeerMetadata))
    return transport, ledger, regions


def _p_round(conn: Any, transport: Any, ledger: Any, rng: np.random.Generator, pool: int, count: int, n: int,
             counter: int) -> int:
    """``count`` requests of ``n`` blocks: allocated, prefilled and granted; each lease released on D's "done"
    notification, P's round trip (grant → lease released) timed. Returns the next request number."""
    picks = rng.permutation(pool)[: count * n].astype(np.int32).reshape(count, n)
    grants, t_grant = [], {}
    for i in range(count):
        name = f"r{counter}"
        counter += 1
        ledger.allocate(name, picks[i])
        ledger.prefill_done(name)
        t_grant[name] = time.perf_counter()
        g = ledger.grant(name, ttl_s=30.0)
        grants.append((name, g.transfer, g.generation, picks[i]))
    conn.send(("grants", grants))
    waiting = {g[1]: g for g in grants}
    roundtrip = []
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        notes = transport.notifications()
        if not notes:
            time.sleep(20e-6)  # P idles between completions; do not steal D's core
        for _sender, note in notes:
            if note.kind == "done" and note.transfer in waiting:
                _name, transfer, generation, _ = waiting.pop(note.transfer)
                ledger.consumer_done(transfer, generation)
                for released in ledger.take_released():
                    ledger.free(released.request)
                    roundtrip.append(time.perf_counter() - t_grant[released.request])
    ledger.commit()
    conn.send(("released", roundtrip, sorted(waiting)))
    return counter
