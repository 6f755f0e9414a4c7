"""The README's tour runs as written."""

from __future__ import annotations

import re
from pathlib import Path


def test_readme_tour_runs() -> None:
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_readme_first_commands_are_the_ci_commands() -> None:
    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert commands[0].strip() == "bash scripts/setup.sh && .venv/bin/kvlifecycle demo"
    assert commands[1].strip() == "bash scripts/test.sh"
    assert "bash scripts/test.sh" in (root / ".ci" / "run").read_text()
