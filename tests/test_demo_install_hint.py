"""Without the transports extra, ``kvlifecycle demo`` says in one line what to install: no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# a sitecustomize that makes the named top-level packages look not installed, in the process and its children
HIDE = '''
import sys

HIDDEN = {hidden!r}


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
'''


def _demo_without(tmp_path: Path, *hidden: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "sitecustomize.py").write_text(HIDE.format(hidden=set(hidden)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "demo", "--out", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)


def test_the_blocker_hides_nixl(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(HIDE.format(hidden={"nixl"}))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", "import nixl"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode != 0 and "No module named 'nixl'" in out.stderr


@pytest.mark.parametrize(("hidden", "named"), [(("nixl",), "needs nixl,"), (("nixl", "torch"), "needs nixl and torch")])
def test_demo_without_the_transports_extra_says_what_to_install(tmp_path: Path, hidden: tuple[str, ...],
                                                                named: str) -> None:
    out = _demo_without(tmp_path, *hidden)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert named in lines[0] and "pip install 'kvlifecycle[transports]'" in lines[0]
    assert not (tmp_path / "logs").exists()  # nothing started
