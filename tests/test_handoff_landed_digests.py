"""D's check with the digests its transport's copy computed (:class:`kvlifecycle.transport.LandedDigests`, CUDA
IPC's fused copy + digest): where a completed READ offers them, the Consumer compares those and reads no block back;
where it offers none (every CPU transport), it reads back as before. A loopback transport over DRAM stands in for
the copy, handing D the digests a copy would have computed (or wrong ones, or none). The real fused kernel over
CUDA IPC: tests/transports/test_cuda_ipc_verify.py."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from kvlifecycle.transports.digest_host import HostDigester
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle import layout as L
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.transport import TransferHandle, XferOp, landed_digests

BLOCKS, REGIONS, BLOCK = 16, 4, 256
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=REGIONS // 2, num_kv_heads=2, head_size=64,
                    block_size=1, kv_layout="HND")
_names = itertools.count()


class Pool:
    def __init__(self, seed: int | None) -> None:
        rng = np.random.default_rng(seed)
        self.kv = [rng.integers(0, 256, (BLOCKS, BLOCK), dtype=np.uint8) if seed is not None
                   else np.zeros((BLOCKS, BLOCK), dtype=np.uint8) for _ in range(REGIONS)]
        self.layout = L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.kv], [a.nbytes for a in self.kv],
                                    [BLOCK] * REGIONS)


class CountingDigester:
    """D's read-back digester, counting its passes."""

    def __init__(self, inner: HostDigester) -> None:
        self.inner, self.calls = inner, 0

    def digests(self, units: np.ndarray, **kwargs: Any) -> np.ndarray:
        self.calls += 1
        return self.inner.digests(units, **kwargs)


class DigestingCopy:
    """``inner`` (loopback) as a transport whose READ digests what it wrote: ``landed`` says what it hands D —
    ``right`` (the digests of the source blocks it copied), ``wrong`` (one of them changed), ``none``, or
    ``short`` (one digest fewer than blocks)."""

    def __init__(self, inner: LoopbackTransport, source: HostDigester, landed: str) -> None:
        self._inner, self._source, self._landed = inner, source, landed
        self._digests: dict[int, np.ndarray] = {}
        self.asked = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def post(self, op: Any, plan: Any, local_blocks: Any, remote_blocks: Any, **kwargs: Any) -> TransferHandle:
        handle: TransferHandle = self._inner.post(op, plan, local_blocks, remote_blocks, **kwargs)
        self._digests[handle.id] = self._source.digests(np.asarray(remote_blocks, dtype=np.int64))
        return handle

    def landed_digests(self, handle: TransferHandle) -> np.ndarray | None:
        self.asked += 1
        found = self._digests[handle.id].copy()
        if self._landed == "wrong":
            found[1] ^= np.uint64(1)
        return {"none": None, "short": found[:-1]}.get(self._landed, found)


def pull(landed: str) -> tuple[Pool, Pool, TargetLedger, Consumer, DigestingCopy, CountingDigester, list[ev.Event]]:
    n = next(_names)
    src, dst = Pool(3), Pool(None)
    tp, td = LoopbackTransport(f"ld-p{n}"), LoopbackTransport(f"ld-d{n}")
    tp.register(src.layout)
    td.register(dst.layout)
    copy = DigestingCopy(td, HostDigester(src.layout), landed)
    readback = CountingDigester(HostDigester(dst.layout))
    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(BLOCKS, worker="d")
    seen: list[ev.Event] = []
    tl.listeners.append(seen.append)
    prod = Producer(sl, tp, COMPAT, options=HandoffOptions(verify="all"), digester=HostDigester(src.layout))
    cons = Consumer(tl, copy, COMPAT, digester=readback,  # type: ignore[arg-type]
                    options=HandoffOptions(verify="all", heartbeat_every_s=0.05, probe=False, quarantine_s=60.0))
    try:
        cons.connect(prod.address)
        sl.allocate("r", [2, 7, 11, 4])
        sl.prefill_done("r")
        prod.grant("r")
        grant = cons.fetch_grant(prod.address, "r")
        assert grant.digests is not None
        tl.reserve("r", [9, 0, 5, 13])
        cons.pull("r", grant, address=prod.address)
        assert cons.wait_idle(20)
        assert until(lambda: grant.transfer not in sl.leases, 20)
        assert check_source(sl) == [] and check_target(tl) == []
        return src, dst, tl, cons, copy, readback, seen
    finally:
        cons.close()
        prod.close()
        td.close()
        tp.close()


def test_the_copys_digests_verify_the_load_and_no_block_is_read_back() -> None:
    src, dst, tl, cons, copy, readback, _ = pull("right")
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION
    assert copy.asked == 1 and readback.calls == 0
    assert cons.verified_parts == cons.copy_verified_parts == 1 and tl.stats["verified_blocks"] == 4
    assert all(np.array_equal(d[[9, 0, 5, 13]], s[[2, 7, 11, 4]]) for s, d in zip(src.kv, dst.kv, strict=True))


def test_wrong_landed_digests_fail_the_load_though_the_bytes_landed_right() -> None:
    """Mutant-style: the bytes in D's blocks are right, so a Consumer that ignored the copy's digests and read back
    would load; the copy's digest of the second block is wrong, and the load is refused before attention."""
    src, dst, tl, cons, _, readback, seen = pull("wrong")
    assert all(np.array_equal(d[[9, 0, 5, 13]], s[[2, 7, 11, 4]]) for s, d in zip(src.kv, dst.kv, strict=True))
    mismatches = [e for e in seen if isinstance(e, ev.TgtDigestMismatch)]
    assert len(mismatches) == 1 and ev.unpack_blocks(mismatches[0].blocks).tolist() == [0]
    assert "r" not in tl.requests and tl.stats["loaded"] == 0 and tl.stats["digest_mismatches"] == 1
    assert not any(isinstance(e, ev.TgtPartDone) for e in seen) and readback.calls == 0
    assert cons.verified_parts == 0 and set(tl.quarantined()) == {0}


@pytest.mark.parametrize("landed", ["none", "short"])
def test_without_one_digest_per_block_from_the_copy_d_reads_its_blocks_back(landed: str) -> None:
    _, _, tl, cons, copy, readback, _ = pull(landed)
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION
    assert copy.asked == 1 and readback.calls == 1
    assert cons.verified_parts == 1 and cons.copy_verified_parts == 0


def test_a_transport_without_the_capability_offers_no_landed_digests() -> None:
    t = LoopbackTransport(f"ld-plain{next(_names)}")
    try:
        assert landed_digests(t, TransferHandle(1, XferOp.READ, "x", 0, "")) is None
    finally:
        t.close()
