"""docs/embedding.md runs as written: its code blocks in order, in one namespace (the real ledgers and log, the
real replay, a real NIXL handoff); the conformance block runs under pytest as a third party's test file would."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "embedding.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)


def test_the_page_has_the_four_parts() -> None:
    blocks = _blocks()
    assert len(blocks) == 4
    assert "open_ledger" in blocks[0] and "EventLog(" in blocks[0]
    assert "replay_log" in blocks[1] and "check_pair" in blocks[1]
    assert "Producer" in blocks[2] and "Consumer" in blocks[2]
    assert "TransportConformance" in blocks[3]


def test_the_ledger_replay_and_handoff_blocks_run_and_the_logs_replay_clean() -> None:
    pytest.importorskip("nixl")
    namespace: dict[str, object] = {}
    for block in _blocks()[:3]:
        exec(compile(block, str(PAGE), "exec"), namespace)
    logs = namespace["logs"]
    assert isinstance(logs, Path)
    done = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", str(logs / "p0"), str(logs / "d0"),
                           "--check", "--quiescent"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "invariants: OK" in done.stdout


def test_the_conformance_block_runs_under_pytest(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    (tmp_path / "test_my_transport.py").write_text(_blocks()[3])
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(tmp_path / "test_my_transport.py"), "-k", "byte or notification"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
