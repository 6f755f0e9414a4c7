"""A copy that releasing its handle cannot stop (CUDA IPC: a kernel on the device runs to its end), on D's reads:
``Consumer.invalidate_peer`` and a failed load wait for it before the blocks leave LOADING.

A load of two parts reads two P ranks; the first is invalidated (its etcd lease expired) while both copies are
still queued on D's device. Releasing the handles does not stop them, so failing the load then would free D's blocks
while the copies still write into them, and tell the live P rank to release blocks D's copy still reads. Here the
load stays LOADING, its live P rank keeps its lease, until the last copy ended; then the load fails and the live
rank is told. The device is a double over the loopback transport (CPU): ``cancels_in_flight = False``, copies land
when the test lets them, and removing a peer waits for its copies, as ``CudaIpcTransport._drop_peer`` does. The
same race on a real device: ``tests/transports/test_cuda_ipc_invalidate.py`` (GPU)."""

from __future__ import annotations

import itertools
import threading
import time

import msgspec
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_merged, check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.transport import KVLayout, MemoryKind, TransferHandle, TransportError, XferOp, XferStatus

BLOCKS, HEAD_BYTES = 8, 32
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=2, head_size=HEAD_BYTES // 2,
                    block_size=1, kv_layout="HND")  # D: TP 1, both heads; each P rank (TP 2) holds one
_ids = itertools.count(1)


class DeviceCopies:
    """D's transport as CUDA IPC behaves: a posted copy is queued on the device and runs to its end whatever its
    handle (``release`` forgets the handle, the copy still lands: ``cancels_in_flight = False``). A copy lands when
    the test calls :meth:`land`; ``remove_peer`` waits for that peer's copies (they land, then poll FAILED), as
    ``CudaIpcTransport._drop_peer`` does before it unmaps the peer."""

    cancels_in_flight = False

    def __init__(self, inner: LoopbackTransport) -> None:
        self.inner = inner
        self.queued: dict[int, tuple] = {}  # handle id -> the copy, not landed yet
        self.status: dict[int, XferStatus] = {}
        self.released: set[int] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def post(self, op, plan, local_blocks, remote_blocks, **kwargs) -> TransferHandle:
        handle = TransferHandle(-next(_ids), XferOp(op), plan.peer, 0, kwargs.get("transfer", ""))
        with self._lock:
            self.queued[handle.id] = (op, plan, local_blocks, remote_blocks, kwargs)
        return handle

    def land(self, peer: str | None = None, status: XferStatus = XferStatus.DONE) -> int:
        """The queued copies (of ``peer``) run: their bytes land in D's blocks. Returns how many."""
        with self._lock:
            ids = [i for i, copy in self.queued.items() if peer is None or copy[1].peer == peer]
            for handle_id in ids:
                op, plan, local, remote, kwargs = self.queued.pop(handle_id)
                if handle_id in self.released or status is XferStatus.FAILED:  # its notification is not sent
                    kwargs = {k: v for k, v in kwargs.items() if k != "notification"}
                done = self.inner.post(op, plan, local, remote, **kwargs)
                assert until(lambda d=done: self.inner.poll(d) is not XferStatus.PENDING)
                self.inner.release(done)
                self.status[handle_id] = status
        return len(ids)

    def poll(self, handle: TransferHandle) -> XferStatus:
        with self._lock:
            return XferStatus.PENDING if handle.id in self.queued else self.status[handle.id]

    def error(self, handle: TransferHandle) -> TransportError | None:
        return TransportError("peer removed") if self.status.get(handle.id) is XferStatus.FAILED else None

    def stats(self, handle: TransferHandle) -> None:
        return None

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            self.released.add(handle.id)

    def remove_peer(self, peer: str) -> None:
        self.land(peer, XferStatus.FAILED)
        self.inner.remove_peer(peer)


@pytest.fixture
def two_p_ranks(request: pytest.FixtureRequest):
    """P TP 2 (two Producers, a head each) and D TP 1, whose Consumer reads both ranks by device copies."""
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    kv = [torch.randint(1, 256, (BLOCKS, HEAD_BYTES), dtype=torch.uint8) for _ in range(2)]
    dst = torch.zeros((BLOCKS, 2 * HEAD_BYTES), dtype=torch.uint8)
    tps = [LoopbackTransport(f"p{r}-{suffix}") for r in range(2)]
    td = LoopbackTransport(f"d-{suffix}")
    for transport, tensor in ((tps[0], kv[0]), (tps[1], kv[1]), (td, dst)):
        transport.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (tensor.data_ptr(),), (tensor.shape[1],)))
    plogs: list[list[ev.Event]] = [[], []]
    dlog: list[ev.Event] = []
    sources = [SourceLedger(BLOCKS, worker=f"p{r}", default_ttl_s=30.0) for r in range(2)]
    target = TargetLedger(BLOCKS, worker="d")
    for source, plog in zip(sources, plogs, strict=True):
        source.listeners.append(plog.append)
    target.listeners.append(dlog.append)
    device = DeviceCopies(td)
    p_compat = msgspec.structs.replace(COMPAT, tp_size=2)
    prods = [Producer(source, t, p_compat, tp_rank=r, options=HandoffOptions(unit_bytes=HEAD_BYTES))
             for r, (source, t) in enumerate(zip(sources, tps, strict=True))]
    cons = Consumer(target, device, COMPAT,
                    options=HandoffOptions(heartbeat_every_s=0.02, probe=False, unit_bytes=HEAD_BYTES))
    for prod in prods:
        cons.connect(prod.address)
    yield prods, cons, device, plogs, dlog, dst
    device.land()
    cons.close()
    for prod in prods:
        prod.close()
    for t in (*tps, td):
        t.close()
    assert all(check_source(s) == [] for s in sources) and check_target(target) == []
    for plog in plogs:
        assert check_merged(plog, dlog) == []


def start_two_part_load(prods, cons: Consumer, device: DeviceCopies, d_blocks: list[int]) -> list:
    grants = []
    for prod in prods:  # a short lease: P0's, which nobody renews once D let P0 go, ends soon by its expiry
        prod.ledger.allocate("r", [1, 2])
        prod.ledger.prefill_done("r")
        grants.append((prod.address, prod.grant("r", ttl_s=1.0)))
    cons.ledger.reserve("r", d_blocks)
    cons.pull("r", grants)
    assert until(lambda: len(device.queued) == 2)  # both copies queued on D's device
    return grants


def released(plog: list[ev.Event]) -> list[str]:
    return [e.reason for e in plog if isinstance(e, ev.SrcLeaseReleased)]


def test_an_invalidated_p_rank_fails_the_load_only_once_its_siblings_copy_ended(two_p_ranks) -> None:
    prods, cons, device, plogs, dlog, _dst = two_p_ranks
    queued_at_failure: list[int] = []
    cons.ledger.listeners.append(
        lambda e: queued_at_failure.append(len(device.queued)) if isinstance(e, ev.TgtLoadFailed) else None)
    d_blocks = [4, 5]
    grants = start_two_part_load(prods, cons, device, d_blocks)
    link0 = cons.links[prods[0].address]
    transfer = cons.ledger.requests["r"].transfer
    assert cons.invalidate_peer(link0.agent, link0.epoch, "etcd lease expired") == [transfer]
    # P0's copy ended (removing the peer waited for it); P1's is still queued: nothing is failed or released yet
    assert len(device.queued) == 1
    time.sleep(0.2)  # several service steps
    assert [TargetState(int(s)).name for s in cons.ledger.state[d_blocks]] == ["LOADING"] * 2
    assert cons.pending() == 1 and not [e for e in dlog if isinstance(e, ev.TgtLoadFailed)]
    assert grants[1][1].transfer in prods[1].ledger.leases and released(plogs[1]) == []  # D still reads P1's blocks
    # P1's copy ends: only now does the load fail, and is P1 told
    assert device.land() == 1
    assert cons.wait_idle(10)
    assert queued_at_failure == [0]
    [failed] = [e for e in dlog if isinstance(e, ev.TgtLoadFailed)]
    assert failed.reason.startswith("etcd lease expired")
    assert "r" not in cons.ledger.requests  # policy fail: FREE, once nothing lands in them any more
    # P1's lease ends once, after the copy ended: by the copy's notification (the read landed) or D's LoadFailed
    assert until(lambda: released(plogs[1]) in (["completed"], ["failed"]))
    # the invalidated rank is told nothing: its lease ends by P's own expiry
    assert until(lambda: released(plogs[0]) == ["expired"])
    for prod in prods:
        prod.ledger.free("r")


@pytest.mark.mutants
def test_mutant_invalidate_releasing_at_once_frees_blocks_under_the_running_copy(
        two_p_ranks, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: every copy counts as stoppable (as the simulated transport's release cancels at once). The load
    fails at invalidation, while P1's copy is still queued to write into its blocks."""
    monkeypatch.setattr(Consumer, "_unstoppable", lambda self, load, pending=None: set())
    prods, cons, device, plogs, _dlog, _ = two_p_ranks
    queued_at_failure: list[int] = []
    cons.ledger.listeners.append(
        lambda e: queued_at_failure.append(len(device.queued)) if isinstance(e, ev.TgtLoadFailed) else None)
    start_two_part_load(prods, cons, device, [4, 5])
    link0 = cons.links[prods[0].address]
    cons.invalidate_peer(link0.agent, link0.epoch, "etcd lease expired")
    assert queued_at_failure == [2]  # freed while both copies into its blocks were still queued
    assert "r" not in cons.ledger.requests
    device.land()
    assert until(lambda: len(released(plogs[1])) == 1 and released(plogs[0]) == ["expired"])
    for prod in prods:
        prod.ledger.free("r")
