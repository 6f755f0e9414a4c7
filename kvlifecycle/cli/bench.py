"""``kvlifecycle bench NAME``: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib

# benchmark -> (module under kvlifecycle.tools, help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "lifecycle": ("bench_lifecycle", "full P and D block lifecycles with the event log on"),
    "transport": ("bench_transport", "raw NIXL vs kvlifecycle's NIXL transport, two processes, DRAM"),
    "load": ("bench_load", "sustained load through Producer/Consumer over NIXL: rate, latency, flat RSS, clean logs"),
    "gpu": ("bench_gpu", "same-node GPU fast path vs NIXL vs torch vs a contiguous copy (needs CUDA)"),
    "gpu-layerwise": ("bench_gpu.layerwise", "layer-wise KV streaming vs the post-prefill copy, T_visible (CUDA)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="NAME")
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench_parser = sub.add_parser(name, help=help_text, description=help_text)
        bench_parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        # bench modules keep their heavy imports inside run(), so importing them all here stays cheap
        importlib.import_module(f"kvlifecycle.tools.{module_name}").add_arguments(bench_parser)
        bench_parser.set_defaults(_bench_module=module_name)


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"kvlifecycle.tools.{args._bench_module}")
    return int(module.run(args) or 0)
