"""docs/debugging.md shows real output: each command it runs on ``tests/debug_scenarios.py``'s logs prints, today,
exactly what the page shows (transfer ids aside: they carry a random incarnation)."""

from __future__ import annotations

import io
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS

from kvlifecycle.cli import main

DOC = Path(__file__).resolve().parents[1] / "docs" / "debugging.md"
TRANSFER_ID = re.compile(r"\b(p\d)\.[0-9a-f]{8}\.")


def doc_runs() -> list[tuple[str, str]]:
    """(command, output) of every block that runs ``kvlifecycle`` on /tmp/kvl-debug as its first line."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in DOC.read_text().splitlines():
        if line.startswith("```") and current is None:
            current = []
        elif line.startswith("```"):
            blocks.append(current)
            current = None
        elif current is not None:
            current.append(line)
    return [(block[0][2:], "\n".join(block[1:])) for block in blocks
            if block and block[0].startswith("$ kvlifecycle ") and "/tmp/kvl-debug/" in block[0]
            and "|" not in block[0]]


def test_the_page_runs_commands_on_the_scenarios() -> None:
    assert len(doc_runs()) >= 6


@pytest.mark.parametrize(("command", "shown"), doc_runs(), ids=[c for c, _ in doc_runs()])
def test_debugging_page_output_is_real(tmp_path: Path, command: str, shown: str) -> None:
    scenario = command.split("/tmp/kvl-debug/", 1)[1].split()[0]
    SCENARIOS[scenario](tmp_path / scenario)
    argv = command.replace("/tmp/kvl-debug", str(tmp_path)).split()[1:]
    buffer = io.StringIO()
    with redirect_stdout(buffer):
        main(argv)
    assert TRANSFER_ID.sub(r"\1.X.", buffer.getvalue().rstrip("\n")) == TRANSFER_ID.sub(r"\1.X.", shown)
