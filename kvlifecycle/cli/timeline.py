"""``kvlifecycle timeline LOG [LOG ...] -o trace.json [--png out.png]``: P and D logs as one Perfetto trace."""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="event log directory (one per worker; a directory of log directories also works)")
    parser.add_argument("-o", "--output", default="trace.json",
                        help="Chrome-trace/Perfetto JSON to write (default trace.json; open in ui.perfetto.dev)")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline as a PNG (matplotlib)")
    parser.add_argument("--title", help="title of the PNG")
    parser.add_argument("--max-rows", type=int, default=40, help="lanes drawn in the PNG at most (default 40)")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.eventlog import LogError
    from kvlifecycle.timeline import render_png, timeline_from_logs, write_chrome_trace

    try:
        timeline = timeline_from_logs(args.logs)
    except (LogError, ValueError) as exc:
        print(f"kvlifecycle timeline: {exc}", file=sys.stderr)
        return 2
    trace = write_chrome_trace(timeline, args.output)
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    span_ms = (timeline.t_end - timeline.t0) * 1e3
    print(f"{args.output}: {len(timeline.workers)} workers, {slices} slices, {len(timeline.instants)} instants, "
          f"{len(timeline.flows)} grant→completion flows over {span_ms:.1f} ms")
    if args.png:
        try:
            rows = render_png(timeline, args.png, title=args.title, max_rows=args.max_rows)
        except ImportError:
            print("kvlifecycle timeline: --png needs matplotlib (pip install 'kvlifecycle[viz]')", file=sys.stderr)
            return 2
        print(f"{args.png}: {rows} lanes")
    return 0
