"""The verb: ``kvlifecycle bench gpu``'s flags, the order its paths run in, and what it prints and exits with."""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle.tools.progress import Ticker, progress

from .shapes import Shape, id_sets
from .summary import summarise
from .table import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--regions", type=int, default=64, help="KV regions (layers × K/V) per side")
    parser.add_argument("--blocks", type=int, default=256, help="blocks per region in the large request")
    parser.add_argument("--small-blocks", type=int, default=16, help="blocks per region in the small request")
    parser.add_argument("--block-kib", type=int, default=32, help="KiB per block per region")
    parser.add_argument("--pool-blocks", type=int, default=2048, help="blocks per region in each side's pool")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per timed figure (median reported)")
    parser.add_argument("--pipeline", type=int, default=8, help="requests in flight in the pipelined e2e run")
    parser.add_argument("--nixl-reps", type=int, default=3, help="repetitions of the NIXL figures")
    parser.add_argument("--no-nixl", action="store_true", help="skip the NIXL figures")
    parser.add_argument("--no-e2e", action="store_true", help="skip the end-to-end handoff runs")
    parser.add_argument("--no-ab", action="store_true",
                        help="skip the second e2e run with the Python post (the compiled post's A/B, same run)")
    parser.add_argument("--sweep", action="store_true", help="also time kernel variants (chunk bytes, warps)")
    parser.add_argument("--device", type=int, default=0, help="D's device (this process)")
    parser.add_argument("--peer-device", type=int, default=None, help="P's device (default: the same)")
    parser.add_argument("--verify", choices=("none", "all"), default="none",
                        help="all: also time P's per-block digest pass against a device copy of the same bytes")
    parser.add_argument("--dir", help="keep the ledgers' logs here (default: a temporary directory)")
    parser.add_argument("--out", help="also write the JSON object to this file")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from .in_process import InProcess, bench_in_process

    if not torch.cuda.is_available():
        raise SystemExit("kvlifecycle bench gpu needs a CUDA device; torch.cuda.is_available() is False here")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    bb = args.block_kib * 1024
    shapes = {"large": Shape(args.regions, args.blocks, bb), "small": Shape(args.regions, args.small_blocks, bb)}
    pool = max(args.pool_blocks, args.blocks * args.pipeline, args.small_blocks * args.pipeline)
    ip = InProcess(torch, device, Shape(args.regions, pool, bb), pool, seed=3)
    rng = np.random.default_rng(5)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": {k: {"regions": s.regions, "blocks": s.blocks, "block_bytes": s.block_bytes, "bytes": s.nbytes}
                  for k, s in shapes.items()},
        "pool_blocks": pool,
    }
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    sets = {label: id_sets(rng, pool, shape.blocks, args.reps) for label, shape in shapes.items()}
    two_gpus = args.peer_device is not None and args.peer_device != args.device
    with progress("bench gpu", _steps(args, two_gpus), json_output=getattr(args, "json", False)) as tick:
        for label, shape in shapes.items():
            res[label] = bench_in_process(torch, ip, shape, sets[label], args.sweep, args.pipeline)
            tick(f"{label}: in-process paths")
        if args.verify == "all":
            _verify(torch, ip, shapes, sets, res)
            tick("verify: the digest pass")
        if two_gpus:
            _peer_ceilings(torch, ip, shapes, args, res)
            tick("peer copy")
        if not args.no_e2e:
            _e2e_runs(torch, ip, shapes, args, res, tick)
        if args.sweep and two_gpus:
            _peer_kernels(torch, ip, shapes, sets, args, res)
            tick("kernels across the peer link")
        if not args.no_nixl:  # last: NIXL's UCX progress threads spin cores while its agents live
            _nixl(torch, ip, shapes, sets, args, res, tick)
    return summarise(res, shapes, args.pipeline)


def _steps(args: argparse.Namespace, two_gpus: bool) -> int:
    """How many times :func:`measure` ticks: one per stage below."""
    e2e = 0 if args.no_e2e else (2 if args.no_ab else 3)
    return 2 + (args.verify == "all") + two_gpus + e2e + (args.sweep and two_gpus) + (0 if args.no_nixl else 2)


def _verify(torch: Any, ip: Any, shapes: dict[str, Shape], sets: dict[str, Any], res: dict[str, Any]) -> None:
    from .verify import bench_verify

    res["verify"] = {}
    for label, shape in shapes.items():
        try:
            res["verify"][label] = bench_verify(torch, ip, shape, sets[label], res[label])
        except Exception as exc:  # reported: the copy figures stand without it
            res["verify"][label] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}


def _peer_ceilings(torch: Any, ip: Any, shapes: dict[str, Shape], args: argparse.Namespace,
                   res: dict[str, Any]) -> None:
    """Two GPUs: P's memory is on --peer-device; the ceiling is a torch peer copy of the same bytes."""
    from .peer import peer_ceiling

    for label, shape in shapes.items():
        try:
            event_s, wall_s = peer_ceiling(torch, ip, shape.nbytes, args.peer_device, max(10, args.reps))
            res[label] |= {"peer_ceiling_event_s": event_s, "peer_ceiling_wall_s": wall_s}
        except Exception as exc:
            res[label]["peer_ceiling_error"] = f"{type(exc).__name__}: {exc}"


def _e2e_runs(torch: Any, ip: Any, shapes: dict[str, Shape], args: argparse.Namespace, res: dict[str, Any],
              tick: Ticker) -> None:
    """The ledger's hot cost, then the e2e: with the compiled post (the default) and, the A/B in one run, with the
    Python post."""
    from .budget import ledger_hot_us
    from .e2e import bench_e2e

    log_dir = args.dir or tempfile.mkdtemp(prefix="kvl-bench-gpu-")
    res["ledger_hot_us"] = ledger_hot_us(args.small_blocks, max(200, 10 * args.reps), f"{log_dir}/hot")
    tick("the ledger, hot")
    peer = args.device if args.peer_device is None else args.peer_device
    for key, compiled in (("e2e", True), ("e2e_python_post", False)):
        if key != "e2e" and args.no_ab:
            continue
        try:
            e2e = bench_e2e(torch, ip, shapes, args.reps, args.pipeline, peer, f"{log_dir}/{key}",
                            compiled_post=compiled)
        except Exception as exc:
            e2e = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        res[key] = e2e
        tick(f"{key}: two processes")
    res["log_dir"] = log_dir


def _peer_kernels(torch: Any, ip: Any, shapes: dict[str, Shape], sets: dict[str, Any], args: argparse.Namespace,
                  res: dict[str, Any]) -> None:
    from .peer import bench_peer_kernels

    for label, shape in shapes.items():
        try:
            res[label]["peer_kernel_variants"] = bench_peer_kernels(torch, ip, shape, sets[label], args.peer_device)
        except Exception as exc:  # reported, not fatal: a measurement beside the e2e
            res[label]["peer_kernel_error"] = f"{type(exc).__name__}: {exc}"


def _nixl(torch: Any, ip: Any, shapes: dict[str, Shape], sets: dict[str, Any], args: argparse.Namespace,
          res: dict[str, Any], tick: Ticker) -> None:
    from .raw_nixl import bench_nixl

    for label, shape in shapes.items():
        try:
            res[label].update(bench_nixl(torch, ip, shape, sets[label],
                                         args.nixl_reps if label == "large" else 10, args.peer_device))
        except Exception as exc:  # reported, not fatal: NIXL is a comparison here
            res[label]["nixl_error"] = f"{type(exc).__name__}: {exc}"
        gc.collect()
        tick(f"{label}: raw NIXL")


def run(args: argparse.Namespace) -> int:
    res = measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print_table(res)
        from .verify import print_verify

        print_verify(res)
    digests_exact = all(v.get("digest_exact") for v in res.get("verify", {}).values())
    ok = res["byte_exact"] and digests_exact and not any(res.get(key, {}).get("error")
                                                         or res.get(key, {}).get("replay_violations")
                                                         for key in ("e2e", "e2e_python_post"))
    return 0 if ok else 1


def main() -> int:  # pragma: no cover - ``python -m kvlifecycle.tools.bench_gpu``
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    return run(parser.parse_args())
