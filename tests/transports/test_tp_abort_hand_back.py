"""A load the engine gave up between its queueing and its launch (vLLM aborted the request while the adapter thread
was still on the way: the reservation is gone when the consumer's service thread launches it) hands every lease
back at once, so that P does not keep the blocks pinned until the lease expires (the real-vLLM TP tests' aborts).
A real Producer and Consumer with their zmq side channel over the loopback transport; every wait bounded, no
assertion on a duration."""

from __future__ import annotations

import threading
import time

import numpy as np
from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle import events as ev
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, BLOCK_BYTES = 8, 64
COMPAT = CompatInfo(model_id="m", dtype="float32", num_layers=1, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="HND")
LEASE_TTL_S = 600.0  # an expiry cannot be what releases the lease within this test


def until(fn, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.005)
    return False


def test_a_load_aborted_before_its_launch_hands_its_lease_back() -> None:
    suffix = time.monotonic_ns()
    buffers = [np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8) for _ in range(2)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for transport, buffer in ((tp, buffers[0]), (td, buffers[1])):
        transport.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (buffer.ctypes.data,), (BLOCK_BYTES,)))
    plog: list[ev.Event] = []
    source = SourceLedger(BLOCKS, worker="p", default_ttl_s=LEASE_TTL_S)
    source.listeners.append(plog.append)
    prod = Producer(source, tp, COMPAT)
    cons = Consumer(TargetLedger(BLOCKS, worker="d"), td, COMPAT, options=HandoffOptions(request_timeout_s=5.0))
    gate = threading.Event()
    try:
        source.allocate("p-req", [2, 3])
        source.prefill_done("p-req")
        grant = prod.grant("p-req")
        cons.connect(prod.address, push=False)
        cons.ledger.reserve("d-req", [0, 1])
        cons._jobs.put(lambda: gate.wait(10.0))  # the service thread is busy: the launch waits behind this
        cons.pull("d-req", [(prod.address, grant)])
        cons.ledger.cancel("d-req")  # the engine aborts the request meanwhile
        gate.set()
        assert until(lambda: grant.transfer not in source.leases), "P keeps the lease until it expires"
        released = [e for e in plog if isinstance(e, ev.SrcLeaseReleased)]
        assert [(e.transfer, e.reason) for e in released] == [(grant.transfer, "failed")]
        assert "d-req" in cons.abandoned
    finally:
        gate.set()
        cons.close()
        prod.close()
        tp.close()
        td.close()
