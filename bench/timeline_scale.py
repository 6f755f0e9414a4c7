"""``kvlifecycle timeline`` on a large log, before and after, side by side in one run: the timeline package at a
baseline revision (read with ``git show``, loaded as a module of its own) and the working tree's, each stage timed.

    .venv/bin/kvlifecycle demo --out /tmp/demo2000 --requests 1000    # 2,000 handoffs: 1,000 pulls, 1,000 pushes
    .venv/bin/python bench/timeline_scale.py /tmp/demo2000 --baseline c30c189 --json

Stages: ``read`` (merge the logs and build the timeline), ``trace`` (the JSON, checked, written), ``png`` (the
default picture: the baseline's lanes, the working tree's aggregate and sample past 24 requests). The logs are read
once before anything is timed, so both sides find them in the page cache. Results: docs/benchmarks/.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def baseline_module(revision: str) -> ModuleType:
    """``kvlifecycle/timeline.py`` as it was at ``revision`` (the single-module version), as a module of its own."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{revision}:kvlifecycle/timeline.py"],
                            capture_output=True, text=True, check=True).stdout
    spec = importlib.util.spec_from_loader("timeline_baseline", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    exec(compile(source, f"{revision}:kvlifecycle/timeline.py", "exec"), module.__dict__)
    return module


def timed(stages: dict[str, float], name: str, call: Any, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    result = call(*args, **kwargs)
    stages[name] = round(time.perf_counter() - start, 3)
    return result


def run_one(module: Any, logs: list[str], out: Path, png: bool) -> dict[str, float]:
    stages: dict[str, float] = {}
    timeline = timed(stages, "read", module.timeline_from_logs, logs)
    timed(stages, "trace", module.write_chrome_trace, timeline, out / "trace.json")
    if png:
        timed(stages, "png", module.render_png, timeline, out / "timeline.png")
    stages["total"] = round(sum(stages.values()), 3)
    stages["slices"] = len(timeline.slices)
    stages["flows"] = len(timeline.flows)
    return stages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", help="event log directories (or a directory of them)")
    parser.add_argument("--baseline", default="c30c189", help="revision whose kvlifecycle/timeline.py is 'before'")
    parser.add_argument("--no-png", action="store_true", help="time the JSON only")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    import kvlifecycle.timeline as after
    from kvlifecycle.merge import merge_logs

    merged = merge_logs(args.logs)  # warm the page cache for both sides
    events = len(merged)
    before = baseline_module(args.baseline)
    results: dict[str, Any] = {"logs": args.logs, "events": events, "baseline": args.baseline}
    with tempfile.TemporaryDirectory() as tmp:
        for name, module in (("before", before), ("after", after)):
            out = Path(tmp) / name
            out.mkdir()
            results[name] = run_one(module, args.logs, out, not args.no_png)
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{events} events in {', '.join(args.logs)}; before = {args.baseline}, after = the working tree")
    print(f"{'stage':<8}{'before s':>10}{'after s':>10}")
    for stage in ("read", "trace", "png", "total"):
        if stage in results["after"]:
            print(f"{stage:<8}{results['before'][stage]:>10.3f}{results['after'][stage]:>10.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
