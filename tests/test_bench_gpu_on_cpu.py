"""``kvlifecycle bench gpu`` runs its whole flow without a GPU, through the CPU double in ``bench_gpu_on_cpu.py``:
every path it measures, the two-process e2e with real ledgers, logs and replay, the summary and the one JSON line
of ``--json``. No figure is asserted; the structure and the byte checks are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

DOUBLE = Path(__file__).with_name("bench_gpu_on_cpu.py")

pytest.importorskip("torch")


def test_bench_gpu_runs_end_to_end_on_the_cpu_double_and_prints_one_json_line() -> None:
    proc = subprocess.run([sys.executable, str(DOUBLE)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert res["byte_exact"] is True
    for key in ("e2e", "e2e_python_post"):
        e2e = res[key]
        assert "error" not in e2e and e2e["replay_violations"] == []
        assert e2e["replay_events"]["p"] > 0 and e2e["replay_events"]["d"] > 0
        for label in ("large", "small"):
            assert e2e[f"{label}_exact"] is True
            assert set(e2e[f"{label}_steps_us"]) == {"start_load", "post", "wait_event", "part_done", "after_ready",
                                                     "event_seen", "complete"}
            assert {"start_loads", "post_batch_to_launch", "step_exit"} <= set(e2e[f"{label}_batched_split_us"])
    # both runs move the same requests through the same commands
    assert res["e2e"]["replay_events"] == res["e2e_python_post"]["replay_events"]
    assert res["e2e"]["large_compiled_post"] is True and res["e2e_python_post"]["large_compiled_post"] is False
    assert set(res["host_us"]) == set(res["host_us_python_post"]) == {"large", "small"}
    assert set(res["goals"]) == {"copy_hot_loop", "copy_in_loop", "raw_copy_in_loop"}
    assert set(res["ledger_hot_us"]) == {"start_load", "part_done"}
    for label in ("large", "small"):
        assert res[label]["ceiling_exact"] and res[label]["torch_exact"] and res[label]["kernel_exact"]
        assert len(res[label]["kernel_variants"]) == 2  # the default and its host-ids launch
