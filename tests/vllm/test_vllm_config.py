"""What the connector refuses at start-up, checked inside the real vLLM environment (no server needed)."""

from __future__ import annotations

import subprocess

import vllm_harness as h

CHECK = """
from types import SimpleNamespace as NS
from kvlifecycle.adapters.vllm.connector import check_supported_parallelism
def cfg(tp=1, pp=1, mla=False, hybrid=False):
    model = NS(model="some/model", use_mla=mla, is_hybrid=hybrid)
    return NS(parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=pp), model_config=model)
for tp in (1, 2, 8):
    check_supported_parallelism(cfg(tp=tp))
    print("accepted: tp", tp)
for case in (dict(pp=2), dict(tp=2, pp=2), dict(mla=True), dict(tp=2, mla=True), dict(hybrid=True)):
    try:
        check_supported_parallelism(cfg(**case))
        print("accepted:", case)
    except ValueError as exc:
        print("refused:", exc)
"""


def test_tensor_parallelism_is_accepted_and_pp_mla_hybrid_are_refused_in_words() -> None:
    h.require_vllm()
    out = subprocess.run(
        [str(h.VLLM_PYTHON), "-c", CHECK], capture_output=True, text=True, timeout=300, check=True, env=h.base_env()
    )
    lines = out.stdout.splitlines()
    assert [line for line in lines if line.startswith("accepted:")] == [f"accepted: tp {tp}" for tp in (1, 2, 8)]
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 5, out.stdout
    assert all("pipeline_parallel_size=2" in line and "pipeline parallelism" in line for line in refused[:2])
    assert all("MLA" in line and "replicated on every TP rank" in line for line in refused[2:4])
    assert "hybrid" in refused[4] and "Mamba" in refused[4] and "some/model" in refused[4]


CHECK_VERIFY = """
import numpy as np
from kvlifecycle import layout as L
from kvlifecycle.adapters.vllm.worker import digester_for
from kvlifecycle.digest import VerifyMode
buf = np.zeros((4, 64), np.uint8)  # a stand-in KV region: only the layout's memory kind is inspected
def layout(kind):
    return L.rows_layout(kind, 0, [buf.ctypes.data], [buf.nbytes], [64])
print("none over VRAM:", digester_for(VerifyMode.NONE, layout("VRAM")))
print("all over DRAM:", type(digester_for(VerifyMode.ALL, layout("DRAM"))).__name__)
for mode in (VerifyMode.SAMPLE, VerifyMode.ALL):
    try:
        digester_for(mode, layout("VRAM"))
        print("accepted:", mode.value)
    except ValueError as exc:
        print("refused:", exc)
"""


def test_verify_over_kv_in_vram_without_a_gpu_digester_is_refused_at_start_up_saying_what_to_set() -> None:
    """``verify`` other than none needs a digester where the KV lives; KV in VRAM gets the GPU digester (Triton
    kernels), which this CPU-only vLLM cannot run, so the worker refuses at start-up (before any agent or thread
    starts) rather than hand off unchecked; the message names the option, where the KV is, why, and what to set."""
    h.require_vllm()
    out = subprocess.run(
        [str(h.VLLM_PYTHON), "-c", CHECK_VERIFY], capture_output=True, text=True, timeout=300, check=True,
        env=h.base_env()
    )
    lines = out.stdout.splitlines()
    assert "none over VRAM: None" in lines and "all over DRAM: HostDigester" in lines, out.stdout
    refused = [line for line in lines if line.startswith("refused:")]
    assert len(refused) == 2 and not [line for line in lines if line.startswith("accepted:")], out.stdout
    for line, mode in zip(refused, ("sample", "all"), strict=True):
        assert f"verify={mode!r}" in line and "over KV in VRAM needs the GPU digester" in line
        assert 'set "verify": "none" in kv_connector_extra_config' in line
