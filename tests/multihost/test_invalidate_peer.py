"""Consumer.invalidate_peer in one process over the loopback transport: what D does when the control plane says a P
is gone. (The same runs across hosts, driven by etcd, in test_hosts.py.) Every wait is bounded."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.transport import KVLayout, MemoryKind, Notification, XferStatus

BLOCKS, REGIONS, BYTES = 8, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


def test_a_lost_p_fails_its_live_load_drops_its_link_and_its_late_notification_is_ignored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    kv = {side: [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)] for side in "pd"}
    tp, td = LoopbackTransport(f"p-inv-{time.monotonic_ns()}"), LoopbackTransport(f"d-inv-{time.monotonic_ns()}")
    for t, side in ((tp, "p"), (td, "d")):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv[side]), (BYTES,) * REGIONS))
    sl, tl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0), TargetLedger(BLOCKS, worker="d")
    prod = Producer(sl, tp, COMPAT)
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05))
    try:
        link = cons.connect(prod.address)
        monkeypatch.setattr(td, "poll", lambda _handle: XferStatus.PENDING)  # the read never completes
        sl.allocate("r", [1, 2])
        sl.prefill_done("r")
        grant = prod.grant("r")
        tl.reserve("r", [3, 4])
        transfer = cons.pull("r", grant, address=prod.address)
        deadline = time.monotonic() + 10
        while transfer not in tl.loads and time.monotonic() < deadline:
            time.sleep(0.005)
        assert transfer in tl.loads  # claimed, posted, in flight

        assert cons.invalidate_peer(link.agent, link.epoch, "etcd lease gone") == [transfer]
        assert cons.pending() == 0 and cons.links == {}
        assert "r" not in tl.requests and tl.counts()["FREE"] == BLOCKS  # policy "fail": the blocks went back
        assert tl.stats["failed"] == 1
        # a late completion from the lost incarnation matches no load: nothing changes
        td._deliver(link.agent, Notification("r", grant.transfer, grant.generation, link.epoch, "done", 0))
        time.sleep(0.1)
        assert tl.stats["loaded"] == 0 and tl.counts()["READY_FOR_ATTENTION"] == 0
        # an epoch newer than the invalidated one is not touched by it, and a new handshake works
        assert cons.invalidate_peer(link.agent, link.epoch - 1) == []
        monkeypatch.undo()
        again = cons.connect(prod.address)
        assert again.agent == link.agent and prod.address in cons.links
    finally:
        cons.close()
        prod.close()
        tp.close()
        td.close()
    sl.fail(grant.transfer, grant.generation, "test end")  # P was never told: its lease is still there
    assert check_source(sl) == [] and check_target(tl) == []
