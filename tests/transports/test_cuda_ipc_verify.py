"""D's check over CUDA IPC with the fused copy + digest: a real Producer/Consumer pull (loopback the generic
transport, CUDA IPC the fast path D selects, ``verify: all``, GPU digesters on both sides) whose READ is one kernel
that moves the blocks and digests the words it moves (``CudaIpcTransport.digest_reads``). D compares those digests
and never reads its blocks back; a clean load verifies, and a source byte flipped on P after P digested its grant
(before D's read) is refused before attention. Skipped without CUDA (``pytest -rs`` says why)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import torch

from kvlifecycle import events as ev
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.transport import KVLayout, MemoryKind

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA IPC moves VRAM)")]

BLOCKS, REGIONS, BLOCK = 16, 4, 4096  # whole 1024-byte rows: the fused copy's unit
P_BLOCKS, D_BLOCKS = [3, 1, 7, 12], [0, 5, 2, 9]
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=REGIONS, num_kv_heads=2, head_size=16,
                    block_size=1, kv_layout="NHD")
WAIT_S = 30.0


class CountingDigester:
    """D's read-back digester, counting its passes."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def digests(self, units: np.ndarray, **kwargs: Any) -> np.ndarray:
        self.calls += 1
        result: np.ndarray = self.inner.digests(units, **kwargs)
        return result


def _layout(ts: list[torch.Tensor]) -> KVLayout:
    return KVLayout(MemoryKind.VRAM, ts[0].device.index or 0, BLOCKS, tuple(t.data_ptr() for t in ts),
                    (BLOCK,) * REGIONS)


def pull(flip: tuple[int, int, int] | None) -> dict[str, Any]:
    """One request P → D over CUDA IPC with digests; ``flip``: (region, P block, byte) flipped on P after P
    digested the grant, before D's read."""
    from kvlifecycle.transports import cuda_ipc
    from kvlifecycle.transports.digest_gpu import GpuDigester
    from kvlifecycle.transports.loopback import LoopbackTransport
    from kvlifecycle.transports.select import SameNodeSelector

    from kvlifecycle.handoff import Consumer, HandoffOptions, Producer

    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(5)
    src = [torch.randint(0, 256, (BLOCKS, BLOCK), dtype=torch.uint8, device=dev, generator=gen)
           for _ in range(REGIONS)]
    dst = [torch.zeros((BLOCKS, BLOCK), dtype=torch.uint8, device=dev) for _ in range(REGIONS)]
    suffix = time.monotonic_ns()
    made: list[Any] = []
    for side, ts in (("p", src), ("d", dst)):
        generic = LoopbackTransport(f"cv-{side}-{suffix}")
        generic.register(_layout(ts), tensors=ts)
        fast = cuda_ipc.CudaIpcTransport(f"cv-{side}-fast-{suffix}")
        fast.register(_layout(ts))
        made += [generic, fast]
    tp, fp, td, fd = made
    fd.digest_reads(True)
    readback = CountingDigester(GpuDigester(_layout(dst)))
    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(BLOCKS, worker="d")
    seen: list[ev.Event] = []
    tl.listeners.append(seen.append)
    prod = Producer(sl, tp, COMPAT, fast_transport=fp, options=HandoffOptions(verify="all"),
                    digester=GpuDigester(_layout(src)))
    cons = Consumer(tl, td, COMPAT, fast_transport=fd, path_selector=SameNodeSelector(), digester=readback,
                    options=HandoffOptions(verify="all", heartbeat_every_s=0.01, quarantine_s=60.0))
    try:
        link = cons.connect(prod.address)
        sl.allocate("r", P_BLOCKS)
        sl.prefill_done("r")
        prod.grant("r")
        grant = cons.fetch_grant(prod.address, "r")  # P digests its blocks here
        assert grant.digests is not None
        if flip is not None:
            region, block, byte = flip
            src[region][block, byte] ^= 0x10
            torch.cuda.synchronize(dev)
        tl.reserve("r", D_BLOCKS)
        cons.pull("r", grant, address=prod.address)
        assert cons.wait_idle(WAIT_S)
        assert link.data is fd and link.choice.backend == "cuda_ipc"  # D read over CUDA IPC
        deadline = time.monotonic() + WAIT_S
        while grant.transfer in sl.leases and time.monotonic() < deadline:
            time.sleep(0.002)
        assert grant.transfer not in sl.leases
        assert check_source(sl) == [] and check_target(tl) == []
        return {"src": src, "dst": dst, "tl": tl, "cons": cons, "fd": fd, "readback": readback, "seen": seen}
    finally:
        cons.close()
        prod.close()
        for t in made:
            t.close()


def test_a_clean_pull_is_verified_by_the_fused_copy_and_nothing_is_read_back() -> None:
    out = pull(None)
    tl, cons = out["tl"], out["cons"]
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION
    assert out["fd"].digested_reads == 1 and out["readback"].calls == 0
    assert cons.verified_parts == cons.copy_verified_parts == 1 and tl.stats["verified_blocks"] == len(D_BLOCKS)
    s, d = torch.tensor(P_BLOCKS), torch.tensor(D_BLOCKS)
    for r in range(REGIONS):
        assert torch.equal(out["dst"][r][d.to(out["dst"][r].device)], out["src"][r][s.to(out["src"][r].device)])


def test_a_source_byte_flipped_after_p_digested_is_refused_before_attention() -> None:
    out = pull((2, 7, 3001))  # P block 7 is read into D block 2
    tl, seen = out["tl"], out["seen"]
    assert out["fd"].digested_reads == 1 and out["readback"].calls == 0
    mismatches = [e for e in seen if isinstance(e, ev.TgtDigestMismatch)]
    assert len(mismatches) == 1 and ev.unpack_blocks(mismatches[0].blocks).tolist() == [2]
    assert "r" not in tl.requests and tl.stats["loaded"] == 0 and tl.stats["digest_mismatches"] == 1
    assert not any(isinstance(e, ev.TgtPartDone) for e in seen)
    assert out["cons"].verified_parts == 0 and set(tl.quarantined()) == {2}
