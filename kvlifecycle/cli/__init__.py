"""The ``kvlifecycle`` command line.

Each verb lives in its own module under ``kvlifecycle.cli`` and exposes ``add_arguments(parser)`` and
``run(args) -> int``. Verb modules keep heavy imports (torch, nixl, engines) inside ``run`` so that ``--help``
and the core verbs stay cheap: the CLI is the one place that wires transports and adapters in, lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# verb -> (module under kvlifecycle.cli, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "P/D handoff between two processes over NIXL (DRAM), then replay and check both logs"),
    "replay": ("replay", "replay event logs, print the state summary and invariant violations"),
    "timeline": ("timeline", "merge P and D logs into a Perfetto/Chrome trace (and a PNG)"),
    "doctor": ("doctor", "which NIXL plugins and paths work here, and how fast they are"),
    "proxy": ("proxy", "OpenAI-compatible P/D proxy in front of prefill and decode servers"),
    "bench": ("bench", "benchmarks: lifecycle, transport, ..."),
    "diagram": ("diagram", "write the state-machine diagrams (Mermaid) generated from the declarations"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlifecycle", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        try:
            module = importlib.import_module(f"kvlifecycle.cli.{module_name}")
        except ModuleNotFoundError as exc:  # a verb whose module is not written yet
            if exc.name != f"kvlifecycle.cli.{module_name}":
                raise
            continue
        module.add_arguments(verb_parser)
        verb_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "_run", None)
    if run is None:
        parser.error(f"verb {args.verb!r} is not available in this build")
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
