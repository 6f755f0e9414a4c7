"""vLLM's GPU KV layout over the CUDA IPC transport, and the vLLM connector's worker side choosing it (issue 7).

- bf16 caches shaped as vLLM's FlashAttention backend allocates them, ``[2 (K, V), blocks, block_size, heads,
  head_size]`` per layer, moved region by region (K and V of each layer) bit-exact, plus a heterogeneous-TP read
  of half the heads from an HND copy;
- the connector's worker side (``adapters/vllm/worker.py`` ``WorkerSide``, P and D in this process) registering
  such caches (and vLLM 0.32's LBNHC views): NIXL plus the CUDA IPC fast path, D's link choosing CUDA IPC at
  connect, grant → recv → finished_recving / finished_sending → finish, bytes checked, both event logs replayed
  clean. vLLM cannot be installed on the GPU machine: its import-time names are stubbed there (``vllm_stubs``);
  NIXL is real.

Everything here needs a GPU and is skipped with the reason printed (``pytest -rs``) when CUDA is absent; the
CPU-side layout checks are in ``test_vllm_layout.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from kvlifecycle.transports import cuda_ipc
from vllm_stubs import KV_FORMS, block_dim, hand_off, kv_caches, replay_problems, vllm_or_stubs, worker_pair

from kvlifecycle.testing.transport_conformance import wait_status
from kvlifecycle.transport import BlockView, KVLayout, MemoryKind, XferStatus

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (the CUDA IPC transport moves VRAM only)"
gpu = pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)


def vllm_kv_caches(
    layers: int,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_size: int,
    *,
    dtype: torch.dtype,
    seed: int | None,
    hnd: bool = False,
) -> list[torch.Tensor]:
    """One tensor per layer, shaped as vLLM's FlashAttention backend allocates it: [2, blocks, block_size, heads,
    head_size] (K then V); ``hnd``: the same logical shape over head-major memory (vLLM's HND stride order)."""
    inner = (kv_heads, block_size, head_size) if hnd else (block_size, kv_heads, head_size)
    physical = (2, num_blocks, *inner)
    gen = torch.Generator(device="cuda").manual_seed(seed) if seed is not None else None
    out = []
    for _ in range(layers):
        if gen is None:
            cache = torch.zeros(physical, dtype=dtype, device="cuda")
        else:
            cache = torch.randn(physical, dtype=torch.float32, device="cuda", generator=gen).to(dtype)
        out.append(cache.permute(0, 1, 3, 2, 4) if hnd else cache)
    return out


def vllm_layout(caches: list[torch.Tensor]) -> KVLayout:
    """Regions = K and V of every layer (``cache[0]``, ``cache[1]``), each [blocks, block_size, heads, head_size]."""
    halves = [half for cache in caches for half in (cache[0], cache[1])]
    block_bytes = halves[0][0].numel() * halves[0].element_size()
    return KVLayout(
        MemoryKind.VRAM,
        halves[0].device.index or 0,
        halves[0].shape[0],
        tuple(h.data_ptr() for h in halves),
        tuple(block_bytes for _ in halves),
    )


@gpu
@pytest.mark.gpu
def test_vllm_shaped_kv_moves_byte_exact_with_sliced_heads() -> None:
    """vLLM-shaped bf16 caches: a whole-request pull, then heterogeneous TP (D reads half of P's heads: HND view
    per block is [heads, block_size, head_size] here, so one rank's heads are one contiguous slice)."""
    layers, nb, bs, heads, hd = 4, 48, 16, 8, 128
    p = cuda_ipc.CudaIpcTransport(f"vllm-p-{time.monotonic_ns()}")
    d = cuda_ipc.CudaIpcTransport(f"vllm-d-{time.monotonic_ns()}")
    src = vllm_kv_caches(layers, nb, bs, heads, hd, dtype=torch.bfloat16, seed=3)
    dst = vllm_kv_caches(layers, nb, bs, heads, hd, dtype=torch.bfloat16, seed=None)
    p.register(vllm_layout(src))
    d.register(vllm_layout(dst))
    try:
        peer = d.add_peer(p.local_metadata())
        p_blocks = np.array([40, 2, 17, 33, 5], dtype=np.int32)
        d_blocks = np.array([0, 1, 2, 3, 4], dtype=np.int32)
        h = d.post("READ", d.prepare(peer), d_blocks, p_blocks)
        assert wait_status(d, h) is XferStatus.DONE
        pi, di = torch.from_numpy(p_blocks).long(), torch.from_numpy(d_blocks).long()
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(t[:, di].view(torch.int16), s[:, pi].view(torch.int16))  # bit-exact, not allclose
        # heterogeneous TP on an HND-permuted view: rank 1 of 2 reads heads 4..7 of each P block
        block_bytes = bs * heads * hd * 2
        half = block_bytes // 2
        src_hnd = [x.permute(0, 1, 3, 2, 4).contiguous() for x in src]  # [2, blocks, heads, bs, hd]
        dst_half = vllm_kv_caches(layers, nb, bs, heads // 2, hd, dtype=torch.bfloat16, seed=None)
        p2 = cuda_ipc.CudaIpcTransport(f"vllm-p2-{time.monotonic_ns()}")
        d2 = cuda_ipc.CudaIpcTransport(f"vllm-d2-{time.monotonic_ns()}")
        p2.register(vllm_layout(src_hnd))
        d2.register(vllm_layout(dst_half))
        try:
            plan = d2.prepare(d2.add_peer(p2.local_metadata()), remote_view=BlockView(half, half))
            h2 = d2.post("READ", plan, d_blocks, p_blocks)
            assert wait_status(d2, h2) is XferStatus.DONE
            for s, t in zip(src_hnd, dst_half, strict=True):
                got = t[:, di].view(2, len(d_blocks), heads // 2, bs, hd)  # the D cache read as HND
                assert torch.equal(got.view(torch.int16), s[:, pi, heads // 2 :].view(torch.int16))
        finally:
            d2.close()
            p2.close()
    finally:
        d.close()
        p.close()


@gpu
@pytest.mark.gpu
@pytest.mark.nixl
@pytest.mark.parametrize(
    ("form", "fast_path", "devices"),
    [("kv-outer-NHD", "auto", (0, 0)), ("kv-outer-HND", "auto", (0, 0)), ("LBNHC", "auto", (0, 0)),
     ("kv-outer-NHD", "off", (0, 0)), ("kv-outer-NHD", "auto", (1, 0)), ("LBNHC", "auto", (1, 0))],
)
def test_vllm_worker_side_moves_gpu_kv_through_cuda_ipc(
    form: str, fast_path: str, devices: tuple[int, int], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The vLLM connector's worker side, P and D, with bf16 CUDA caches laid out as vLLM lays them out
    (FlashAttention's K/V-outer ``[2, blocks, block_size, heads, head_size]``, token- or head-major; vLLM 0.32's
    LBNHC view) and nothing replaced: NIXL is built as always and, with ``fast_path: "auto"``, CUDA IPC over the
    same regions, which D's link picks at connect (same node, VRAM, self-test passed). ``"off"``: NIXL moves the
    same bytes. ``devices``: P's and D's GPU (issue 8: P on GPU 1, D on GPU 0, the copy crossing the link)."""
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (nixl==1.5.1): the connector's transport")
    if max(devices) >= torch.cuda.device_count():
        pytest.skip(f"needs {max(devices) + 1} CUDA devices: torch.cuda.device_count() is "
                    f"{torch.cuda.device_count()} (P and D on different GPUs)")
    p_dev, d_dev = (f"cuda:{i}" for i in devices)
    caplog.set_level("INFO", logger="kvlifecycle")
    layers = list(range(4))
    shape = dict(num_blocks=64, block_size=16, heads=8, head_size=128)
    p_caches = kv_caches(form, layers, device=p_dev, seed=17, **shape)
    d_caches = kv_caches(form, layers, device=d_dev, **shape)
    p_before = {name: cache.clone() for name, cache in p_caches.items()}
    p_blocks, d_blocks = (40, 2, 17, 33, 5, 61), (0, 1, 2, 3, 4, 5)
    outer, order = KV_FORMS[form]
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm.kv_caches import describe_kv_caches

        kv = describe_kv_caches(p_caches, shape["num_blocks"])
        assert (kv.layout.kind, kv.kv_outer, kv.kv_layout) == (MemoryKind.VRAM, outer, order)
        halves = (0, 1) if outer else (slice(None),)
        assert kv.layout.base_addrs == tuple(c[h].data_ptr() for c in p_caches.values() for h in halves)
        with worker_pair(p_caches, d_caches, log_dir=tmp_path, fast_path=fast_path, **shape) as pair:
            p, d = pair.p, pair.d
            assert p.transport.name == "nixl" and p.transport.layout == kv.layout  # NIXL stays, as the fallback
            settled = hand_off(pair, p_blocks, d_blocks)
            assert settled.failed == set(), f"D reported a failed load: {settled.failed}"
            assert (settled.received, settled.sent) == ({"req-d"}, {"req-p"})
            link = d.consumer.links[pair.address]
            if fast_path == "auto":
                assert isinstance(p.fast_transport, cuda_ipc.CudaIpcTransport)
                assert isinstance(d.fast_transport, cuda_ipc.CudaIpcTransport)
                assert d.fast_transport.layout == d.transport.layout  # the same regions as NIXL's
                assert link.choice is not None and link.choice.backend == "cuda_ipc", link.choice
                assert link.data is d.fast_transport and link.data_peer == p.fast_transport.agent
            else:
                assert p.fast_transport is None and d.fast_transport is None
                assert link.data is None and link.choice is None
            assert "req-d" not in d.target.requests and "req-p" not in p.source.requests
    selected = [r.getMessage() for r in caplog.records if "transport selected" in r.getMessage()]
    assert any("transport selected: cuda_ipc" in m for m in selected) == (fast_path == "auto"), selected
    dim = block_dim(form)
    pi, di = torch.tensor(p_blocks, device=p_dev), torch.tensor(d_blocks, device=d_dev)
    rest = torch.tensor(sorted(set(range(shape["num_blocks"])) - set(d_blocks)), device=d_dev)
    for name, src in p_caches.items():
        dst = d_caches[name].view(torch.int16)  # compared bit for bit, not allclose
        moved = src.view(torch.int16).index_select(dim, pi).to(d_dev)
        assert torch.equal(dst.index_select(dim, di), moved), name
        assert not dst.index_select(dim, rest).any(), name  # no other D block written
        assert torch.equal(src.view(torch.int16), p_before[name].view(torch.int16)), name  # P read, not written
    assert replay_problems(tmp_path) == []
