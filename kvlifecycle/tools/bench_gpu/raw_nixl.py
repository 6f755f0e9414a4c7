"""(b) raw NIXL/UCX: two agents in this process, prepped descriptor lists, a READ of the same blocks as the other
paths (NIXL as its users run it, the comparison the CUDA IPC path is measured against)."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .in_process import InProcess
from .shapes import Shape, median


def bench_nixl(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], reps: int,
               peer_device: int | None = None) -> dict[str, Any]:
    """Raw NIXL/UCX READ of the same blocks. With ``peer_device`` (two GPUs) the owner's regions are a copy
    of the source on that device, so the READ crosses GPUs as the CUDA IPC path does."""
    from nixl._api import nixl_agent, nixl_agent_config

    out: dict[str, Any] = {}
    # Raw NIXL as users run it: default config (UCX, progress thread on, so the target side progresses too).
    cfg = nixl_agent_config(backends=["UCX"])
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    reader, owner = nixl_agent(f"bench-d-{stamp}", cfg), nixl_agent(f"bench-p-{stamp}", cfg)
    dev = ip.device.index
    owner_dev = dev if peer_device is None else peer_device
    owner_src = ip.src if owner_dev == dev else ip.src.to(torch.device("cuda", owner_dev))
    region_bytes = ip.pool * ip.block_bytes

    def descs(t: Any) -> np.ndarray:
        base = np.array([t[r].data_ptr() for r in range(ip.regions)], dtype=np.uint64)
        addr = (base[:, None] + np.arange(ip.pool, dtype=np.uint64)[None, :] * np.uint64(ip.block_bytes)).reshape(-1)
        return np.stack([addr, np.full_like(addr, ip.block_bytes), np.full_like(addr, t.device.index)], axis=1)

    def reg_rows(t: Any) -> list[tuple[int, int, int, str]]:
        return [(t[r].data_ptr(), region_bytes, t.device.index, "") for r in range(ip.regions)]

    reader.register_memory(reg_rows(ip.dst), "VRAM")
    owner.register_memory(reg_rows(owner_src), "VRAM")
    reader.add_remote_agent(owner.get_agent_metadata())
    local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", descs(ip.dst), "VRAM")
    remote = reader.prep_xfer_dlist(owner.name, descs(owner_src), "VRAM")
    regs = np.arange(ip.regions, dtype=np.int64)[:, None] * ip.pool
    times: list[float] = []
    exact = True
    for i in range(reps + 1):  # the first transfer connects and warms up
        s, d = sets[i % len(sets)]
        ip.poison(d)
        torch.cuda.synchronize(ip.device)
        handle = reader.make_prepped_xfer("READ", local, (regs + d[None, :]).reshape(-1).astype(np.int32),
                                          remote, (regs + s[None, :]).reshape(-1).astype(np.int32))
        t0 = time.perf_counter()
        state = reader.transfer(handle)
        while state == "PROC":
            state = reader.check_xfer_state(handle)
            if time.perf_counter() - t0 > 60:
                raise TimeoutError("NIXL transfer still in progress after 60 s")
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        torch.cuda.synchronize(ip.device)
        exact = exact and ip.check(s, d)
        reader.release_xfer_handle(handle)
        if i or elapsed > 10:
            times.append(elapsed)
        if elapsed > 10:  # too slow to repeat inside a lease: one figure is enough to compare
            break
    out["nixl_wall_s"] = median(times)
    out["nixl_exact"] = exact
    out["nixl_backend"] = "UCX"
    out["nixl_owner_device"] = owner_dev
    reader.remove_remote_agent(owner.name)
    del local, remote, reader, owner, owner_src  # destroying the agents stops their progress threads
    return out
