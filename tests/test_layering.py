"""The core imports no torch, NIXL or engine, and no transport or adapter (checked in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

CORE_MODULES = [
    "kvlifecycle",
    "kvlifecycle.machines",
    "kvlifecycle.ledger",
    "kvlifecycle.eventlog",
    "kvlifecycle.replay",
    "kvlifecycle.invariants",
    "kvlifecycle.cli",
    "kvlifecycle.cli.replay",
]
FORBIDDEN = ("torch", "nixl", "vllm", "sglang", "kvlifecycle.transports", "kvlifecycle.adapters")


def test_core_imports_nothing_heavy() -> None:
    code = (
        "import importlib, sys\n"
        f"for m in {CORE_MODULES!r}: importlib.import_module(m)\n"
        f"bad = sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith({FORBIDDEN!r}))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == ""


def test_transports_and_adapters_are_subpackages_not_top_level_names() -> None:
    code = (
        "import importlib.util as u\n"
        "print(u.find_spec('kvlifecycle.transports') is not None, u.find_spec('kvlifecycle.adapters') is not None,"
        " u.find_spec('transports') is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         cwd="/")
    assert out.stdout.split() == ["True", "True", "True"]
