"""``kvlifecycle explain LOG [LOG ...]``: for every violation, request that did not end, block pinned past its
lease and load that never completed, the shortest chain of events that leads to it and one sentence.

Exit codes as ``replay --check``: 0 nothing found, 1 findings, 2 the input could not be read or is impossible. Work
left open at the end of a torn log or of a log cut by ``--until`` is listed as in flight, and is no finding.
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
    from kvlifecycle.explain import digest_tally, explain_logs, finding_view, split_in_flight

    try:
        trace, findings = explain_logs(args.logs, **(args.until.until_kwargs() if args.until else {}))
    except BAD_INPUT_ERRORS as exc:
        return input_error("explain", exc)
    faults, open_work = split_in_flight(findings)
    views = [finding_view(trace, f) for f in faults]
    in_flight = [finding_view(trace, f) for f in open_work]
    workers = ", ".join(trace.logs)
    digests = digest_tally(trace)
    if args.json:
        print(json.dumps({"t0": trace.t0, "workers": list(trace.logs), "events": len(trace.steps),
                          "findings": views, "in_flight": in_flight, "digests": digests, "ok": not views},
                         indent=2))
        return 1 if views else 0
    from kvlifecycle.cli.render import STEP_COLUMNS, Output, iso, step_row

    out = Output()
    if not views:
        settled = "every request ended, every lease and load settled" if not in_flight else \
            f"{len(in_flight)} piece(s) of work were in flight where the log stops (below)"
        out.line(f"nothing to explain in {len(trace.steps)} events of {workers}: {settled}, and the invariants hold",
                 "green")
    else:
        out.line(f"{len(views)} finding(s) in {len(trace.steps)} events of {workers} "
                 f"(times in ms since {iso(trace.t0)})", "bold")
    for worker, tally in digests.items():
        out.line(f"digests on {worker}: {tally['verified_blocks']} block(s) verified in {tally['verified_parts']} "
                 f"part(s), {tally['mismatched_blocks']} block(s) failed in {tally['mismatches']} check(s)",
                 "bold yellow" if tally["mismatches"] else "green")
    for n, view in enumerate(views, start=1):
        out.line()
        out.line(f"{n}. [{view['rule']}] {view['sentence']}", "bold yellow")
        out.table(STEP_COLUMNS, [step_row(s) for s in view["chain"]], indent=4)
    if in_flight:
        out.line()
        out.line(f"in flight where the log stops ({len(in_flight)}; not findings):", "bold")
        for view in in_flight:
            out.line(f"  - {view['sentence']}")
    return 1 if views else 0
