"""``kvlifecycle bench transport --verify all --json``: the verified pair runs beside the unverified one in the
same run, moves exact bytes, checks every transfer, and prints ``verify_ratio``. No time is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def test_bench_transport_prints_verify_ratio() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvlifecycle", "bench", "transport", "--verify", "all", "--json", "--iterations", "3",
         "--regions", "4", "--blocks", "16", "--block-bytes", "4096", "--idle-seconds", "0.05"],
        capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["all_ok"] and result["verify"] == "all" and result["verified_parts"] == 3
    assert result["verify_ratio"] > 0 and result["verify_s"] > 0
