"""``kvlifecycle replay LOG [LOG ...]``: fold event logs, print the state, and with ``--check`` any violations;
with ``--request ID`` that request's story across every log, with ``--block N --worker W`` that block's life.

Exit codes: 0 clean, 1 violations found (``--check``), 2 the input could not be read or is impossible (one line on
stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from kvlifecycle.eventlog import LogError
from kvlifecycle.ledger import LedgerError

# What a log that cannot be read, or holds what no ledger could have written, raises on its way through the
# library: each ends the command with one line on stderr and exit code 2.
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (
    LogError,
    LedgerError,
    LookupError,
    ValueError,
    TypeError,
    OverflowError,
    MemoryError,
)


def input_error(verb: str, exc: BaseException, path: str | None = None) -> int:
    """Report ``exc`` (met reading the log at ``path``, when known) on one stderr line; exit code 2."""
    from kvlifecycle.story import NotInLogsError

    if isinstance(exc, LogError | NotInLogsError):
        text = str(exc)
    else:
        kind = "" if isinstance(exc, LedgerError) else f"{type(exc).__name__}: "
        text = f"{path + ': ' if path else ''}impossible log: {kind}{exc}"
    print(f"kvlifecycle {verb}: {' '.join(text.split())}", file=sys.stderr)
    return 2


@dataclass(frozen=True, slots=True)
class Moment:
    """``--until``: a wall time (seconds since the epoch) or an offset from the first event of the logs."""

    wall: float | None = None
    offset_s: float | None = None

    def until_kwargs(self) -> dict[str, float]:
        return {"until_time": self.wall} if self.wall is not None else {"until_offset_s": self.offset_s or 0.0}


_OFFSET = re.compile(r"^\+(\d+(?:\.\d*)?|\.\d+)(ms|s)?$")


def _parse_time(text: str) -> Moment:
    offset = _OFFSET.match(text.strip())
    if offset:
        value = float(offset.group(1))
        return Moment(offset_s=value / 1e3 if offset.group(2) == "ms" else value)
    try:
        return Moment(wall=float(text))
    except ValueError:
        try:
            stamp = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a time: epoch seconds, ISO-8601, or +N ms / +N s after the first event") from None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.timezone.utc)
        return Moment(wall=stamp.timestamp())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG",
                        help="event log directory (one per worker; a directory of log directories also works)")
    parser.add_argument(
        "--until",
        type=_parse_time,
        metavar="T",
        help="stop at time T: epoch seconds, ISO-8601 (UTC if no zone), or +N ms / +N s after the first event",
    )
    parser.add_argument("--until-index", type=int, metavar="N", help="replay the first N events of each log only")
    parser.add_argument("--request", metavar="ID",
                        help="the request's story: each of its events on every log, in causal order, and its summary")
    parser.add_argument("--block", type=int, metavar="N",
                        help="the block's life on --worker: its epochs, owners, states and transfers")
    parser.add_argument("--worker", metavar="W",
                        help="with --block: the worker (its name, or P / D when one log has that side)")
    parser.add_argument(
        "--check",
        action="store_true",
        help="check invariants (per log, and across P and D logs); exit 1 on a violation",
    )
    parser.add_argument(
        "--quiescent",
        action="store_true",
        help="with --check: also require no pins, leases or in-flight loads at the end",
    )
    parser.add_argument("--events", action="store_true", help="print the events too")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        if args.request is not None or args.block is not None:
            return _run_story(args)
        return _run_summary(args)
    except BAD_INPUT_ERRORS as exc:
        return input_error("replay", exc)
    except BrokenPipeError:
        from kvlifecycle.cli.render import stdout_closed

        return stdout_closed()


def _violations(results: list[Any], quiescent: bool) -> list[str]:
    from kvlifecycle.replay import check, check_pair

    out: list[str] = []
    for result in results:
        out += [f"{result.path}: {v}" for v in check(result, quiescent=quiescent)]
    return out + [str(v) for v in check_pair(results)]


def _run_summary(args: argparse.Namespace) -> int:
    from kvlifecycle import events as ev
    from kvlifecycle.merge import expand_log_dirs
    from kvlifecycle.replay import replay, summary
    from kvlifecycle.story import step_view, trace_logs

    until = args.until
    if until is not None and until.wall is None:  # an offset: from the first event of all the logs given
        until = Moment(wall=trace_logs(args.logs).t0 + (until.offset_s or 0.0))
    results = []
    for path in map(str, expand_log_dirs(args.logs)):  # a directory of log directories stands for its logs
        try:
            results.append(replay(path, until_index=args.until_index, until_time=until.wall if until else None))
        except BAD_INPUT_ERRORS as exc:
            return input_error("replay", exc, path)
    violations = _violations(results, args.quiescent) if args.check else []
    summaries = [summary(r) for r in results]
    if args.json:
        if args.events:
            for s, r in zip(summaries, results, strict=True):
                s["event_list"] = [ev.to_dict(e) for e in r.events]
        print(json.dumps({"logs": summaries, "violations": violations, "ok": not violations}, indent=2))
        return 1 if violations else 0
    for s in summaries:
        _print_summary(s)
    if args.events:
        from kvlifecycle.cli.render import STEP_COLUMNS, Output, step_row

        trace = trace_logs(args.logs, **(until.until_kwargs() if until else {}), until_index=args.until_index)
        out = Output()
        out.line(f"events of {', '.join(trace.logs)} merged in causal order (ms since {_iso(trace.t0)}):")
        out.table(STEP_COLUMNS, [step_row(step_view(trace, s)) for s in trace.steps])
    if args.check:
        print("invariants: OK" if not violations else f"invariants: {len(violations)} violation(s)")
        for v in violations:
            print(f"  VIOLATION {v}")
    return 1 if violations else 0


def _iso(wall: float) -> str:
    from kvlifecycle.cli.render import iso

    return iso(wall)


def _run_story(args: argparse.Namespace) -> int:
    from kvlifecycle.replay import ReplayResult
    from kvlifecycle.story import (
        NotInLogsError,
        block_story,
        block_view,
        no_such_request,
        request_story,
        request_view,
        trace_logs,
    )

    if args.block is not None and args.request is not None:
        raise NotInLogsError("--request and --block are two views: give one")
    trace = trace_logs(args.logs, **(args.until.until_kwargs() if args.until else {}), until_index=args.until_index)
    if args.request is not None:
        view = request_view(trace, request_story(trace, args.request))
        if not view["steps"]:
            raise no_such_request(trace, [args.request])
    else:
        worker = args.worker
        if worker is None:
            if len(trace.logs) != 1:
                raise NotInLogsError(f"--block needs --worker: one of {', '.join(trace.logs)} (or P / D)")
            worker = next(iter(trace.logs))
        view = block_view(trace, block_story(trace, args.block, worker))
    violations: list[str] = []
    if args.check:
        results = [ReplayResult(log.path, log.header, log.ledger, log.events) for log in trace.logs.values()]
        violations = _violations(results, args.quiescent)
    if args.until is not None:
        wall = args.until.wall if args.until.wall is not None else trace.t0 + (args.until.offset_s or 0.0)
        view["until_ms"] = round(trace.ms(wall), 3)
    if args.json:
        print(json.dumps({**view, "violations": violations, "ok": not violations}, indent=2))
    else:
        from kvlifecycle.cli.render import Output

        out = Output()
        (_print_request if args.request is not None else _print_block)(out, view)
        if args.check:
            out.line("invariants: OK" if not violations else f"invariants: {len(violations)} violation(s)")
            for v in violations:
                out.line(f"  VIOLATION {v}", "bold red")
    return 1 if violations else 0


def _print_request(out: Any, view: dict[str, Any]) -> None:
    from kvlifecycle.cli.render import STEP_COLUMNS, step_row

    workers = sorted({s["worker"] for s in view["steps"]})
    at = f", as of +{view['until_ms']:.3f} ms" if "until_ms" in view else ""
    out.line(f"request {view['request']}: {len(view['steps'])} events on {', '.join(workers)}{at} "
             f"(times in ms since {_iso(view['t0'])})", "bold")
    out.table(STEP_COLUMNS, [step_row(s) for s in view["steps"]])
    out.line(f"outcome: {view['outcome']} ({'ended' if view['ended'] else 'NOT ended'})",
             "green" if view["ended"] else "bold yellow")
    for part in view["parts"]:
        out.line(f"  {part['worker']} ({part['side']}): blocks {part['blocks'] or '-'}, epoch {part['epoch']}, "
                 f"{part['state']}")
        for x in part["leases"]:
            end = f"ended {x['ended']} at +{x['ended_ms']:.3f} ms" if x["ended"] else "LIVE"
            peers = f", claimed by {', '.join(x['peers'])}" if x["peers"] else ""
            out.line(f"    lease {x['transfer']} gen {x['generation']}: granted +{x['granted_ms']:.3f} ms, deadline "
                     f"+{x['deadline_ms']:.3f} ms, renewed {x['renewals']}x{peers}, {end}"
                     + (f" ({x['detail']})" if x["detail"] else ""))
        for x in part["loads"]:
            end = (f"{x['outcome']} at +{x['settled_ms']:.3f} ms" if x["outcome"] else
                   f"IN FLIGHT ({len(x['parts_done'])} of {x['parts']} parts done)")
            out.line(f"    load {x['transfer']} gen {x['generation']} ({x['mode']} from {x['peer'] or '?'}, "
                     f"{x['parts']} part(s)): started +{x['started_ms']:.3f} ms, {end}"
                     + (f" ({x['reason']})" if x["reason"] else "") + _digest_words(x))
        for refusal in part["refusals"]:
            out.line(f"    refused {refusal}", "red")


def _digest_words(load: dict[str, Any]) -> str:
    """What D's digest check found for a load: the verified parts and blocks, the blocks that failed; "" when
    nothing was checked (verification off, or no part landed)."""
    words = []
    if load.get("verified_parts"):
        words.append(f"{load['verified_blocks']} block(s) verified in {load['verified_parts']} of "
                     f"{load['parts']} part(s)")
    if load.get("mismatched_blocks"):
        words.append(f"{load['mismatched_blocks']} block(s) failed their digest")
    return f"; digests: {', '.join(words)}" if words else ""


def _print_block(out: Any, view: dict[str, Any]) -> None:
    from kvlifecycle.cli.render import STEP_COLUMNS, step_row

    at = f" as of +{view['until_ms']:.3f} ms" if "until_ms" in view else ""
    out.line(f"block {view['block']} on {view['worker']} ({view['side']}): {view['state']}{at}, epoch "
             f"{view['epoch']} (times in ms since {_iso(view['t0'])})", "bold")
    for epoch in view["epochs"]:
        states = " → ".join(f"{x['state']} +{x['since_ms']:.3f} ms" for x in epoch["states"])
        out.line(f"  epoch {epoch['epoch']}: {epoch['request'] or '(no owner)'}: {states}")
        for use in epoch["transfers"]:
            outcome = f", {use['outcome']}" if use["outcome"] else ""
            out.line(f"    transfer {use['transfer']} gen {use['generation']}: {use['how']}{outcome}")
    if not view["steps"]:
        out.line("  no event of these logs touched it")
        return
    out.line("events (the block's, and its transfers' on the peer):")
    out.table(STEP_COLUMNS, [step_row(s) for s in view["steps"]])


def _print_summary(s: dict) -> None:
    print(f"{s['path']}  side={s['side']} worker={s['worker']} events={s['events']} requests={s['requests']}")
    nonzero = {k: v for k, v in s["blocks"].items() if v}
    print(f"  blocks: {nonzero}")
    stats = {k: v for k, v in s["stats"].items() if v}
    if stats:
        print(f"  stats: {stats}")
    if s["refusals"]:
        print(f"  refused: {s['refusals']}")
    for key in ("leases", "loads"):
        if s.get(key):
            print(f"  live {key}: {len(s[key])}")
            for transfer, info in list(s[key].items())[:10]:
                print(f"    {transfer}: {info}")
    if "torn_tail" in s:
        t = s["torn_tail"]
        print(f"  torn tail: {t['dropped_bytes']} bytes at {t['segment']}:{t['offset']} ({t['reason']})")
    for restart in s.get("restarts", []):
        print(f"  restart at event {restart['at_index']}: previous incarnation left {restart}")
