"""Fixtures for the real-vLLM end-to-end tests: skip cleanly without the vLLM venv, unless KVL_REQUIRE_ALL=1."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import harness

MODEL_CACHE = Path(os.environ.get("KVL_MODEL_CACHE", Path.home() / ".cache" / "kvlifecycle" / "models"))


def require_vllm() -> None:
    if harness.VLLM_CLI.exists() and harness.VLLM_PYTHON.exists():
        return
    reason = (f"vLLM venv missing ({harness.VLLM_VENV}); create it with scripts/setup-vllm-env.sh")
    if os.environ.get("KVL_REQUIRE_ALL") == "1":
        pytest.fail(reason + " [KVL_REQUIRE_ALL=1: not skipping]")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    require_vllm()
    return harness.build_tiny_model(MODEL_CACHE)


def start_all(servers: Iterable[harness.ManagedProcess], timeout_s: float = 420.0) -> None:
    """Start every server at once (start-up is the slow part), then wait for each, bounded overall."""
    servers = list(servers)
    for server in servers:
        server.start()
    deadline = time.monotonic() + timeout_s
    for server in servers:
        left = max(deadline - time.monotonic(), 1.0)
        server.wait_ready(left)


def replay_json(*log_dirs: Path, quiescent: bool = False, events: bool = False) -> tuple[int, dict]:
    """``kvlifecycle replay --check --json`` on event-log directories (the CLI, as a user would run it)."""
    import json

    argv = [sys.executable, "-m", "kvlifecycle", "replay", "--check", "--json", *map(str, log_dirs)]
    if quiescent:
        argv.insert(5, "--quiescent")
    if events:
        argv.insert(5, "--events")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError:
        return out.returncode, {"stdout": out.stdout, "stderr": out.stderr}


def event_dirs(root: Path, side: str) -> list[Path]:
    return sorted(p for p in root.glob(f"{side}-*") if p.is_dir())
