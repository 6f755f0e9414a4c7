"""What the connector refuses at start-up, checked inside the real vLLM environment (no server needed)."""

from __future__ import annotations

import subprocess

import vllm_harness as h

CHECK = """
from types import SimpleNamespace as NS
from kvlifecycle.adapters.vllm.connector import check_supported_parallelism
def cfg(tp, pp):
    return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp))
check_supported_parallelism(cfg(1, 1))
for tp, pp in ((2, 1), (1, 2)):
    try:
        check_supported_parallelism(cfg(tp, pp))
    except ValueError as exc:
        print("refused:", exc)
"""


def test_multi_rank_configurations_are_refused_in_words() -> None:
    h.require_vllm()
    out = subprocess.run(
        [str(h.VLLM_PYTHON), "-c", CHECK], capture_output=True, text=True, timeout=300, check=True, env=h.base_env()
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2
    assert "tensor_parallel_size=1" in lines[0] and "(got 2)" in lines[0]
    assert "pipeline_parallel_size=1" in lines[1]
