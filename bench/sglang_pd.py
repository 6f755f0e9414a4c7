"""Benchmark: the same P/D transfers through SGLang's own NIXL backend and through kvlifecycle's, in one run.

Both go through SGLang 0.5.23's classes (KV manager, sender/receiver, bootstrap server) driven by
``tests/sglang/sglang_driver.py`` in two processes, DRAM KV, NIXL/UCX over loopback. The time of one run is
from the prefill's first ``send()`` of the timed rooms to the decode's last ``Success`` (both read
CLOCK_MONOTONIC, which is shared by the processes of one host), after one warm-up room. Runs alternate between the
backends; the median of each is reported, and ``ratio`` = kvlifecycle / nixl (goal ≤ 1.0).

``--small-rooms``: the per-room latency of small rooms instead (default 50 rooms of 12 pages × 8 regions × 16 KiB =
1.5 MiB), one room at a time (the driver's ``serial`` scenario): each room's time is on the decode, from making its
receiver to its ``Success``; the rooms of every run of a backend are pooled; median and p90 of each backend, and
``ratio`` = kvlifecycle's median / nixl's (goal ≤ 0.3).
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
DRIVER = ROOT / "tests" / "sglang" / "sglang_driver.py"  # drives SGLang's own classes; a test module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(backend: str, args: argparse.Namespace, work: Path) -> dict:
    port = free_port()
    env = {**os.environ, "UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo", "SGLANG_HOST_IP": "127.0.0.1",
           "HOST_IP": "127.0.0.1", "SGLANG_PLUGINS": "kvlifecycle", "PYTHONUNBUFFERED": "1"}
    plan = ["--rooms", str(args.rooms), "--pages-per-room", str(args.pages_per_room), "--num-pages",
            str(args.num_pages), "--aux-rows", str(args.aux_rows), "--layers", str(args.layers),
            "--item-bytes", str(args.item_bytes),
            "--seed", str(args.seed)]
    scenario = "serial" if args.small_rooms else "transfer"
    common = ["--backend", backend, "--scenario", scenario, "--port", str(port), "--sync-dir", str(work),
              "--deadline", "180", *plan]
    procs = {}
    for role in ("prefill", "decode"):
        log = open(work / f"{role}.log", "wb")  # noqa: SIM115 - closed with the process
        procs[role] = (subprocess.Popen([sys.executable, str(DRIVER), "--role", role,
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
            "untouched_ok": dec["untouched_ok"], "room_latencies_s": dec.get("room_latencies_s", [])}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values``, linear between the nearest ranks."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def small_rooms_report(args: argparse.Namespace, runs: dict[str, list[dict]], wall_s: float) -> dict:
    rooms = {b: [t for r in rs for t in r["room_latencies_s"]] for b, rs in runs.items()}
    each = {b: {"median_s": statistics.median(ts), "p90_s": quantile(ts, 0.9), "rooms": len(ts)}
            for b, ts in rooms.items()}
    room_bytes = args.pages_per_room * 2 * args.layers * args.item_bytes
    return {
        "bench": "sglang_pd_small_rooms",
        "sglang": "0.5.23",
        "room": {"pages": args.pages_per_room, "regions": 2 * args.layers, "page_bytes": args.item_bytes,
                 "bytes": room_bytes},
        "nixl": each["nixl"],
        "kvlifecycle": each["kvlifecycle"],
        "ratio": each["kvlifecycle"]["median_s"] / each["nixl"]["median_s"],
        "ratio_p90": each["kvlifecycle"]["p90_s"] / each["nixl"]["p90_s"],
        "bytes_equal": all(r["bytes_equal"] for rs in runs.values() for r in rs),
        "untouched_ok": all(r["untouched_ok"] for rs in runs.values() for r in rs),
        "room_latencies_s": rooms,
        "repeat": args.repeat,
        "wall_s": wall_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--small-rooms", action="store_true",
                    help="per-room latency of small rooms, one at a time (defaults: 50 rooms of 12 pages, 1 run)")
    ap.add_argument("--repeat", type=int, default=None, help="runs per backend (default 3; --small-rooms: 1)")
    ap.add_argument("--rooms", type=int, default=None, help="timed rooms per run (default 16; --small-rooms: 50)")
    ap.add_argument("--pages-per-room", type=int, default=None, help="default 32; --small-rooms: 12")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--item-bytes", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    small = args.small_rooms
    args.repeat = args.repeat if args.repeat is not None else 1 if small else 3
    args.rooms = args.rooms if args.rooms is not None else 50 if small else 16
    args.pages_per_room = args.pages_per_room if args.pages_per_room is not None else 12 if small else 32
    # the driver's plan gives every room it knows its own pages (2 x rooms, plus the scenario rooms): room for all
    args.num_pages = (2 * args.rooms + 12) * args.pages_per_room
    args.aux_rows = max(32, 2 * args.rooms + 12)  # an aux row of its own for every room too
    runs: dict[str, list[dict]] = {"nixl": [], "kvlifecycle": []}
    t0 = time.monotonic()
    with progress("SGLang P/D", 2 * args.repeat, json_output=args.json) as tick:
        for i in range(args.repeat):
            for backend in ("nixl", "kvlifecycle") if i % 2 == 0 else ("kvlifecycle", "nixl"):
                with tempfile.TemporaryDirectory(prefix=f"sglang-bench-{backend}-") as tmp:
                    runs[backend].append(one_run(backend, args, Path(tmp)))
                tick(f"run {i + 1}, {backend}")
                if not args.json and small:
                    ts = runs[backend][-1]["room_latencies_s"]
                    print(f"  run {i + 1} {backend:12s} {len(ts)} rooms, median {statistics.median(ts) * 1e3:7.2f} ms"
                          f"  bytes_equal={runs[backend][-1]['bytes_equal']}", flush=True)
                elif not args.json:
                    r = runs[backend][-1]
                    print(f"  run {i + 1} {backend:12s} {r['seconds'] * 1e3:9.2f} ms  "
                          f"{r['bytes'] / r['seconds'] / 1e9:6.2f} GB/s  bytes_equal={r['bytes_equal']}", flush=True)
    if small:
        report = small_rooms_report(args, runs, time.monotonic() - t0)
        if args.json:
            print(json.dumps(report))
        else:
            print(f"SGLang P/D small rooms, one at a time: {report['room']['bytes'] / 2**20:.2f} MiB per room "
                  f"({args.pages_per_room} pages x {2 * args.layers} regions x {args.item_bytes} B), "
                  f"{args.rooms} rooms x {args.repeat} run(s) per backend, decode receiver made -> Success")
            print(f"  {'':22s} {'median':>9s} {'p90':>9s}")
            for backend, label in (("nixl", "SGLang NIXL backend"), ("kvlifecycle", "kvlifecycle backend")):
                e = report[backend]
                print(f"  {label:22s} {e['median_s'] * 1e3:6.2f} ms {e['p90_s'] * 1e3:6.2f} ms")
            print(f"  ratio kvlifecycle/nixl: median {report['ratio']:.3f} (goal <= 0.3), p90 {report['ratio_p90']:.3f}"
                  f"   bytes_equal={report['bytes_equal']}")
        return 0 if report["bytes_equal"] else 1
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
