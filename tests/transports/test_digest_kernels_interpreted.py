"""The GPU digester's Triton kernels, the code a GPU runs, checked in CI without a GPU: Triton's interpreter
(``TRITON_INTERPRET=1``) runs them over host tensors, in the vLLM venv (the one with Triton), against the host
contract (``xxhash``). Every row kernel, chain and root variant, the fused copy, head slices and pieces."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("digest_kernels_interpreted.py")
TRITON_PYTHON = Path(os.environ.get("KVL_VLLM_VENV", REPO_ROOT / ".venv-vllm")) / "bin" / "python"


def require_triton_python() -> None:
    """Skip where the vLLM venv (the Python with Triton) is absent; fail instead under ``KVL_REQUIRE_ALL=1`` (CI)."""
    if not TRITON_PYTHON.exists():
        reason = f"no Python with Triton ({TRITON_PYTHON}); create it with scripts/setup-vllm-env.sh"
        if os.environ.get("KVL_REQUIRE_ALL") == "1":
            pytest.fail(reason + " [KVL_REQUIRE_ALL=1: not skipping]")
        pytest.skip(reason)


def _run(*extra: str) -> subprocess.CompletedProcess[str]:
    require_triton_python()
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([str(TRITON_PYTHON), *extra], env=env, capture_output=True, text=True, timeout=600,
                          cwd=REPO_ROOT, check=False)


def test_the_gpu_kernels_interpreted_equal_the_host_contract() -> None:
    out = _run(str(RUNNER))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.split()
    assert lines.count("ok") == 11 + 8 + 2, out.stdout  # every shape, every root count, the fused copy, the flip


MUTANT = """
import runpy
import sys

import triton
import triton.language as tl

import kvlifecycle.transports.digest_gpu as kernels


@triton.jit
def _scramble(acc, key):  # XXH3 shifts by 47
    acc = acc ^ (acc >> 46)
    acc = acc ^ key
    return acc * 0x9E3779B1


kernels._scramble = _scramble  # what every chain kernel calls, looked up in the module when it runs
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def test_a_wrong_kernel_is_caught_interpreted(tmp_path: Path) -> None:
    """The mutant: the chains' scramble with one shift off computes other digests, and the runner fails on its first
    shape."""
    mutant = tmp_path / "mutant.py"
    mutant.write_text(MUTANT)
    out = _run(str(mutant), str(RUNNER))
    assert out.returncode != 0 and "AssertionError" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ok shape" not in out.stdout


# the module with one edit, loaded from its own file under its own name (Triton reads a kernel's source from there)
EDITED_MODULE = """
import importlib.util
import runpy
import sys

spec = importlib.util.spec_from_file_location("kvlifecycle.transports.digest_gpu", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
runpy.run_path(sys.argv[2], run_name="__main__")
"""


def test_a_count_the_one_launch_kernel_leaves_behind_is_caught_interpreted(tmp_path: Path) -> None:
    """The mutant: the unit's last leaf writes the root but leaves its count set, so the next launch on the stream
    would never see the unit complete; the runner checks the counts after every call."""
    source = (REPO_ROOT / "transports" / "digest_gpu.py").read_text()
    reset = "            tl.store(arrived_ptr + unit, 0)\n"
    assert source.count(reset) == 1
    (tmp_path / "digest_gpu.py").write_text(source.replace(reset, ""))
    (tmp_path / "edited.py").write_text(EDITED_MODULE)
    out = _run(str(tmp_path / "edited.py"), str(tmp_path / "digest_gpu.py"), str(RUNNER))
    assert out.returncode != 0 and "left a count behind" in out.stderr, out.stdout[-2000:] + out.stderr[-2000:]
    assert "ok shape" not in out.stdout
