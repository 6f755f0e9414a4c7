"""A stream of one "layer" spanning every region, posted per prefill chunk (SGLang's shape), and what an engine that
polls each request's transfer itself reads of it: P's status, P's abort of a reservation before its prefill began,
D's cancel of an unbegun reservation as P sees it, and a P lost mid-stream. One process over the loopback transport;
every wait is bounded."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, REGIONS, BYTES = 16, 4, 64  # e.g. K and V of two layers, all moved by each chunk's one post
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=1, head_size=16, block_size=1,
                    kv_layout="NHD")


@pytest.fixture
def pd(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * REGIONS))
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d")
    prod, cons = Producer(sl, tp, COMPAT), Consumer(tl, td, COMPAT, options=HandoffOptions())
    cons.connect(prod.address)
    options = StreamOptions(regions_per_layer=REGIONS, stream_timeout_s=10.0)
    sp, sc = StreamProducer(prod, layers=1, options=options), StreamConsumer(cons, options=options)
    yield sp, sc, src, dst
    for part in (sc, sp, cons, prod, tp, td):
        part.close()
    assert check_source(sl) == [] and check_target(tl) == []


def test_chunks_of_one_layer_move_every_region_once_and_p_reads_complete(pd) -> None:
    sp, sc, src, dst = pd
    sc.ledger.reserve("r", [7, 8, 9, 10])
    transfer = sc.request_stream("r", sp.producer.address, layers=1)
    assert transfer and sp.status("r").state == "reserved" and sp.status("r").reserved == 4  # SGLang's WaitingForInput
    assert sp.begin("r")
    sp.layer_done("r", 0, [1, 2])  # first chunk: its two blocks, every region
    assert until(lambda: sp.status("r").posted == 2 and sp.status("r").in_flight == 0)
    assert sp.status("r").state == "streaming" and transfer in sc.ledger.loads  # not complete before the last chunk
    sp.layer_done("r", 0, [1, 2, 3, 4])  # last chunk: only the blocks not sent yet move
    assert until(lambda: sp.status("r").state == "complete")
    assert until(lambda: sc.pending() == 0) and sc.counts["completed"] == 1
    assert sp.counts["layers_posted"] == 2
    for region in range(REGIONS):
        assert np.array_equal(dst[region][[7, 8, 9, 10]].numpy(), src[region][[1, 2, 3, 4]].numpy())
    sp.release("r", lambda: None)
    assert until(lambda: sp.pending() == 0) and sp.status("r").state == "none"
    sc.ledger.finish("r")


def test_p_abort_of_an_unbegun_reservation_reaches_d_at_once(pd) -> None:
    sp, sc, _, dst = pd
    sc.ledger.reserve("r", [5, 6])
    transfer = sc.request_stream("r", sp.producer.address, layers=1)
    sp.cancel("r", "aborted on prefill")
    # D hears it through the stream's failed note, long before its 10 s timeout, and no byte moved
    assert until(lambda: sc.pending() == 0, timeout_s=5.0)
    assert sc.counts["failed"] == 1 and sc.counts["timed_out"] == 0 and transfer not in sc.ledger.loads
    assert sp.status("r").state == "stopped" and sp.status("r").reason == "aborted on prefill"
    assert all(int(dst[region][[5, 6]].sum()) == 0 for region in range(REGIONS))
    assert not sp.begin("r")  # a prefill that comes after its abort does not stream
    sp.release("r", lambda: None)
    assert until(lambda: sp.pending() == 0)


def test_d_cancel_of_an_unbegun_reservation_reads_stopped_on_p_with_ds_reason(pd) -> None:
    sp, sc, _, _ = pd
    sc.ledger.reserve("r", [5])
    assert sc.request_stream("r", sp.producer.address, layers=1)
    assert sc.cancel("r", "aborted by decode")
    assert until(lambda: sp.status("r").state == "stopped")
    assert sp.status("r").reason == "cancelled by D: aborted by decode"
    assert until(lambda: sc.pending() == 0) and "r" not in sc.ledger.requests
    sp.release("r", lambda: None)
    assert sp.status("r").state == "none"


def test_a_lost_producer_ends_its_streams_now_and_spares_a_newer_epoch(pd) -> None:
    sp, sc, _, _ = pd
    sc.ledger.reserve("r", [5])
    transfer = sc.request_stream("r", sp.producer.address, layers=1)
    assert transfer and sp.status("r").state == "reserved"
    link = sc.consumer.links[sp.producer.address]
    assert sc.peer_lost(link.agent, "prefill restarted", before_epoch=link.epoch) == 0  # same incarnation: kept
    assert sc.peer_lost("another-agent", "gone") == 0
    assert sc.peer_lost(link.agent, "prefill silent") == 1
    assert sc.pending() == 0 and sc.counts["failed"] == 1 and transfer not in sc.ledger.loads
    sp.cancel("r")  # P, alive after all, ends its reservation; the note it sends names a forgotten stream
    sp.release("r", lambda: None)
    assert until(lambda: sp.pending() == 0)
