"""``Consumer.invalidate_peer`` over the real CUDA IPC fast path: a copy queued on D's device cannot be cancelled
(releasing its handle forgets it, the kernel still writes D's blocks), so the load's blocks leave LOADING only once
the copy ended. The copy's completion event is held back (as ``test_cuda_ipc.py`` holds one) and fired only after
the invalidation returned (it never waits on the device): the load's failure is recorded after it fired, never
before. The same race over a CPU double of the device: ``tests/test_handoff_uncancellable_copy.py``.

Skipped without CUDA (``pytest -rs`` prints why). Every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from kvlifecycle.transports import cuda_ipc
from test_cuda_ipc import NO_CUDA, WAIT_S, _handoff_pair, _HeldEvent, vram_layout, vram_tensors

from kvlifecycle import events as ev
from kvlifecycle.transport import MemoryKind, PeerEpochError, XferStatus

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@gpu
@pytest.mark.gpu
def test_invalidate_peer_fails_the_load_only_once_its_cuda_ipc_copy_ended() -> None:
    prod, cons, _src, _dst, made = _handoff_pair(MemoryKind.VRAM, True)
    fired_at: list[float] = []
    failed_at: list[float] = []
    cons.ledger.listeners.append(
        lambda e: failed_at.append(time.monotonic()) if isinstance(e, ev.TgtLoadFailed) else None)
    try:
        link = cons.connect(prod.address)
        assert link.data is cons.fast_transport and link.choice.backend == "cuda_ipc"
        fast = cons.fast_transport
        held: list[_HeldEvent] = []
        post = fast.post

        def post_and_hold(*args, **kwargs):  # the copy's event reads "not yet" until the timer fires it
            handle = post(*args, **kwargs)
            with fast._lock:
                flight = fast._inflight[handle.id]
                flight.end = _HeldEvent(flight.end)
                held.append(flight.end)
            return handle

        fast.post = post_and_hold
        prod.ledger.allocate("r", [3, 1, 7])
        prod.ledger.prefill_done("r")
        g = prod.grant("r")
        cons.ledger.reserve("r", [0, 5, 2])
        cons.pull("r", g, address=prod.address)
        deadline = time.monotonic() + WAIT_S
        while not held and time.monotonic() < deadline:
            time.sleep(0.002)
        assert held, "the read was not posted on the fast path"

        cons.invalidate_peer(link.agent, link.epoch, "etcd lease expired", timeout_s=WAIT_S)
        # returned with the copy still "running": D's service thread never waits on the device for a lost peer
        assert not failed_at  # and the load stays LOADING while the copy may still write its blocks
        fired_at.append(time.monotonic())
        held[0].fired = True
        assert cons.wait_idle(WAIT_S)
        assert failed_at and failed_at[0] >= fired_at[0], (fired_at, failed_at)
        assert "r" not in cons.ledger.requests  # policy fail: FREE once the copy ended
        prod.ledger.cancel("r")
    finally:
        cons.close()
        prod.close()
        for t in made:
            t.close()


@gpu
@pytest.mark.gpu
def test_remove_peer_returns_at_once_and_unmaps_only_after_the_running_copy_ended() -> None:
    p = cuda_ipc.CudaIpcTransport(f"p-{time.monotonic_ns()}")
    d = cuda_ipc.CudaIpcTransport(f"d-{time.monotonic_ns()}")
    tp, td = vram_tensors("random", 5), vram_tensors("zeros")
    p.register(vram_layout(tp))
    d.register(vram_layout(td))
    try:
        d_sees_p = d.add_peer(p.local_metadata())
        blocks = np.array([1, 2, 3], dtype=np.int32)
        h = d.post("READ", d.prepare(d_sees_p), blocks, blocks)
        held = _HeldEvent(d._inflight[h.id].end)
        d._inflight[h.id].end = held
        d.remove_peer(d_sees_p)  # returns with the copy "running": nothing waited on the device
        for _ in range(3):
            assert d.poll(h) is XferStatus.PENDING  # the caller must not free what the kernel may still write
            d.notifications()
            assert [gone.peer.name for gone in d._unmapping] == [d_sees_p]  # never unmapped under a running copy
        held.fired = True
        deadline = time.monotonic() + WAIT_S
        while d.poll(h) is XferStatus.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert d.poll(h) is XferStatus.FAILED and isinstance(d.error(h), PeerEpochError)
        d.notifications()
        assert not d._unmapping  # unmapped once the copy ended
        d.release(h)
    finally:
        d.close()
        p.close()
