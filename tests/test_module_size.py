"""A module past 600 lines says at its top why it is one concept ("One concept, longer than most: ..."), so a long
file is a decision written down, not drift. Checked over the installed code: kvlifecycle/, transports/, adapters/."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 600
MARK = "One concept"


def long_modules_without_a_reason(base: Path, packages: tuple[str, ...]) -> list[str]:
    found = []
    for package in packages:
        for path in sorted((base / package).rglob("*.py")):
            text = path.read_text()
            lines = text.count("\n")
            if lines > LIMIT and MARK not in (ast.get_docstring(ast.parse(text)) or ""):
                found.append(f"{path.relative_to(base).as_posix()} ({lines} lines)")
    return found


def test_every_module_past_600_lines_says_why_it_is_one_concept() -> None:
    assert long_modules_without_a_reason(ROOT, ("kvlifecycle", "transports", "adapters")) == []


def test_a_long_module_without_its_reason_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "long.py").write_text('"""Many things."""\n' + "x = 1\n" * (LIMIT + 1))
    (tmp_path / "pkg" / "reasoned.py").write_text(f'"""{MARK}, longer than most."""\n' + "x = 1\n" * (LIMIT + 1))
    (tmp_path / "pkg" / "short.py").write_text('"""Short."""\n')
    assert long_modules_without_a_reason(tmp_path, ("pkg",)) == [f"pkg/long.py ({LIMIT + 2} lines)"]
