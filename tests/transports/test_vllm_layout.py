"""The vLLM connector's view of vLLM's KV tensors (no GPU, no vLLM needed: the adapter's vLLM imports are stubbed
when vLLM is absent): FlashAttention's K/V-outer caches become two regions per layer, vLLM's CPU layout stays one,
anything not block-contiguous is refused in words; the compatibility record says what is really there; the fast
path knob; and a worker-side handoff of FlashAttention-shaped caches over real NIXL (DRAM), bytes checked.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm_stubs import (
    KV_FORMS,
    LAYER,
    block_dim,
    fake_vllm_config,
    hand_off,
    kv_caches,
    replay_problems,
    vllm_or_stubs,
    worker_pair,
)

from kvlifecycle.handshake import CompatMismatchError, negotiate
from kvlifecycle.transport import KVLayout, MemoryKind

NB, BS, HEADS, HD = 16, 4, 2, 8


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The adapter's worker and KV-cache modules as one namespace, imported against vLLM or its stubs."""
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm import kv_caches, worker

        yield SimpleNamespace(**{**vars(worker), **vars(kv_caches)})


def flash_caches(layers: list[int], *, dtype: torch.dtype = torch.bfloat16, hnd: bool = False) -> dict[str, Any]:
    """FlashAttention's per-layer cache: [2 (K, V), blocks, block_size, heads, head_size]; ``hnd``: the same
    logical shape over head-major memory (vLLM's HND stride order)."""
    out = {}
    for i in layers:
        if hnd:
            cache = torch.zeros(2, NB, HEADS, BS, HD, dtype=dtype).permute(0, 1, 3, 2, 4)
        else:
            cache = torch.zeros(2, NB, BS, HEADS, HD, dtype=dtype)
        out[LAYER.format(i)] = cache
    return out


def cpu_caches(layers: list[int]) -> dict[str, Any]:
    """vLLM's CPU backend: [blocks, heads, block_size, 2 x head_size] per layer (K and V fused per token)."""
    return {LAYER.format(i): torch.zeros(NB, HEADS, BS, 2 * HD, dtype=torch.bfloat16) for i in layers}


def test_flash_attention_layer_is_two_regions_k_then_v_in_layer_order(worker: Any) -> None:
    caches = flash_caches([10, 2, 0])  # dict order is not layer order
    kv = worker.describe_kv_caches(caches, NB)
    order = [caches[LAYER.format(i)] for i in (0, 2, 10)]
    assert kv.layout.base_addrs == tuple(c[half].data_ptr() for c in order for half in (0, 1))
    assert kv.layout.block_bytes == (BS * HEADS * HD * 2,) * 6
    assert kv.layout.kind is MemoryKind.DRAM and kv.layout.num_blocks == NB
    assert (kv.num_layers, kv.kv_layout, kv.kv_outer) == (3, "NHD", True)
    assert worker.kv_layout_from_caches(caches, NB) == kv.layout
    # block b of every region is where vLLM keeps K (or V) of block b
    for r, (cache, half) in enumerate((c, h) for c in order for h in (0, 1)):
        for b in (0, 5, NB - 1):
            assert kv.layout.base_addrs[r] + b * kv.layout.block_bytes[r] == cache[half, b].data_ptr()


def test_flash_attention_head_major_stride_order_is_labelled_hnd(worker: Any) -> None:
    caches = flash_caches([0, 1], hnd=True)
    kv = worker.describe_kv_caches(caches, NB)
    assert (kv.kv_layout, kv.kv_outer, kv.layout.num_regions) == ("HND", True, 4)
    assert kv.layout.base_addrs[1] == caches[LAYER.format(0)][1].data_ptr()


def test_cpu_layout_is_unchanged(worker: Any) -> None:
    caches = cpu_caches([1, 0])
    caches["model.layers.2.self_attn.attn"] = caches[LAYER.format(0)]  # a layer sharing another's KV cache
    kv = worker.describe_kv_caches(caches, NB)
    expected = KVLayout(
        MemoryKind.DRAM,
        0,
        NB,
        (caches[LAYER.format(0)].data_ptr(), caches[LAYER.format(1)].data_ptr()),
        (HEADS * BS * 2 * HD * 2,) * 2,
    )
    assert kv.layout == expected
    assert (kv.num_layers, kv.kv_layout, kv.kv_outer) == (2, "HND", False)


@pytest.mark.parametrize(
    ("cache", "words"),
    [
        # K/V-outer with padding inside each block (a head_size slice of a wider tensor)
        (torch.zeros(2, NB, BS, HEADS, 2 * HD)[..., :HD], "not block-contiguous"),
        # K/V-outer with a gap between blocks
        (torch.zeros(2, NB, BS + 1, HEADS, HD)[:, :, :BS], "not block-contiguous"),
        # block-major with a gap between blocks
        (torch.zeros(NB, HEADS, BS, 4 * HD)[..., : 2 * HD], "blocks are not contiguous"),
        # neither shape (e.g. a cross-layer cache)
        (torch.zeros(3, NB, BS, HEADS, HD), "neither block-major"),
    ],
)
def test_layouts_that_are_not_block_contiguous_are_refused_in_words(worker: Any, cache: Any, words: str) -> None:
    with pytest.raises(worker.LayoutError, match=words):
        worker.describe_kv_caches({LAYER.format(0): cache}, NB)


def test_two_blocks_decided_by_strides_or_refused(worker: Any) -> None:
    """With 2 blocks a dense [2, 2, ...] cache reads as block-major and as K/V-outer: refused rather than guessed.
    Head-major memory under the logical FlashAttention shape is only K/V-outer: accepted."""
    with pytest.raises(worker.LayoutError, match="ambiguous"):
        worker.describe_kv_caches({LAYER.format(0): torch.zeros(2, 2, BS, HEADS, HD)}, 2)
    hnd = torch.zeros(2, 2, HEADS, BS, HD).permute(0, 1, 3, 2, 4)
    kv = worker.describe_kv_caches({LAYER.format(0): hnd}, 2)
    assert (kv.kv_outer, kv.kv_layout, kv.layout.base_addrs) == (True, "HND", (hnd[0].data_ptr(), hnd[1].data_ptr()))


def test_layers_mixing_layouts_are_refused(worker: Any) -> None:
    caches = {**flash_caches([0]), **cpu_caches([1])}
    with pytest.raises(worker.LayoutError, match="mix KV layouts"):
        worker.describe_kv_caches(caches, NB)


def test_compat_says_what_is_there_and_p_d_compare_model_layers(worker: Any) -> None:
    config = fake_vllm_config("kv_both", BS, HEADS, HD)
    flash = worker.compat_info(config, worker.describe_kv_caches(flash_caches([0, 1, 2]), NB), "bfloat16")
    cpu = worker.compat_info(config, worker.describe_kv_caches(cpu_caches([0, 1, 2]), NB), "bfloat16")
    assert (flash.kv_layout, flash.num_layers) == ("NHD", 3)  # model layers, not the 6 regions
    assert (cpu.kv_layout, cpu.num_layers) == ("HND", 3)
    negotiate(flash, flash)  # two FlashAttention workers agree
    with pytest.raises(CompatMismatchError) as refused:
        negotiate(flash, cpu)  # a GPU P and a CPU D lay blocks out differently: refused on that field alone
    assert [f[0] for f in refused.value.fields] == ["kv_layout"]


def test_fast_path_knob(monkeypatch: pytest.MonkeyPatch) -> None:
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm.config import AdapterConfig

        assert AdapterConfig.from_extra({}).fast_path == "auto"
        assert AdapterConfig.from_extra({"fast_path": "off"}).fast_path == "off"
        with pytest.raises(ValueError, match="fast_path must be 'auto' or 'off'"):
            AdapterConfig.from_extra({"fast_path": "cuda_ipc"})


def test_fast_path_is_built_only_for_vram_and_says_why_not(
    worker: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``off`` and DRAM never touch CUDA IPC; VRAM whose fast path cannot be built (here: no CUDA, or on a GPU an
    address that is not device memory) leaves NIXL alone, with a warning naming the reason."""
    from types import SimpleNamespace

    from kvlifecycle.adapters.vllm.config import AdapterConfig
    from kvlifecycle.transports import cuda_ipc

    def side(fast_path: str) -> Any:
        return worker.WorkerSide(
            fake_vllm_config("kv_consumer", BS, HEADS, HD),
            AdapterConfig(fast_path=fast_path),
            "engine",
            SimpleNamespace(num_blocks=NB),
        )

    vram = KVLayout(MemoryKind.VRAM, 0, NB, (0x1000,), (256,))
    dram = KVLayout(MemoryKind.DRAM, 0, NB, (0x1000,), (256,))
    built: list[str] = []
    real = cuda_ipc.CudaIpcTransport

    def counting(agent: str, **kw: Any) -> Any:
        built.append(agent)
        return real(agent, **kw)

    monkeypatch.setattr(cuda_ipc, "CudaIpcTransport", counting)
    caplog.set_level(logging.WARNING, logger="kvlifecycle.adapters.vllm")
    assert side("off")._build_fast_path(vram, "a-ipc") is None
    assert side("auto")._build_fast_path(dram, "a-ipc") is None
    assert built == [] and not caplog.records
    assert side("auto")._build_fast_path(vram, "a-ipc") is None
    assert built == ["a-ipc"]
    assert any("no CUDA IPC fast path, NIXL only" in r.getMessage() for r in caplog.records)


def test_token_major_block_major_view_is_labelled_nhd(worker: Any) -> None:
    """vLLM 0.32 on GPU (LBNHC): the CPU layout's logical view over token-major blocks; still one region per layer."""
    caches = kv_caches("LBNHC", [1, 0], num_blocks=NB, block_size=BS, heads=HEADS, head_size=HD)
    kv = worker.describe_kv_caches(caches, NB)
    assert (kv.num_layers, kv.kv_layout, kv.kv_outer) == (2, "NHD", False)
    assert kv.layout.base_addrs == tuple(caches[LAYER.format(i)].data_ptr() for i in (0, 1))
    assert kv.layout.block_bytes == (HEADS * BS * 2 * HD * 2,) * 2


@pytest.mark.nixl
@pytest.mark.parametrize("form", sorted(KV_FORMS))
def test_worker_side_moves_every_vllm_layout_over_nixl(
    form: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """P and D ``WorkerSide`` with bf16 caches in host memory in each layout (the regions the GPU path registers,
    over NIXL/DRAM): grant → recv → finished_recving / finished_sending → finish; every moved block (K and V of
    every layer) bit for bit, every other block untouched, no fast path offered for DRAM, both logs replay clean."""
    # a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")
    layers = [0, 1, 2]
    shape = dict(num_blocks=NB, block_size=BS, heads=HEADS, head_size=HD)
    p_caches = kv_caches(form, layers, seed=5, **shape)
    d_caches = kv_caches(form, layers, **shape)
    p_before = {name: cache.clone() for name, cache in p_caches.items()}
    p_blocks, d_blocks = (9, 2, 15, 4), (0, 1, 2, 3)
    outer, order = KV_FORMS[form]
    with (
        vllm_or_stubs(monkeypatch),
        worker_pair(p_caches, d_caches, log_dir=tmp_path, **shape) as pair,
    ):
        assert pair.p.fast_transport is None and pair.d.fast_transport is None
        assert pair.d.transport.layout.num_regions == (2 if outer else 1) * len(layers)
        assert pair.d.consumer.compat.kv_layout == order
        settled = hand_off(pair, p_blocks, d_blocks)
        assert settled.failed == set()
        assert (settled.received, settled.sent) == ({"req-d"}, {"req-p"})
        link = pair.d.consumer.links[pair.address]
        assert link.data is None and link.choice is None  # NIXL moved it: nothing else was offered
        assert "req-d" not in pair.d.target.requests and "req-p" not in pair.p.source.requests
    dim = block_dim(form)
    pi, di = torch.tensor(p_blocks), torch.tensor(d_blocks)
    rest = torch.tensor(sorted(set(range(NB)) - set(d_blocks)))
    for name, src in p_caches.items():
        dst = d_caches[name].view(torch.int16)  # compared bit for bit
        assert torch.equal(dst.index_select(dim, di), src.view(torch.int16).index_select(dim, pi))
        assert not dst.index_select(dim, rest).any()
        assert torch.equal(src.view(torch.int16), p_before[name].view(torch.int16))
    assert replay_problems(tmp_path) == []
