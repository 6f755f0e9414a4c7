"""``kvlifecycle doctor`` on this machine's real NIXL (DRAM): table content and exit-status semantics. No speed
thresholds: the ratio checks are driven to pass or fail with ``--min-ratio`` 0 or an impossible value."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl")
pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def doctor(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def report() -> tuple[int, dict]:
    done = doctor("--json", "--tls", "default,tcp,bogus_tl,default+eh=none", "--min-ratio", "0", "--size-mib", "4")
    return done.returncode, json.loads(done.stdout)


def test_plugins_table_names_ucx_with_dram(report: tuple[int, dict]) -> None:
    _, data = report
    plugins = {p["name"]: p for p in data["plugins"]}
    assert plugins["UCX"]["loads"] is True and "DRAM_SEG" in plugins["UCX"]["mem_types"]
    assert all(p["loads"] == bool(p["mem_types"]) for p in plugins.values())
    assert all(p["error"] for p in plugins.values() if not p["loads"])  # every plugin that failed says why


def test_dram_path_moves_verified_bytes_through_ucx(report: tuple[int, dict]) -> None:
    code, data = report
    paths = {p["ucx_tls"]: p for p in data["paths"]}
    default = paths["default"]
    assert default["path"] == "DRAM→DRAM" and default["ok"] and default["verified"]
    assert default["backend"] == "UCX"
    assert default["descriptors"] == (4 << 20) // (64 << 10)
    assert default["gbps"] > 0 and default["ceiling_gbps"] > 0
    assert default["ratio"] == pytest.approx(default["gbps"] / default["ceiling_gbps"])
    assert "tcp/" in paths["tcp"]["lanes"]  # UCX's own log names the transport the restricted variant used
    assert code == 0 and data["failed"] is False  # --min-ratio 0: nothing can be "far below"


def test_backend_parameter_variant(report: tuple[int, dict]) -> None:
    _, data = report
    (row,) = [p for p in data["paths"] if p["variant"] == "default+eh=none"]
    assert row["ucx_tls"] == "default ucx_error_handling_mode=none"
    assert row["ok"] and row["verified"] and row["lanes"]


def test_a_broken_variant_is_a_row_not_a_crash(report: tuple[int, dict]) -> None:
    _, data = report
    (bogus,) = [p for p in data["paths"] if p["ucx_tls"] == "bogus_tl"]
    assert bogus["ok"] is False and bogus["error"]


def test_far_below_ceiling_exits_1_with_a_hint() -> None:
    done = doctor("--tls", "default", "--min-ratio", "1000", "--size-mib", "4", "--no-prog-thread-check")
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert "plugin" in out and "UCX" in out and "DRAM→DRAM" in out and "ceiling GB/s" in out
    assert "FAIL" in out and "below 100000%" in out
    assert "hint (DRAM→DRAM via NIXL/UCX)" in out and "enable_prog_thread=False" in out
    assert out.rstrip().splitlines()[-1].startswith("doctor FAILED")


def test_time_budget_bounds_the_run_and_reports_it() -> None:
    done = doctor("--json", "--budget-s", "0.5", timeout=60)
    data = json.loads(done.stdout)
    assert done.returncode == 1
    assert any(c["status"] == "FAIL" and "within" in c["detail"] for c in data["checks"])
