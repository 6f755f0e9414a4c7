"""Without the transports extra, ``kvlifecycle demo`` says in one line what to install: no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hidden_modules import env_hiding


def test_the_blocker_hides_nixl(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import nixl"], capture_output=True, text=True, timeout=60,
                         env=env_hiding(tmp_path, "nixl"))
    assert out.returncode != 0 and "No module named 'nixl'" in out.stderr


@pytest.mark.parametrize(("hidden", "named"), [(("nixl",), "needs nixl,"), (("nixl", "torch"), "needs nixl and torch")])
def test_demo_without_the_transports_extra_says_what_to_install(tmp_path: Path, hidden: tuple[str, ...],
                                                                named: str) -> None:
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "demo", "--out", str(tmp_path / "logs")],
                         capture_output=True, text=True, timeout=120, env=env_hiding(tmp_path, *hidden), cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert named in lines[0] and "pip install 'kvlifecycle[transports]'" in lines[0]
    assert not (tmp_path / "logs").exists()  # nothing started
