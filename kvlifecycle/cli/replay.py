"""``kvlifecycle replay LOG [LOG ...]``: fold event logs, print the state, and with ``--check`` any violations."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from kvlifecycle.eventlog import LogError


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        stamp = dt.datetime.fromisoformat(text)
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.timezone.utc)
        return stamp.timestamp()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("logs", nargs="+", metavar="LOG", help="event log directory (one per worker)")
    parser.add_argument(
        "--until",
        type=_parse_time,
        metavar="T",
        help="replay events up to wall time T (epoch seconds or ISO-8601; UTC if no zone)",
    )
    parser.add_argument("--until-index", type=int, metavar="N", help="replay the first N events only")
    parser.add_argument("--request", metavar="ID", help="show only this request's events")
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
    from kvlifecycle import events as ev
    from kvlifecycle.replay import check, check_pair, replay, summary

    results = []
    for path in args.logs:
        try:
            results.append(replay(path, until_index=args.until_index, until_time=args.until, request=args.request))
        except LogError as exc:
            print(f"kvlifecycle replay: {exc}", file=sys.stderr)
            return 2
    violations: list[str] = []
    if args.check:
        for result in results:
            violations += [f"{result.path}: {v}" for v in check(result, quiescent=args.quiescent)]
        violations += [str(v) for v in check_pair(results)]
    summaries = [summary(r) for r in results]
    if args.events:
        for s, r in zip(summaries, results, strict=False):
            s["event_list"] = [ev.to_dict(e) for e in r.events]
    if args.json:
        print(json.dumps({"logs": summaries, "violations": violations, "ok": not violations}, indent=2))
    else:
        for s in summaries:
            _print_summary(s)
        if args.check:
            print("invariants: OK" if not violations else f"invariants: {len(violations)} violation(s)")
            for v in violations:
                print(f"  VIOLATION {v}")
    return 1 if violations else 0


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
