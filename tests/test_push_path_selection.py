"""P picks the path of its pushes with the Consumer's path selector: D's push handshake carries D's fast-path
metadata (``GetMeta.fast_meta``), P's selector picks a transport for its writes into that D, and each stream posts,
polls and releases its writes there, D draining that transport's notifications too.

Over loopback transports in one process: the "fast path" is a second loopback registered over the same tensors,
picked by a test selector (the real one, ``SameNodeSelector`` with CUDA IPC, runs on a GPU in
tests/transports/test_cuda_ipc_push.py). Every wait is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo, GetMeta, decode_handshake
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.path_selection import DataPath, PathChoice, PathSelector
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BlockView,
    KVLayout,
    MemoryKind,
    PeerMetadata,
    PreparedPlan,
    RemoteMismatchError,
    TransferHandle,
    Transport,
    XferOp,
)

BLOCKS, LAYERS, BYTES = 16, 3, 64
COMPAT = CompatInfo(
    model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1, kv_layout="NHD"
)


class CountingLoopback(LoopbackTransport):
    """A loopback that counts its WRITE posts (``refuse_views``: its prepare refuses any plan, as a fast path
    that cannot express a view does)."""

    def __init__(self, agent: str, *, refuse_views: bool = False) -> None:
        super().__init__(agent)
        self.writes = 0
        self.refuse_views = refuse_views

    def prepare(
        self, peer: str, *, local_view: BlockView = WHOLE_BLOCK, remote_view: BlockView = WHOLE_BLOCK
    ) -> PreparedPlan:
        if self.refuse_views:
            raise RemoteMismatchError("test: this fast path cannot express the views")
        return super().prepare(peer, local_view=local_view, remote_view=remote_view)

    def post(
        self,
        op: XferOp | str,
        plan: PreparedPlan,
        local_blocks: np.ndarray | Sequence[int],
        remote_blocks: np.ndarray | Sequence[int],
        **kwargs: Any,
    ) -> TransferHandle:
        if XferOp(op) is XferOp.WRITE:
            self.writes += 1
        return super().post(op, plan, local_blocks, remote_blocks, **kwargs)


class FastWhenOffered:
    """A path selector that picks the fast transport whenever the peer offers fast-path metadata."""

    def select(self, primary: Transport, fast: Transport | None, offer: PeerMetadata | None) -> DataPath:
        if fast is None or offer is None:
            return DataPath(primary)
        return DataPath(fast, fast.add_peer(offer), PathChoice("fast", "test: offered"))


def world(selector: PathSelector | None, *, refuse_views: bool = False, d_fast: bool = True) -> Any:
    import torch

    suffix = time.monotonic_ns()
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
    made: list[CountingLoopback] = []

    def transport(name: str, kv: list[Any], **kw: Any) -> CountingLoopback:
        t = CountingLoopback(f"{name}-{suffix}", **kw)
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
        made.append(t)
        return t

    tp, fp = transport("p", src), transport("p-fast", src, refuse_views=refuse_views)
    td, fd = transport("d", dst), transport("d-fast", dst) if d_fast else None
    sl, tl = SourceLedger(BLOCKS, worker="p"), TargetLedger(BLOCKS, worker="d")
    kwargs = {} if selector is None else {"path_selector": selector}
    prod = Producer(sl, tp, COMPAT, fast_transport=fp, **kwargs)
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(), fast_transport=fd)
    cons.connect(prod.address)
    sp, sc = StreamProducer(prod, layers=LAYERS), StreamConsumer(cons, options=StreamOptions())
    path = prod.push_path(td.agent, td.epoch)
    return SimpleNamespace(
        prod=prod, cons=cons, sp=sp, sc=sc, src=src, dst=dst, tp=tp, fp=fp, td=td, fd=fd, path=path, made=made
    )


def close(w: Any) -> None:
    for part in (w.sc, w.sp, w.cons, w.prod, *w.made):
        part.close()


def stream_once(w: Any) -> None:
    w.prod.ledger.allocate("r", [1, 2, 3])
    w.cons.ledger.reserve("r", [7, 8, 9])
    assert w.sc.request_stream("r", w.prod.address, layers=LAYERS)
    assert w.sp.begin("r")
    for layer in range(LAYERS):
        w.sp.layer_done("r", layer, [1, 2, 3])
    assert until(lambda: w.sc.pending() == 0)
    assert w.sc.counts["completed"] == 1
    for layer in range(LAYERS):
        assert np.array_equal(w.dst[layer][[7, 8, 9]].numpy(), w.src[layer][[1, 2, 3]].numpy())


def test_p_picks_the_fast_path_for_its_pushes_and_the_stream_writes_through_it() -> None:
    w = world(FastWhenOffered())
    try:
        assert w.path.transport is w.fp and w.path.peer == w.fd.agent
        assert w.path.choice == PathChoice("fast", "test: offered")
        stream_once(w)
        # every layer went through the fast path; D took its notes from its fast transport
        assert w.fp.writes == LAYERS and w.tp.writes == 0
        assert w.sp.counts["layers_posted"] == LAYERS
    finally:
        close(w)


def test_a_fast_path_that_refuses_the_views_keeps_the_primary_plan_and_says_why() -> None:
    w = world(FastWhenOffered(), refuse_views=True)
    try:
        assert w.path.transport is w.tp and w.path.peer == w.td.agent
        assert w.path.choice is not None and w.path.choice.backend == w.tp.name
        assert "refused the views" in w.path.choice.reason
        stream_once(w)
        assert w.tp.writes == LAYERS and w.fp.writes == 0
    finally:
        close(w)


@pytest.mark.parametrize("selector, d_fast", [(None, True), (FastWhenOffered(), False)])
def test_without_a_selection_or_an_offer_pushes_stay_on_the_primary_transport(selector: Any, d_fast: bool) -> None:
    w = world(selector, d_fast=d_fast)
    try:
        assert w.path.transport is w.tp and w.path.choice is None
        stream_once(w)
        assert w.tp.writes == LAYERS and w.fp.writes == 0
    finally:
        close(w)


def _meta(agent: str) -> PeerMetadata:
    t = LoopbackTransport(f"{agent}-{time.monotonic_ns()}")
    try:
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (0x1000,), (BYTES,)))
        return t.local_metadata()
    finally:
        t.close()


def test_get_meta_fast_meta_round_trips_and_an_older_get_meta_still_decodes() -> None:
    class OldGetMeta(msgspec.Struct, frozen=True, tag="GetMeta"):
        compat: CompatInfo
        tp_rank: int
        agent: str
        epoch: int
        meta: PeerMetadata | None = None

    nixl, fast = _meta("d"), _meta("d-fast")
    new = GetMeta(COMPAT, 0, "d", 3, nixl, fast)
    assert decode_handshake(msgspec.msgpack.encode(new)) == new
    old = decode_handshake(msgspec.msgpack.encode(OldGetMeta(COMPAT, 0, "d", 3, nixl)))
    assert isinstance(old, GetMeta) and old.fast_meta is None and old.meta == nixl
    # an older P skips the field it does not know
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldGetMeta).meta == nixl


def test_a_whole_request_push_after_the_prefill_writes_through_the_chosen_path_too() -> None:
    w = world(FastWhenOffered())
    try:
        w.prod.ledger.allocate("q", [4, 5])
        w.prod.ledger.prefill_done("q")
        g = w.prod.grant("q")
        w.cons.ledger.reserve("q", [10, 11])
        w.cons.request_push("q", g, address=w.prod.address)
        assert w.cons.wait_idle(10)
        assert until(lambda: g.transfer not in w.prod.ledger.leases)
        assert [r.reason for r in w.prod.ledger.take_released()] == ["completed"]
        assert w.cons.ledger.stats["loaded"] == 1  # P's done note reached D through D's fast transport
        assert w.fp.writes == 1 and w.tp.writes == 0
        for layer in range(LAYERS):
            assert np.array_equal(w.dst[layer][[10, 11]].numpy(), w.src[layer][[4, 5]].numpy())
    finally:
        close(w)


@pytest.mark.parametrize("d_fast", [True, False])
def test_d_polls_at_its_busy_rhythm_only_while_a_stream_may_notify_on_a_fast_path_that_wakes_nobody(
    d_fast: bool,
) -> None:
    # a layer's note is on T_visible's path: found at the idle poll it would wait up to idle_poll_s (5 ms)
    w = world(FastWhenOffered(), d_fast=d_fast)
    try:
        idle, busy = w.cons.options.idle_poll_s, w.cons.options.service_poll_s
        assert w.cons.poll_interval() == idle
        w.prod.ledger.allocate("r", [1, 2, 3])
        w.cons.ledger.reserve("r", [7, 8, 9])
        assert w.sc.request_stream("r", w.prod.address, layers=LAYERS)
        assert w.cons.poll_interval() == (busy if d_fast else idle)
        assert w.sp.begin("r")
        for layer in range(LAYERS):
            w.sp.layer_done("r", layer, [1, 2, 3])
        assert until(lambda: w.sc.pending() == 0) and w.sc.counts["completed"] == 1
        assert w.cons.poll_interval() == idle  # no stream open: back to the idle rhythm
    finally:
        close(w)
