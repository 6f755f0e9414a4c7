"""``kvlifecycle timeline LOG [LOG ...] -o trace.json [--png out.png]``: P and D logs as one Perfetto trace.

``--request ID`` (repeatable) keeps the handoffs of those requests, followed across P and D as ``replay --request``
follows them; ``--since`` / ``--until`` keep a window of time (the syntax of ``explain --until``). On a terminal a
bar on stderr shows the reading, building, writing and drawing; elsewhere nothing but the summary lines is printed.
Exit codes: 0 written, 2 the input could not be read or matched nothing (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvlifecycle.cli.replay import BAD_INPUT_ERRORS, Moment, _parse_time, input_error

if TYPE_CHECKING:
    from kvlifecycle.timeline import Tick, Timeline

STAGES = 3  # reading and building; writing the trace; drawing the PNG (when asked)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="event log directory (one per worker; a directory of log directories also works)")
    parser.add_argument("-o", "--output", default="trace.json",
                        help="Chrome-trace/Perfetto JSON to write (default trace.json; open in ui.perfetto.dev)")
    parser.add_argument("--png", metavar="PATH", help="also draw the timeline as a PNG (matplotlib)")
    parser.add_argument("--title", help="title of the PNG")
    parser.add_argument("--max-rows", type=int, default=40,
                        help="lanes drawn in the PNG at most, when it draws every request (default 40)")
    parser.add_argument("--sample", type=int, default=16,
                        help="requests drawn one by one in the PNG at most; with more, the PNG shows blocks per "
                             "state on each worker and this many requests, spread over the run, in detail "
                             "(default 16)")
    parser.add_argument("--request", action="append", metavar="ID", default=None,
                        help="only this request's handoff (P's or D's id; the other side's events come with it "
                             "through the transfer); repeat for more")
    parser.add_argument("--since", type=_parse_time, metavar="T",
                        help="only from time T: epoch seconds, ISO-8601 (UTC if no zone), or +N ms / +N s after "
                             "the first event")
    parser.add_argument("--until", type=_parse_time, metavar="T", help="only up to time T (as --since)")


def _wall(moment: Moment | None, first_event: float) -> float | None:
    if moment is None:
        return None
    return moment.wall if moment.wall is not None else first_event + (moment.offset_s or 0.0)


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.tools.progress import progress

    error: BaseException | None = None
    timeline: Timeline | str = ""
    lines: list[str] = []
    with progress("timeline", total=STAGES if args.png else STAGES - 1) as tick:
        try:
            timeline = _read(args, tick)
        except BAD_INPUT_ERRORS as exc:
            error = exc
        if not isinstance(timeline, str):
            lines = _write(args, timeline, tick)
    # printed once the bar is gone: while it is drawn, rich sends stdout through the bar's console (stderr)
    if error is not None:
        return input_error("timeline", error)
    if isinstance(timeline, str):
        print(f"kvlifecycle timeline: {timeline}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def _read(args: argparse.Namespace, tick: Tick) -> Timeline | str:
    """The timeline the arguments ask for, or why the arguments are refused."""
    from kvlifecycle.timeline import cut_to_window, request_events, timeline_from_logs

    keep: frozenset[tuple[str, int]] | None = None
    requests: tuple[str, ...] = ()
    tick("reading the logs", 0)
    if args.request:
        picked = request_events(args.logs, args.request)
        keep, requests = picked.keep, picked.requests
    timeline = timeline_from_logs(args.logs, keep=keep, tick=tick)
    timeline.requests = requests
    if args.since is None and args.until is None:
        return timeline
    since, until = _wall(args.since, timeline.first_event), _wall(args.until, timeline.first_event)
    if since is not None and until is not None and until < since:
        return "--until is before --since"
    return cut_to_window(timeline, since, until)


def _write(args: argparse.Namespace, timeline: Timeline, tick: Tick) -> list[str]:
    """Write the trace (and the PNG); the lines that say what was written."""
    from kvlifecycle.timeline import render_png, write_chrome_trace

    tick("writing the trace", 0)
    trace = write_chrome_trace(timeline, args.output)
    tick(None, 1)
    slices = sum(1 for e in trace["traceEvents"] if e["ph"] == "X")
    lo, hi = timeline.view
    cut = f" (requests {', '.join(timeline.requests)})" if timeline.requests else ""
    lines = [f"{args.output}: {len(timeline.workers)} workers, {slices} slices, {len(timeline.instants)} instants, "
             f"{len(timeline.flows)} grant→completion flows over {(hi - lo) * 1e3:.1f} ms{cut}"]
    if args.png:
        tick("drawing the PNG", 0)
        drawing = render_png(timeline, args.png, title=args.title, max_rows=args.max_rows, sample=args.sample,
                             tick=tick)
        lines.append(f"{args.png}: {drawing.describe()}")
    return lines
