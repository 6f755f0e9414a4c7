"""``kvlifecycle explain LOG [LOG ...]``: for every violation, request that did not end, block pinned past its
lease and load that never completed, the shortest chain of events that leads to it and one sentence.

Exit codes as ``replay --check``: 0 nothing found, 1 findings, 2 the input could not be read or is impossible.
"""

from __future__ import annotations

import argparse
import json

from kvlifecycle.cli.replay import BAD_INPUT_ERRORS, _parse_time, input_error


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="event log directory (one per worker; a directory of log directories also works)")
    parser.add_argument("--until", type=_parse_time, metavar="T",
                        help="explain the logs as they stood at T (epoch seconds, ISO-8601, or +N ms after the "
                             "first event)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.cli.render import stdout_closed

    try:
        return _explain(args)
    except BrokenPipeError:
        return stdout_closed()


def _explain(args: argparse.Namespace) -> int:
    from kvlifecycle.explain import explain_logs, finding_view

    try:
        trace, findings = explain_logs(args.logs, **(args.until.until_kwargs() if args.until else {}))
    except BAD_INPUT_ERRORS as exc:
        return input_error("explain", exc)
    views = [finding_view(trace, f) for f in findings]
    workers = ", ".join(trace.logs)
    if args.json:
        print(json.dumps({"t0": trace.t0, "workers": list(trace.logs), "events": len(trace.steps),
                          "findings": views, "ok": not views}, indent=2))
        return 1 if views else 0
    from kvlifecycle.cli.render import STEP_COLUMNS, Output, iso, step_row

    out = Output()
    if not views:
        out.line(f"nothing to explain in {len(trace.steps)} events of {workers}: every request ended, every lease "
                 "and load settled, and the invariants hold", "green")
        return 0
    out.line(f"{len(views)} finding(s) in {len(trace.steps)} events of {workers} "
             f"(times in ms since {iso(trace.t0)})", "bold")
    for n, view in enumerate(views, start=1):
        out.line()
        out.line(f"{n}. [{view['rule']}] {view['sentence']}", "bold yellow")
        out.table(STEP_COLUMNS, [step_row(s) for s in view["chain"]], indent=4)
    return 1
