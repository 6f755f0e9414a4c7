"""Where a lone post's host time goes on a GPU host: each driver call alone, the compiled post, and alternatives.

    python bench/driver_costs.py [--reps 400] [--json]

Needs CUDA and Triton (run it through ``bench/gpu_run.sh driver``). Prints medians in µs for 16 and 256 blocks of
64 regions × 32 KiB (the issue's two request sizes), plus the Python-side costs that share the latency path (the
target ledger's ``start_load``/``part_done`` and a ctypes call) so hosts can be compared with this machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle.tools.progress import progress

METRICS = ("event_record_timing", "event_record_plain", "stream_wait_event", "memcpy_ids", "launch_kernel",
           "stream_query_idle", "compiled_post_call", "lone_compiled_post", "graph_launch", "lone_order_graph",
           "graph_set_kernel_params_and_launch", "lone_ceiling_dtod", "lone_kernel_only", "lone_ids_launch_end",
           "lone_graph_only", "graph_nodes")


def python_costs(reps: int) -> dict[str, float]:
    """Host-CPU calibration: the ledger commands on a lone request's latency path, and ctypes call overheads."""
    from kvlifecycle.transports.cuda_ipc import native_post

    from kvlifecycle.ledger import open_ledger

    with tempfile.TemporaryDirectory() as d:
        ledger = open_ledger("target", 4096, d + "/d", worker="d0")
        ids = np.arange(16, dtype=np.int32)
        rows = []
        for i in range(reps):
            ledger.reserve(f"r{i}", ids)
            t0 = time.perf_counter()
            ledger.start_load(f"r{i}", f"t{i}", generation=1, peer="p", peer_epoch=1)
            t1 = time.perf_counter()
            ledger.part_done(f"t{i}")
            t2 = time.perf_counter()
            ledger.finish(f"r{i}")
            rows.append((t1 - t0, t2 - t1))
            if i % 64 == 0:
                ledger.commit()
        ledger.log.close()
    lib = native_post.load_library(init_cuda=False)
    staging, ring = np.zeros(64, dtype=np.int64), np.zeros(64, dtype=np.int32)
    a, b = staging.ctypes.data, ring.ctypes.data
    t0 = time.perf_counter()
    for _ in range(reps):
        lib.kvl_check_and_narrow(a, b, 16, 16, 100, 100)
    six = (time.perf_counter() - t0) / reps
    desc = native_post.KernelDesc()
    addr = ctypes.addressof(desc)
    t0 = time.perf_counter()
    for _ in range(reps):
        lib.kvl_kernel_bind(addr)
    one = (time.perf_counter() - t0) / reps
    med = np.median(np.array(rows), axis=0) * 1e6
    return {"start_load_us": round(float(med[0]), 2), "part_done_us": round(float(med[1]), 2),
            "ctypes_6_args_us": round(six * 1e6, 2), "ctypes_1_arg_us": round(one * 1e6, 2)}


def driver_costs(reps: int) -> dict[str, dict[str, float]]:
    import torch
    from kvlifecycle.transports.cuda_ipc import CudaIpcTransport, native_post

    from kvlifecycle.transport import KVLayout, MemoryKind, XferOp

    src_c = Path(__file__).with_name("driver_costs.c")
    lib = ctypes.CDLL(str(native_post.build(src_c, out_dir=Path(tempfile.mkdtemp()))))
    if lib.kvl_bench_init() != 0:
        raise SystemExit("kvl_bench_init failed (libcuda or a graph function missing)")
    regions, pool, bb = 64, 512, 32 * 1024
    dev = torch.device("cuda", 0)
    src = [torch.randint(0, 256, (pool, bb), dtype=torch.uint8, device=dev) for _ in range(regions)]
    dst = [torch.zeros((pool, bb), dtype=torch.uint8, device=dev) for _ in range(regions)]

    def layout(ts: list) -> KVLayout:
        return KVLayout(MemoryKind.VRAM, 0, pool, tuple(t.data_ptr() for t in ts), tuple(bb for _ in ts))

    a, b = CudaIpcTransport(f"dc-a-{time.monotonic_ns()}"), CudaIpcTransport(f"dc-b-{time.monotonic_ns()}")
    a.register(layout(src))
    b.register(layout(dst))
    peer = b.add_peer(a.local_metadata())
    plan = b.prepare(peer)
    flat = torch.empty(2 * 256 * regions * bb, dtype=torch.uint8, device=dev)
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.kvl_bench.argtypes = [vp, vp, i32, i32, i32, i32, i64, i64, vp, vp, vp, vp, ctypes.c_uint64, ctypes.c_uint64,
                              ctypes.c_uint64, i32, vp, vp]
    out: dict[str, dict[str, float]] = {}
    rng = np.random.default_rng(3)
    for n in (16, 256):
        ids_src = rng.permutation(pool)[:n].astype(np.int32)
        ids_dst = rng.permutation(pool)[:n].astype(np.int32)
        for _ in range(3):  # JIT, then the first warm launch binds the compiled post
            h = b.post(XferOp.READ, plan, ids_dst, ids_src)
            deadline = time.monotonic() + 30
            while b.poll(h).name not in ("DONE", "FAILED") and time.monotonic() < deadline:
                pass
            b.release(h)
        b.flush()
        kernels = b._kernels_for(b._launch_for(plan, None), XferOp.READ)
        if kernels is None or b._native is None:
            raise SystemExit(f"compiled post not bound: {native_post.why_not()}")
        pad = -(-n // 4) * 4
        slot = b._ring.reserve(2 * pad)
        b._staging[:n], b._staging[pad:pad + n] = ids_src, ids_dst
        drv = b._driver
        start, end, plain = drv.event_create(True), drv.event_create(True), drv.event_create(False)
        res = np.zeros(len(METRICS), dtype=np.float64)
        scratch = np.zeros(reps, dtype=np.int64)
        nbytes = n * regions * bb
        rc = lib.kvl_bench(b._poster_addr, ctypes.addressof(kernels.array), kernels.count, slot, n, pad, pool, pool,
                           torch.cuda.current_stream(dev).cuda_stream, start, end, plain, flat.data_ptr() + nbytes,
                           flat.data_ptr(), nbytes, reps, res.ctypes.data, scratch.ctypes.data)
        torch.cuda.synchronize(dev)
        if rc != 0:
            raise SystemExit(f"kvl_bench failed: CUresult {rc}")
        ok = all(torch.equal(dst[r][torch.from_numpy(ids_dst).long().to(dev)],
                             src[r][torch.from_numpy(ids_src).long().to(dev)]) for r in range(regions))
        b._ring.free(slot)
        row = {m: round(v / 1e3, 2) for m, v in zip(METRICS, res.tolist(), strict=True)}
        row["graph_nodes"] = res[-1]
        row["bytes_exact"] = ok
        out[f"{n}_blocks"] = row
    a.close()
    b.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with progress("driver costs", 2, json_output=args.json) as tick:
        res: dict[str, Any] = {"python": python_costs(max(args.reps, 2000))}
        tick("Python")
        res["driver"] = driver_costs(args.reps)
        tick("driver")
    if args.json:
        print(json.dumps(res))
    else:
        for section, rows in res.items():
            print(f"== {section}")
            if section == "python":
                for k, v in rows.items():
                    print(f"  {k:36s} {v}")
                continue
            for label, row in rows.items():
                print(f"  -- {label}")
                for k, v in row.items():
                    print(f"    {k:40s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
