"""SGLang's layout on a GPU (VRAM pages, host-memory aux rows): one request's post over NIXL alone against the split
fast path (CUDA IPC over the pages, NIXL over the row), side by side in one process, one run.

    python bench/sglang_gpu_paths.py [--pages 64] [--page-kib 256] [--regions 8] [--reps 20] [--json]

Needs CUDA and NIXL (run it through ``bench/gpu_run.sh sglang-paths``). Each repetition READs the same pages and
one aux row from P's buffers into D's, through each path in turn, bytes checked once per path; it prints the median
time of a post from ``post`` to DONE per path, and their ratio. P's transports are told to expect activity before
each repetition, as P's ``Producer`` tells them when D claims a lease (NIXL serves a READ of its memory only as
often as it polls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from kvlifecycle.adapters.sglang.transfer import DataPlane, layouts
from kvlifecycle.transports.select import SameNodeSelector

from kvlifecycle.layout import group_start
from kvlifecycle.transport import MemoryKind, XferStatus

ROWS, ROW_BYTES, AUX_REGIONS = 8, 256, 2
WAIT_S = 60.0


class Worker:
    def __init__(self, name: str, pages: int, page_bytes: int, regions: int, fill: bool) -> None:
        make = torch.randint if fill else None
        self.kv = [(make(0, 256, (pages, page_bytes), dtype=torch.uint8) if make else
                    torch.zeros((pages, page_bytes), dtype=torch.uint8)).to("cuda:0") for _ in range(regions)]
        self.aux = [np.random.default_rng(1).integers(0, 256, (ROWS, ROW_BYTES), dtype=np.uint8) if fill else
                    np.zeros((ROWS, ROW_BYTES), dtype=np.uint8) for _ in range(AUX_REGIONS)]
        torch.cuda.synchronize()
        self.layout = layouts([t.data_ptr() for t in self.kv], [t.numel() for t in self.kv], [page_bytes] * regions,
                              [a.ctypes.data for a in self.aux], [a.nbytes for a in self.aux],
                              [ROW_BYTES] * AUX_REGIONS, kind=MemoryKind.VRAM, device_id=0, aux_kind=MemoryKind.DRAM)
        self.plane = DataPlane(name, 1, self.layout)


def timed_read(transport, plan, local, remote) -> float:
    t0 = time.perf_counter()
    handle = transport.post("READ", plan, local, remote)
    deadline = time.monotonic() + WAIT_S
    while transport.poll(handle) is XferStatus.PENDING and time.monotonic() < deadline:
        # a GIL-free pause, as the handoff's loops take: a bare spin holds the GIL, and NIXL's service thread then
        # waits out the 5 ms switch interval at each step (measured: a one-row READ 11 ms spinning, 0.25 ms so)
        time.sleep(50e-6)
    seconds = time.perf_counter() - t0
    assert transport.poll(handle) is XferStatus.DONE, transport.error(handle)
    transport.release(handle)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--page-kib", type=int, default=256)
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    page_bytes = args.page_kib * 1024
    p = Worker("bench-p", args.pages, page_bytes, args.regions, True)
    d = Worker("bench-d", args.pages, page_bytes, args.regions, False)
    local = [*range(args.pages), group_start(d.layout, 1) + 3]
    remote = [*reversed(range(args.pages)), group_start(p.layout, 1) + 5]
    nixl = d.plane.transport
    nixl_plan = nixl.prepare(nixl.add_peer(p.plane.transport.local_metadata()))
    path = SameNodeSelector().select(nixl, d.plane.fast_transport, p.plane.fast_transport.local_metadata())
    assert path.transport is d.plane.fast_transport, path.choice
    split_plan = path.transport.prepare(path.peer)
    paths = {"nixl": (nixl, nixl_plan), "split": (path.transport, split_plan)}
    times: dict[str, list[float]] = {name: [] for name in (*paths, "split_pages", "split_row")}
    for transport, plan in paths.values():  # warm each path, and check its bytes once
        for tensor in d.kv:
            tensor.zero_()
        torch.cuda.synchronize()
        timed_read(transport, plan, local, remote)
        torch.cuda.synchronize()
        order = list(reversed(range(args.pages)))
        assert all(torch.equal(dk[: args.pages], pk[order]) for dk, pk in zip(d.kv, p.kv, strict=True))
        assert all(np.array_equal(da[3], pa[5]) for da, pa in zip(d.aux, p.aux, strict=True))
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        for t in (p.plane.transport, p.plane.fast_transport):  # as P's Producer does when D claims a lease
            t.expect_activity(5.0)
        for name, (transport, plan) in paths.items():
            times[name].append(timed_read(transport, plan, local, remote))
        # where the split's time goes: its pages alone (CUDA IPC), its row alone (NIXL)
        times["split_pages"].append(timed_read(path.transport, split_plan, local[:-1], remote[:-1]))
        times["split_row"].append(timed_read(path.transport, split_plan, local[-1:], remote[-1:]))
    nbytes = args.pages * args.regions * page_bytes + AUX_REGIONS * ROW_BYTES
    moved = {"split_pages": nbytes - AUX_REGIONS * ROW_BYTES, "split_row": AUX_REGIONS * ROW_BYTES}
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    result = {"bytes": nbytes, "reps": args.reps, "choice": path.choice.backend if path.choice else None,
              **{f"{name}_median_ms": round(m * 1e3, 3) for name, m in medians.items()},
              **{f"{name}_gbps": round(moved.get(name, nbytes) / m / 1e9, 2) for name, m in medians.items()},
              "split_over_nixl_time": round(medians["split"] / medians["nixl"], 4)}
    if args.json:
        print(json.dumps(result))
    else:
        for name, m in medians.items():
            print(f"{name:11s} {m * 1e3:9.3f} ms  {moved.get(name, nbytes) / m / 1e9:8.2f} GB/s")
        print(f"split / nixl time: {result['split_over_nixl_time']}  ({result['choice']}, {nbytes} bytes, "
              f"{args.reps} reps)")
    for w in (d, p):
        w.plane.close()


if __name__ == "__main__":
    main()
