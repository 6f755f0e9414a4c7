"""One version source; the wire and log versions each have a written history that names the current one; the
wheel ships py.typed and builds with no packaging deprecation warning."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import kvlifecycle
from kvlifecycle.events import SCHEMA_VERSION
from kvlifecycle.transport import WIRE_VERSION

ROOT = Path(__file__).resolve().parents[1]


def test_one_version_source() -> None:
    """pyproject reads the version from kvlifecycle/_version.py; no other module writes it."""
    assert kvlifecycle.__version__ == importlib.metadata.version("kvlifecycle")
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()
    literal = f'"{kvlifecycle.__version__}"'
    writers = sorted(str(p.relative_to(ROOT)) for top in ("kvlifecycle", "transports", "adapters")
                     for p in (ROOT / top).rglob("*.py") if literal in p.read_text())
    assert writers == ["kvlifecycle/_version.py"]


def _versions_in(section: str) -> list[int]:
    """The version column of the first table under ``## <section>`` in docs/wire.md."""
    text = (ROOT / "docs" / "wire.md").read_text()
    body = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [int(v) for v in re.findall(r"^\| (\d+) \|", body, flags=re.MULTILINE)]


def test_the_wire_history_ends_at_the_current_wire_version() -> None:
    versions = _versions_in("Side-channel wire")
    assert versions == list(range(1, WIRE_VERSION + 1)), "record the new WIRE_VERSION in docs/wire.md"


def test_the_log_history_ends_at_the_current_schema_version() -> None:
    versions = _versions_in("Event log")
    assert versions == list(range(1, SCHEMA_VERSION + 1)), "record the new SCHEMA_VERSION in docs/wire.md"


def test_the_changelog_keeps_an_unreleased_section() -> None:
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "keepachangelog.com" in text
    assert re.search(r"^## \[Unreleased\]$", text, flags=re.MULTILINE)


def test_the_wheel_ships_py_typed_and_builds_without_deprecation_warnings(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(tmp_path),
         str(ROOT)],
        capture_output=True, text=True, timeout=300, check=True,
    )
    assert "DeprecationWarning" not in out.stdout + out.stderr
    wheel = next(tmp_path.glob("kvlifecycle-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvlifecycle/py.typed" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert f"Version: {kvlifecycle.__version__}" in metadata
    assert "License-Expression: Apache-2.0" in metadata
