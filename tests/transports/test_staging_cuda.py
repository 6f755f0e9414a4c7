"""Host staging of a KV cache in VRAM on a CUDA stream (:class:`CudaStagingCopy`): the gather kernel writes a
lease's scattered GPU blocks into scattered slots of the pinned host pool, ordered after the work already enqueued
on the device (a copy posted behind a slow kernel that writes the KV still carries that kernel's bytes), and,
through the real handoff, a D that claims after staging reads the slots over NIXL (VRAM KV, DRAM pool and D) while
P's engine has reused the GPU blocks.

Skipped without CUDA (``pytest -rs`` prints why); CI has no GPU, the lent GPU machine runs it
(``bash bench/gpu_run.sh tests`` with ``EXTRA_TESTS``). Every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from kvlifecycle.transports.host_pool import HostPool
from test_cuda_ipc import NO_CUDA, WAIT_S, vram_layout

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handoff.staging_tier import StagingTier
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StagingPolicy
from kvlifecycle.transport import KVLayout, MemoryKind, XferOp, XferStatus

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
REGIONS, BLOCKS, BLOCK_BYTES, SLOTS = 4, 64, 4096, 16
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_size=1024, block_size=1,
                    kv_layout="NHD")


def _kv() -> list[torch.Tensor]:
    return [torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, device="cuda") for _ in range(REGIONS)]


def _wait(copier, handle) -> XferStatus:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while (status := copier.poll(handle)) is XferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return status


@gpu
@pytest.mark.gpu
def test_scattered_blocks_land_in_scattered_slots_after_the_work_already_enqueued() -> None:
    from kvlifecycle.transports.staging_copy_cuda import CudaStagingCopy

    kv = _kv()
    layout = vram_layout(kv)
    pool = HostPool(layout, SLOTS)
    copier = CudaStagingCopy(layout, pool)
    try:
        blocks, slots = np.array([50, 3, 17, 63, 0], dtype=np.int32), np.array([9, 0, 15, 4, 7], dtype=np.int32)
        torch.cuda._sleep(50_000_000)  # the "prefill" still running on the current stream...
        for r in range(REGIONS):
            kv[r][torch.as_tensor(blocks, device="cuda").long()] = r + 1  # ...then writing the blocks
        handle = copier.post(XferOp.READ, None, slots, blocks, transfer="t")
        assert _wait(copier, handle) is XferStatus.DONE
        for r in range(REGIONS):
            assert (pool.region(r)[slots] == r + 1).all()  # the bytes the enqueued work wrote, not older ones
            untouched = np.setdiff1d(np.arange(SLOTS), slots)
            assert not pool.region(r)[untouched].any()
        copier.release(handle)
        with pytest.raises(ValueError):
            copier.post(XferOp.READ, None, np.array([SLOTS]), np.array([0]))  # a slot out of range: refused
    finally:
        copier.close()


@gpu
@pytest.mark.gpu
def test_a_vram_lease_staged_on_a_cuda_stream_is_read_from_the_pool_over_nixl(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("nixl._api")
    from kvlifecycle.transports.nixl import NixlTransport
    from kvlifecycle.transports.staging_copy_cuda import CudaStagingCopy

    run = time.monotonic_ns()
    kv = _kv()
    layout = vram_layout(kv)
    pool = HostPool(layout, SLOTS)
    d_kv = [np.zeros((BLOCKS, BLOCK_BYTES), dtype=np.uint8) for _ in range(REGIONS)]
    d_layout = KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(a.ctypes.data for a in d_kv), (BLOCK_BYTES,) * REGIONS)
    t_kv, t_host, t_d = (NixlTransport(f"{who}-{run}") for who in ("p-kv", "p-host", "d"))
    t_kv.register(layout)
    t_host.register(pool.layout)
    t_d.register(d_layout)
    copier = CudaStagingCopy(layout, pool)
    clock, hlc = ManualClock(), HybridLogicalClock()
    p = SourceLedger(BLOCKS, clock=clock, hlc=hlc, worker="P", default_ttl_s=30.0)
    pool_ledger = StagingLedger(SLOTS, clock=clock, hlc=hlc, source_worker="P")
    d = TargetLedger(BLOCKS, worker="D")
    tier = StagingTier(HostStaging(p, pool_ledger, StagingPolicy(when="after", stage_after_ms=100,
                                                                 pool_blocks=SLOTS)), t_host, copier=copier)
    prod = Producer(p, t_kv, COMPAT, staging=tier, thread=False)
    cons = Consumer(d, t_d, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05))
    try:
        cons.connect(prod.address)
        p.allocate("slow", [10, 20, 30])
        p.prefill_done("slow")
        grant = prod.grant("slow")
        expected = [k[[10, 20, 30]].cpu().numpy() for k in kv]
        clock.advance(0.2)
        deadline = time.monotonic() + WAIT_S
        while pool_ledger.counts()["STAGED"] != 3 and time.monotonic() < deadline:
            prod.step_once()
            time.sleep(0.001)
        assert [r.reason for r in p.take_released()] == ["staged"]
        p.free("slow")
        for k in kv:  # the engine reuses the blocks
            k[[10, 20, 30]] = 0xEE
        d.reserve("slow", [1, 2, 3])
        cons.pull("slow", grant, address=prod.address)
        assert cons.wait_idle(WAIT_S) and d.stats["loaded"] == 1
        for r in range(REGIONS):
            assert np.array_equal(d_kv[r][[1, 2, 3]], expected[r])
    finally:
        cons.close()
        prod.close()
        copier.close()
        for t in (t_d, t_host, t_kv):
            t.close()
