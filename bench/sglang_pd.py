"""Benchmark: the same P/D transfers through SGLang's own NIXL backend and through kvlifecycle's, in one run.

Both go through SGLang 0.5.23's classes (KV manager, sender/receiver, bootstrap server) driven by
``kvlifecycle.tools.sglang_driver`` in two processes, DRAM KV, NIXL/UCX over loopback. The time of one run is
from the prefill's first ``send()`` of the timed rooms to the decode's last ``Success`` (both read
CLOCK_MONOTONIC, which is shared by the processes of one host), after one warm-up room. Runs alternate between the
backends; the median of each is reported, and ``ratio`` = kvlifecycle / nixl (goal ≤ 1.0).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvlifecycle.tools.progress import progress

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(backend: str, args: argparse.Namespace, work: Path) -> dict:
    port = free_port()
    env = {**os.environ, "UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo", "SGLANG_HOST_IP": "127.0.0.1",
           "HOST_IP": "127.0.0.1", "SGLANG_PLUGINS": "kvlifecycle", "PYTHONUNBUFFERED": "1"}
    plan = ["--rooms", str(args.rooms), "--pages-per-room", str(args.pages_per_room), "--num-pages",
            str(args.num_pages), "--layers", str(args.layers), "--item-bytes", str(args.item_bytes),
            "--seed", str(args.seed)]
    common = ["--backend", backend, "--scenario", "transfer", "--port", str(port), "--sync-dir", str(work),
              "--deadline", "180", *plan]
    procs = {}
    for role in ("prefill", "decode"):
        log = open(work / f"{role}.log", "wb")  # noqa: SIM115 - closed with the process
        procs[role] = (subprocess.Popen([sys.executable, "-m", "kvlifecycle.tools.sglang_driver", "--role", role,
                                         *common, "--out", str(work / f"{role}.json")], cwd=str(ROOT), env=env,
                                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log)
    try:
        for p, _ in procs.values():
            p.wait(timeout=300)
    finally:
        for p, log in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
            log.close()
    pre = json.loads((work / "prefill.json").read_text())
    dec = json.loads((work / "decode.json").read_text())
    if "error" in pre or "error" in dec or "t_first_send" not in pre or "t_all_success" not in dec:
        tail = (work / "decode.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"{backend} run failed: {pre.get('error') or dec.get('error')}\n{tail}")
    seconds = dec["t_all_success"] - pre["t_first_send"]
    return {"seconds": seconds, "bytes": dec["bytes_moved"], "bytes_equal": dec["bytes_equal"],
            "untouched_ok": dec["untouched_ok"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rooms", type=int, default=16)
    ap.add_argument("--pages-per-room", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--item-bytes", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    # the driver's plan gives every room it knows its own pages (2 x rooms, plus the scenario rooms): room for all
    args.num_pages = (2 * args.rooms + 12) * args.pages_per_room
    runs: dict[str, list[dict]] = {"nixl": [], "kvlifecycle": []}
    t0 = time.monotonic()
    with progress("SGLang P/D", 2 * args.repeat, json_output=args.json) as tick:
        for i in range(args.repeat):
            for backend in ("nixl", "kvlifecycle") if i % 2 == 0 else ("kvlifecycle", "nixl"):
                with tempfile.TemporaryDirectory(prefix=f"sglang-bench-{backend}-") as tmp:
                    runs[backend].append(one_run(backend, args, Path(tmp)))
                tick(f"run {i + 1}, {backend}")
                if not args.json:
                    r = runs[backend][-1]
                    print(f"  run {i + 1} {backend:12s} {r['seconds'] * 1e3:9.2f} ms  "
                          f"{r['bytes'] / r['seconds'] / 1e9:6.2f} GB/s  bytes_equal={r['bytes_equal']}", flush=True)
    med = {b: statistics.median(r["seconds"] for r in rs) for b, rs in runs.items()}
    nbytes = runs["kvlifecycle"][0]["bytes"]
    out = {
        "bench": "sglang_pd",
        "sglang": "0.5.23",
        "transfer": {"rooms": args.rooms, "pages_per_room": args.pages_per_room, "regions": 2 * args.layers,
                     "page_bytes": args.item_bytes, "bytes": nbytes},
        "nixl_s": med["nixl"],
        "kvlifecycle_s": med["kvlifecycle"],
        "nixl_gbps": nbytes / med["nixl"] / 1e9,
        "kvlifecycle_gbps": nbytes / med["kvlifecycle"] / 1e9,
        "ratio": med["kvlifecycle"] / med["nixl"],
        "bytes_equal": all(r["bytes_equal"] for rs in runs.values() for r in rs),
        "untouched_ok": all(r["untouched_ok"] for rs in runs.values() for r in rs),
        "runs": {b: [r["seconds"] for r in rs] for b, rs in runs.items()},
        "repeat": args.repeat,
        "wall_s": time.monotonic() - t0,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"SGLang P/D, {args.rooms} rooms x {args.pages_per_room} pages x {2 * args.layers} regions x "
              f"{args.item_bytes} B = {nbytes / 2**20:.1f} MiB per run, median of {args.repeat}")
        print(f"  SGLang NIXL backend : {med['nixl'] * 1e3:9.2f} ms  ({out['nixl_gbps']:.2f} GB/s)")
        print(f"  kvlifecycle backend : {med['kvlifecycle'] * 1e3:9.2f} ms  ({out['kvlifecycle_gbps']:.2f} GB/s)")
        print(f"  ratio kvlifecycle/nixl = {out['ratio']:.3f} (goal <= 1.0)   bytes_equal={out['bytes_equal']}")
    return 0 if out["bytes_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
