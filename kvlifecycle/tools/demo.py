"""``kvlifecycle demo``: P and D in two processes on 127.0.0.1, NIXL over DRAM, a few requests handed off by pull and
by push, bytes checked, both event logs written, replayed and checked.

Each side is a :class:`~kvlifecycle.tools.workers.HandoffWorker` in a process of its own, driven through the
harness in :mod:`kvlifecycle.tools.workers`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvlifecycle.tools.workers import WORKER_MAX_LIFETIME_S, BlockPool, WorkerConfig, WorkerProcess

WORKER_SECONDS_PER_REQUEST = 1.0  # the demo's lifetime budget per request, far above what one takes
MAX_DEMO_POOL_BYTES = 4 << 30  # per side: the demo registers regions × blocks × block bytes of DRAM on each
DEMO_BLOCKS_PER_REQUEST = 8
RECLAIM_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="directory for the two event logs (default: a temp dir)")
    parser.add_argument("--requests", type=int, default=4, help="requests per mode (pull and push)")
    parser.add_argument("--regions", type=int, default=8, help="KV regions (layers × K/V)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per region")
    parser.add_argument("--block-bytes", type=int, default=16384, help="bytes per block per region")
    parser.add_argument("--transport", choices=["nixl"], default="nixl", help="the data plane (nixl)")


def _not_installed(*modules: str) -> list[str]:
    """Which of ``modules`` cannot be imported here (looked up, not imported: the parent process needs neither)."""
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def refuse_arguments(args: argparse.Namespace) -> str:
    """Why the demo cannot run with these arguments (one line), or ""."""
    for name in ("requests", "regions", "blocks", "block_bytes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    pool = args.regions * args.blocks * args.block_bytes
    if pool > MAX_DEMO_POOL_BYTES:
        return (f"--regions × --blocks × --block-bytes = {pool / 2**30:.1f} GiB per side, more than the demo's "
                f"{MAX_DEMO_POOL_BYTES >> 30} GiB")
    return ""


def _reclaim(p: WorkerProcess, pool: BlockPool, released: list[Any], *, until_free: int, until_all: int = 0) -> None:
    """Free P's released requests and return their blocks to ``pool`` (bounded wait) until ``until_free`` blocks
    are free, or ``until_all`` releases were seen in total."""
    deadline = time.monotonic() + RECLAIM_TIMEOUT_S
    while time.monotonic() < deadline:
        for request, *_ in (fresh := p.call("free_released")):
            pool.give_back(request)
        released += fresh
        if len(pool.free) >= until_free and len(released) >= until_all:
            return
        if not fresh:
            time.sleep(0.005)


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.replay import check, check_pair, replay, summary

    missing = _not_installed("nixl", "torch")  # both worker processes need them: say so here, not in a traceback
    if missing:
        print(f"kvlifecycle demo moves KV over NIXL and needs {' and '.join(missing)}, not installed here: "
              "pip install 'kvlifecycle[transports]' torch (pin torch's CPU wheel, see README)", file=sys.stderr)
        return 2

    refused = refuse_arguments(args)
    if refused:
        print(f"kvlifecycle demo: {refused}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvl-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    p_log, d_log = out / "p0", out / "d0"
    total = 2 * args.requests
    common = {"regions": args.regions, "blocks": args.blocks, "block_bytes": args.block_bytes,
              "max_lifetime_s": WORKER_MAX_LIFETIME_S + WORKER_SECONDS_PER_REQUEST * total}
    t0 = time.monotonic()
    p = WorkerProcess(WorkerConfig("producer", "p0", log_dir=str(p_log), seed=7, **common))
    d = WorkerProcess(WorkerConfig("consumer", "d0", log_dir=str(d_log), **common))
    verbose = total <= 16  # one line per request for a short demo; progress lines for a long one
    ok = True
    moved = granted = 0
    released: list[Any] = []
    try:
        addr = p.hello["address"]
        link = d.call("connect", addr)
        if link["probe_gbps"] is not None:
            print(f"  connected d0 -> p0 (agent epoch {link['epoch']}), probe {link['probe_gbps']:.2f} GB/s "
                  f"over {link['probe_backend']}")
        per = max(1, min(args.blocks // 4, DEMO_BLOCKS_PER_REQUEST))
        src_pool, dst_pool = BlockPool(args.blocks), BlockPool(args.blocks)
        for i in range(total):
            mode = "pull" if i < args.requests else "push"
            request = f"req-{mode}-{i}"
            src = src_pool.take(request, per)
            if src is None:  # P's blocks come back once their lease is released and P freed them
                _reclaim(p, src_pool, released, until_free=per)
                src = src_pool.take(request, per)
            dst = dst_pool.take(request, per)
            if src is None or dst is None:
                print(f"{request}: no free blocks after {RECLAIM_TIMEOUT_S:.0f} s (earlier requests never "
                      "released theirs)", file=sys.stderr)
                ok = False
                break
            grant = p.call("alloc_grant", request, src)
            granted += 1
            d.call("reserve", request, dst)
            if mode == "pull":
                d.call("pull", request, [[addr, grant]])
            else:
                d.call("push", request, grant, addr)
            if not d.call("wait", 30.0):
                print(f"{request}: load did not settle in 30 s", file=sys.stderr)
                ok = False
                continue
            same = p.call("digest", src) == d.call("digest", dst)
            ok &= same
            moved += per * args.regions * args.block_bytes
            state = d.call("request_state", request)
            if verbose or not same or state != "READY_FOR_ATTENTION":
                print(f"  {request:<14} {mode:<4} {per} blocks × {args.regions} regions: bytes "
                      f"{'match' if same else 'DIFFER'}, D blocks {state}")
            elif (i + 1) % max(1, total // 10) == 0:
                print(f"  {i + 1}/{total} requests handed off, bytes match")
            if state is not None:
                d.call("finish", request)
            dst_pool.give_back(request)
        _reclaim(p, src_pool, released, until_free=0, until_all=granted)
        ok &= not src_pool.held and len(released) == granted == total
    finally:
        d.stop()
        p.stop()
    results = [replay(p_log), replay(d_log)]
    problems = [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]
    for r in results:
        s = summary(r)
        print(f"  log {r.header.get('worker')} ({s['side']}): {s['events']} events, stats {s['stats']}, "
              f"refusals {s['refusals'] or 'none'}")
    ok &= not problems
    for line in problems:
        print(f"  VIOLATION {line}")
    print(f"demo {'OK' if ok else 'FAILED'}: {total} requests ({args.requests} pull, "
          f"{args.requests} push), {moved / 2**20:.1f} MiB moved, logs in {out}, {time.monotonic() - t0:.1f}s")
    return 0 if ok else 1
