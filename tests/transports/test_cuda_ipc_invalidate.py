"""``Consumer.invalidate_peer`` over the real CUDA IPC fast path: a copy queued on D's device cannot be cancelled
(releasing its handle forgets it, the kernel still writes D's blocks), so the load's blocks leave LOADING only once
the copy ended. The copy's completion event is held back (as ``test_cuda_ipc.py`` holds one) and fired from a timer
well after the invalidation: the load's failure is recorded after it fired, never before. The same race over a CPU
double of the device: ``tests/test_handoff_uncancellable_copy.py``.

Skipped without CUDA (``pytest -rs`` prints why). Every wait is bounded."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_cuda_ipc import NO_CUDA, WAIT_S, _handoff_pair, _HeldEvent

from kvlifecycle import events as ev
from kvlifecycle.transport import MemoryKind

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
HOLD_S = 0.5  # how long the copy's event is held after the invalidation began


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

        def fire() -> None:
            fired_at.append(time.monotonic())
            held[0].fired = True

        timer = threading.Timer(HOLD_S, fire)
        timer.start()
        cons.invalidate_peer(link.agent, link.epoch, "etcd lease expired", timeout_s=WAIT_S)
        assert cons.wait_idle(WAIT_S)
        timer.join()
        assert fired_at and failed_at, (fired_at, failed_at)
        assert failed_at[0] >= fired_at[0]  # the blocks stayed LOADING while the copy could still write them
        assert "r" not in cons.ledger.requests  # policy fail: FREE once the copy ended
        prod.ledger.cancel("r")
    finally:
        cons.close()
        prod.close()
        for t in made:
            t.close()
