"""P's host staging through the vLLM connector's worker side with the KV cache in VRAM (vLLM's FlashAttention
layout): the staging copy on a CUDA stream (``CudaStagingCopy``), P's blocks reported finished sending before D
asks, then overwritten on the GPU, and D's read served from P's host pool over NIXL with the prefill's bytes. vLLM
cannot be installed on the GPU machine: its import-time names are stubbed (``tests/transports/vllm_stubs.py``);
NIXL and CUDA are real. Skipped without CUDA (``bash bench/gpu_run.sh tests`` with
``TESTS=$PWD/tests/vllm/test_vllm_staging_gpu.py``). Every wait is bounded."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("nixl._api", reason="needs the real NIXL package")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (a KV cache in VRAM)", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transports"))
from vllm_stubs import kv_caches, vllm_or_stubs, worker_pair  # noqa: E402

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE = 2, 32, 16, 4, 64
P_BLOCKS, D_BLOCKS = (3, 7, 11), (20, 21, 22)


def test_a_vram_lease_is_staged_on_a_cuda_stream_freed_to_vllm_and_read_by_d_from_the_host_pool(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm.metadata import GrantCmd, KVLifecycleMetadata, PeerRef, RecvCmd

        layers = list(range(LAYERS))
        p_caches = kv_caches("kv-outer-NHD", layers, num_blocks=BLOCKS, block_size=BLOCK_SIZE, heads=HEADS,
                             head_size=HEAD_SIZE, device="cuda", seed=7)
        d_caches = kv_caches("kv-outer-NHD", layers, num_blocks=BLOCKS, block_size=BLOCK_SIZE, heads=HEADS,
                             head_size=HEAD_SIZE, device="cuda")
        expected = [c[:, list(P_BLOCKS)].clone() for c in p_caches.values()]
        staging = {"stage_when": "after", "stage_after_ms": 0, "staging_pool_blocks": 8}
        with worker_pair(p_caches, d_caches, num_blocks=BLOCKS, block_size=BLOCK_SIZE, heads=HEADS,
                         head_size=HEAD_SIZE, log_dir=tmp_path, staging=staging) as pair:
            p, d = pair.p, pair.d
            assert p.staging is not None and p.staging.copy_path == "cuda stream"
            p.on_metadata(KVLifecycleMetadata(grants=[GrantCmd("req-p", P_BLOCKS)]))
            sent: set[str] = set()
            deadline = time.monotonic() + 30
            while "req-p" not in sent and time.monotonic() < deadline:  # D has not asked: the lease is unclaimed
                sent |= p.get_transfer_results()[0]
                time.sleep(0.005)
            assert "req-p" in sent, "P never reported the staged request finished sending"
            for cache in p_caches.values():  # vLLM gave the blocks to another request
                cache[:, list(P_BLOCKS)] = 0
            torch.cuda.synchronize()
            d.on_metadata(KVLifecycleMetadata(recvs=[RecvCmd(PeerRef("req-d", pair.address, "req-p"), D_BLOCKS)]))
            received: set[str] = set()
            failed: set[str] = set()
            deadline = time.monotonic() + 60
            while not received and not failed and time.monotonic() < deadline:
                _, recving, bad = d.get_transfer_results()
                received |= recving
                failed |= bad
                time.sleep(0.005)
            assert received == {"req-d"} and not failed
            torch.cuda.synchronize()
            for got, want in zip(d_caches.values(), expected, strict=True):
                assert torch.equal(got[:, list(D_BLOCKS)], want)
            d.on_metadata(KVLifecycleMetadata(finishes=["req-d"]))
            deadline = time.monotonic() + 30
            while (p.staging.pool.requests or "req-d" in d.target.requests) and time.monotonic() < deadline:
                p.get_transfer_results()
                time.sleep(0.005)
            assert not p.staging.pool.requests, "the staged copy outlived D's read"
            served = p.staging.pool.stats["served"]
            assert served == 1 and p.staging.pool.stats["completed"] == 1
    dirs = sorted(str(x) for x in tmp_path.iterdir() if x.is_dir())
    assert [Path(x).name.split("-")[0] for x in dirs] == ["source", "staging", "target"], dirs
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", *dirs, "--check", "--quiescent"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
