"""The ``kvlifecycle`` command line.

Each verb lives in its own module (the library's verbs under ``kvlifecycle.cli``, the tools' under
``kvlifecycle.tools``) and exposes ``add_arguments(parser)`` and ``run(args) -> int``. Verb modules keep heavy
imports (torch, nixl, engines) inside ``run`` so that ``--help`` and the core verbs stay cheap: the CLI and the
tools are the one place that wires transports and adapters in, lazily.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvlifecycle.cli.arguments import USER_ERRORS, OneLineErrorParser, describe_user_error, validate_numbers

# verb -> (module, one-line help)
VERBS: dict[str, tuple[str, str]] = {
    "demo": ("kvlifecycle.tools.demo",
             "P/D handoff between two processes over NIXL (DRAM), then replay and check both logs"),
    "replay": ("kvlifecycle.cli.replay",
               "replay event logs: the state, the invariants, a request's story (--request), a block's life (--block)"),
    "explain": ("kvlifecycle.cli.explain",
                "explain what went wrong in event logs: each finding's chain of events and one sentence"),
    "sim": ("kvlifecycle.cli.sim", "deterministic P/D fault simulation over the real ledgers, seed by seed"),
    "timeline": ("kvlifecycle.cli.timeline", "merge P and D logs into a Perfetto/Chrome trace (and a PNG)"),
    "doctor": ("kvlifecycle.tools.doctor", "which NIXL plugins and paths work here, and how fast they are"),
    "proxy": ("kvlifecycle.cli.proxy", "OpenAI-compatible P/D proxy in front of prefill and decode servers"),
    "drain": ("kvlifecycle.cli.drain",
              "scale a prefill instance in through etcd: no new work, live leases finish, then it leaves"),
    "bench": ("kvlifecycle.cli.bench", "benchmarks: lifecycle, transport, ..."),
    "diagram": ("kvlifecycle.cli.diagram",
                "write the state-machine diagrams (Mermaid) generated from the declarations"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that verb's module is imported (a verb never pays for another's imports)."""
    from kvlifecycle._version import __version__

    parser = OneLineErrorParser(prog="kvlifecycle", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvlifecycle {__version__}")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, (module_name, help_text) in VERBS.items():
        verb_parser = sub.add_parser(verb, help=help_text, description=help_text)
        if only is not None and verb != only:
            continue
        module = importlib.import_module(module_name)
        module.add_arguments(verb_parser)
        validate_numbers(verb_parser)
        verb_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(only=verb if verb in VERBS else "")
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except SystemExit as exc:
        if isinstance(exc.code, str):  # a verb's refusal in words: one line, the usage-error status
            print(exc.code if exc.code.startswith("kvlifecycle") else f"kvlifecycle {args.verb}: {exc.code}",
                  file=sys.stderr)
            return 2
        raise
    except BrokenPipeError:  # the reader went away (``| head``): stop quietly, as a Unix filter does
        from kvlifecycle.cli.render import stdout_closed

        return stdout_closed()
    except USER_ERRORS as exc:
        print(f"kvlifecycle {args.verb}: {describe_user_error(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
