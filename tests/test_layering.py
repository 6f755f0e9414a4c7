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
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd="/")
    assert out.stdout.split() == ["True", "True", "True"]


def test_wheel_ships_subpackages_under_kvlifecycle_only(tmp_path) -> None:
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("kvlifecycle-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvlifecycle", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for module in (
        "kvlifecycle/cli/__init__.py",
        "kvlifecycle/transports/nixl.py",
        "kvlifecycle/adapters/vllm/connector.py",
        "kvlifecycle/adapters/sglang/plugin.py",
    ):
        assert module in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvlifecycle = kvlifecycle.cli:main" in text
    assert "[sglang.srt.plugins]" in text
