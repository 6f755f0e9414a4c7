"""``kvlifecycle sim``: the deterministic P/D fault simulation over the real ledgers (docs/simulation.md).

Runs seeds, prints a coverage table (each machine edge and each fault, how often exercised), and for a failing seed
the one command that reproduces it, a shrunk trace and both workers' logs (``kvlifecycle replay --check`` and
``kvlifecycle timeline`` open them). With ``--json`` the last line is one JSON object. Exit code 1 on a violation or
leak (or, with ``--require-coverage``, an unexercised edge or fault); 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _workers(text: str) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """``P=2+1,D=2``: prefill TP groups of 2 and 1 ranks, two decode workers of TP 1. ``D=2+1``: decode TP groups
    of 2 and 1 ranks; a ``D`` of one number ``n`` is ``n`` TP-1 workers; ``D=2+``: one TP-2 instance. Without
    ``D``, each seed draws its decode shape (``SimConfig.d_groups`` None)."""
    groups: tuple[int, ...] = (2, 1)
    d: tuple[int, ...] | None = None
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        try:
            if key.upper() == "P":
                groups = tuple(int(x) for x in value.split("+"))
            elif key.upper() == "D":
                d = tuple(int(x) for x in value.split("+") if x) if "+" in value else (1,) * int(value)
            else:
                raise ValueError(key)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected P=<tp>+<tp>...,D=<n> or D=<tp>+<tp>... "
                                             "(e.g. P=2+1,D=2)") from None
    widths = groups + (d or ())
    if not groups or d == () or min(widths) < 1 or 64 % max(widths):
        raise argparse.ArgumentTypeError(f"{text!r}: TP widths must be 1, 2 or 4 and there must be a D worker")
    return groups, d


def _d_spec(d: tuple[int, ...] | None) -> str:
    """The ``,D=...`` of ``--workers`` that gives decode shape ``d`` (None: the seed's, no ``D``)."""
    if d is None:
        return ""
    if max(d) == 1:
        return f",D={len(d)}"
    return f",D={'+'.join(map(str, d))}{'+' if len(d) == 1 else ''}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seeds", type=int, default=200, metavar="N", help="run N seeds (default 200)")
    parser.add_argument("--start", type=int, default=0, metavar="S0", help="first seed of --seeds (default 0)")
    parser.add_argument("--seed", type=int, metavar="S", help="run just seed S (a reproducer)")
    parser.add_argument("--faults", metavar="LIST",
                        help="comma-separated faults to inject (default all): drop, duplicate, reorder, slow, "
                             "partition, post_fail, handle_fail, duplicate_completion, cancel, expiry, p_restart, "
                             "d_crash, drift, jump, redeliver, disk, corrupt, uncancellable, invalidate_writer")
    parser.add_argument("--workers", type=_workers, metavar="SPEC",
                        help="cluster shape, e.g. P=2+1,D=2 or P=2+1,D=2+1 (default: P=2+1, and each seed draws D=2 "
                             "or D=2+1)")
    parser.add_argument("--steps", type=int, metavar="N", help="scheduler steps per seed before the drain")
    parser.add_argument("--out", type=Path, default=Path("kvl-sim-failures"), metavar="DIR",
                        help="where a failing seed's shrunk trace and logs go (default ./kvl-sim-failures)")
    parser.add_argument("--no-shrink", action="store_true", help="write the failing run's full trace, unshrunk")
    parser.add_argument("--require-coverage", action="store_true",
                        help="exit 1 when an edge or fault was exercised by no seed")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (the table and failures go to stderr)")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.sim.faults import parse_faults
    from kvlifecycle.sim.report import coverage_rows, quote_args, run_many
    from kvlifecycle.sim.world import SimConfig

    try:
        faults = parse_faults(args.faults)
    except ValueError as exc:
        print(f"kvlifecycle sim: {exc}", file=sys.stderr)
        return 2
    kwargs: dict = {"faults": faults}
    if args.workers is not None:
        kwargs["p_groups"], kwargs["d_groups"] = args.workers
    if args.steps is not None:
        kwargs["steps"] = args.steps
    config = SimConfig(**kwargs)
    repro = []
    if args.faults:
        repro += ["--faults", args.faults]
    if args.workers is not None:
        repro += ["--workers", f"P={'+'.join(map(str, config.p_groups))}{_d_spec(config.d_groups)}"]
    if args.steps is not None:
        repro += ["--steps", str(args.steps)]
    seeds = [args.seed] if args.seed is not None else range(args.start, args.start + args.seeds)

    text = sys.stderr if args.json else sys.stdout  # with --json, stdout holds the one JSON object alone

    def said(failure) -> None:
        print(f"FAIL seed {failure.seed}: {failure.first}", file=text)
        print(f"  reproduce: {failure.reproduce}", file=text)
        if failure.trace:
            print(f"  shrunk trace ({failure.shrunk_steps} of {failure.steps} steps): {failure.trace}", file=text)
            print(f"  logs: {failure.logs}  (kvlifecycle replay --check {failure.logs}/*; "
                  f"kvlifecycle timeline {failure.logs}/*)", file=text)

    summary = run_many(seeds, config, out=args.out, cli_args=quote_args(repro), do_shrink=not args.no_shrink,
                       on_failure=said)
    print(f"{'count':>8}  edge / fault", file=text)
    for count, name in coverage_rows(summary):
        print(f"{count:>8}  {name}", file=text)
    data = summary.to_json()
    print(f"seeds {summary.seeds}, violations {summary.violations}, leaks {summary.leaks}, "
          f"corrupted reads {summary.corrupted_reads}, "
          f"known findings {dict(summary.known)}, unexercised {len(data['unexercised'])}, "
          f"{data['seeds_per_s']} seeds/s ({data['seeds_per_cpu_s']} per CPU second)", file=text)
    if args.json:
        data.pop("coverage")
        print(json.dumps({**data, "coverage": dict(summary.coverage)}, sort_keys=True))
    failed = summary.violations or summary.leaks or (args.require_coverage and data["unexercised"])
    return 1 if failed else 0
