"""Layer-wise posts over the CUDA IPC transport: each layer's K and V regions posted on their own, as a streaming
prefill posts them. A region list's launch is built on its first post and kept on the plan, so later posts of the
same list neither regroup the regions nor rebind the kernels; the bytes stay exact and a bad region list is still
refused every time.

Needs a GPU; skipped with the reason printed (``pytest -rs``) when CUDA is absent.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from kvlifecycle.transports import cuda_ipc

from kvlifecycle.testing.transport_conformance import wait_status
from kvlifecycle.transport import KVLayout, MemoryKind, RemoteMismatchError, XferStatus

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (the CUDA IPC transport moves VRAM only)"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)]

LAYERS, BLOCKS, BLOCK_BYTES = 6, 32, 4096


def regions(seed: int | None) -> list[torch.Tensor]:
    """K and V of every layer, each its own [blocks, block_bytes] allocation."""
    gen = torch.Generator(device="cuda").manual_seed(seed) if seed is not None else None
    out = []
    for _ in range(2 * LAYERS):
        if gen is None:
            out.append(torch.zeros((BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda"))
        else:
            out.append(torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda", generator=gen))
    return out


def layout(tensors: list[torch.Tensor]) -> KVLayout:
    return KVLayout(MemoryKind.VRAM, 0, BLOCKS, tuple(t.data_ptr() for t in tensors),
                    tuple(BLOCK_BYTES for _ in tensors))


def test_each_layers_regions_post_alone_byte_exact_and_reuse_their_launch() -> None:
    p = cuda_ipc.CudaIpcTransport(f"layers-p-{time.monotonic_ns()}")
    d = cuda_ipc.CudaIpcTransport(f"layers-d-{time.monotonic_ns()}")
    src, dst = regions(5), regions(None)
    p.register(layout(src))
    d.register(layout(dst))
    try:
        plan = p.prepare(p.add_peer(d.local_metadata()))
        rng = np.random.default_rng(3)
        launches = []
        for _ in range(3):  # the first post of a layer builds its launch; later ones find it (and go compiled)
            for t in dst:
                t.zero_()
            local = rng.choice(BLOCKS, 20, replace=False).astype(np.int32)
            remote = rng.choice(BLOCKS, 20, replace=False).astype(np.int32)
            for layer in range(LAYERS):
                h = p.post("WRITE", plan, local, remote, regions=(2 * layer, 2 * layer + 1))
                assert wait_status(p, h) is XferStatus.DONE, p.error(h)
                p.release(h)
            li, ri = torch.from_numpy(local).long().cuda(), torch.from_numpy(remote).long().cuda()
            for s, t in zip(src, dst, strict=True):
                assert torch.equal(t[ri], s[li])
            launches.append(dict(p._plans[plan.key].launches))
        assert sorted(launches[0]) == [(2 * i, 2 * i + 1) for i in range(LAYERS)]
        assert all(launches[rep][key] is launches[0][key] for rep in (1, 2) for key in launches[0])
        if p.compiled_post:  # warm: the kept launches carry their bound kernels (20 ids: the staged-ids kernels)
            assert all(launch.native_write is not None for launch in launches[0].values())
        for bad in ((0, 0), (2 * LAYERS,), (-1, 1)):  # refused on every post, cached lists or not
            with pytest.raises(RemoteMismatchError):
                p.post("WRITE", plan, [0], [0], regions=bad)
        assert sorted(p._plans[plan.key].launches) == sorted(launches[0])  # nothing cached for a refused list
    finally:
        p.close()
        d.close()
