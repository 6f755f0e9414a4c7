"""Layer-wise streams across heterogeneous TP over the real NIXL DRAM transport, in one process: every rank is a
real Producer/Consumer with its own NIXL agent. P TP 2 → D TP 1 (one D request, two P ranks each writing its heads)
and P TP 1 → D TP 2 (one P request, two D ranks each taking its head slice), with head-major blocks (HND of 16
tokens, NHD of one token). Every P rank fills its heads with its own bytes; after a stream every D block holds
exactly its head slice(s) and no other block changed. Every wait is bounded; nothing asserts on time."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from held_transport import Gated
from kvlifecycle.transports.nixl import NixlTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle import layout as L
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo, CompatMismatchError
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import BlockView, KVLayout

pytestmark = pytest.mark.nixl

HEADS, HEAD_SIZE, DTYPE_BYTES = 4, 8, 2
UNIT = HEAD_SIZE * DTYPE_BYTES  # bytes of one head × one token: the views' unit (HandoffOptions.unit_bytes)
LAYERS, BLOCKS = 2, 12
ROWS, ROW_BYTES, AUX_REGIONS = 4, 24, 1
STREAM = StreamOptions(stream_timeout_s=20.0)
_names = itertools.count()


@dataclass
class Rank:
    """One TP rank's KV (a region per layer, then its aux rows if any) and its side of the handoff."""

    side: str
    tp: int
    rank: int
    block_size: int
    kv_layout: str
    seed: int | None
    aux: bool = False
    wrap: Callable[[NixlTransport], Any] | None = None  # a transport double over the real one (P's writes held)
    kv: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        fill = (lambda shape: rng.integers(1, 256, shape, dtype=np.uint8)) if self.seed is not None else \
            (lambda shape: np.zeros(shape, dtype=np.uint8))
        self.page_bytes = HEADS // self.tp * self.block_size * UNIT
        self.kv = [fill((BLOCKS, self.page_bytes)) for _ in range(LAYERS)]
        pages = L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.kv], [a.nbytes for a in self.kv],
                              [self.page_bytes] * LAYERS)
        layout: KVLayout = pages
        if self.aux:  # SGLang's aux rows: the same bytes on every P rank
            aux_rng = np.random.default_rng(99)
            self.rows = [aux_rng.integers(1, 256, (ROWS, ROW_BYTES), dtype=np.uint8) if self.seed is not None
                         else np.zeros((ROWS, ROW_BYTES), dtype=np.uint8) for _ in range(AUX_REGIONS)]
            layout = L.grouped_layout(pages, L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.rows],
                                                           [a.nbytes for a in self.rows], [ROW_BYTES] * AUX_REGIONS))
        self.layout = layout
        nixl = NixlTransport(f"tp-{self.side}{self.rank}-{next(_names)}", probe_bytes=0)
        nixl.register(layout)
        self.transport = nixl if self.wrap is None else self.wrap(nixl)
        compat = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS,
                            head_size=HEAD_SIZE, block_size=self.block_size, kv_layout=self.kv_layout,
                            tp_size=self.tp)
        options = HandoffOptions(unit_bytes=UNIT, probe=False)
        layers, stream = (1, StreamOptions(stream_timeout_s=20.0, regions_per_layer=LAYERS + AUX_REGIONS)) \
            if self.aux else (LAYERS, STREAM)
        self.layers = layers
        if self.side == "p":
            self.ledger: SourceLedger | TargetLedger = SourceLedger(layout.num_blocks, worker=f"p{self.rank}")
            self.handoff: Producer | Consumer = Producer(self.ledger, self.transport, compat, tp_rank=self.rank,
                                                         options=options)
            self.streams: StreamProducer | StreamConsumer = StreamProducer(self.handoff, layers=layers,
                                                                           options=stream)
        else:
            self.ledger = TargetLedger(layout.num_blocks, worker=f"d{self.rank}")
            self.handoff = Consumer(self.ledger, self.transport, compat, tp_rank=self.rank, options=options)
            self.streams = StreamConsumer(self.handoff, options=stream)

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in self.kv + self.rows]

    def close(self) -> None:
        for part in (self.streams, self.handoff, self.transport):
            part.close()


def world(p_tp: int, d_tp: int, *, block_size: int, kv_layout: str, aux: bool = False,
          gate_p: int | None = None) -> tuple[list[Rank], list[Rank]]:
    """``gate_p``: the P rank whose writes are held (tests/held_transport.py) until let go."""
    ps = [Rank("p", p_tp, r, block_size, kv_layout, seed=10 + r, aux=aux, wrap=Gated if r == gate_p else None)
          for r in range(p_tp)]
    ds = [Rank("d", d_tp, r, block_size, kv_layout, seed=None, aux=aux) for r in range(d_tp)]
    return ps, ds


def connect_sources(ps: list[Rank], ds: list[Rank]) -> dict[int, list[str]]:
    """Each D rank handshakes (with push metadata) with the P ranks it reads; returns their addresses per D rank."""
    sources: dict[int, list[str]] = {}
    for d in ds:
        ranks = L.tp_source_ranks(p_tp=ps[0].tp, d_tp=d.tp, d_rank=d.rank)
        for r in ranks:
            d.handoff.connect(ps[r].handoff.address)  # type: ignore[union-attr]
        sources[d.rank] = [ps[r].handoff.address for r in ranks]  # type: ignore[union-attr]
    return sources


def close_all(ranks: list[Rank]) -> None:
    for r in ranks:
        r.close()
    for r in ranks:
        problems = check_source(r.ledger) if r.side == "p" else check_target(r.ledger)  # type: ignore[arg-type]
        assert problems == []


@pytest.mark.parametrize(("block_size", "kv_layout"), [(16, "HND"), (1, "NHD")])
@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_push_plans_carry_the_views_of_d_reads(p_tp: int, d_tp: int, block_size: int, kv_layout: str) -> None:
    """P prepares each D rank's push plan with the views D's pull of that P rank would use, scaled to bytes."""
    ps, ds = world(p_tp, d_tp, block_size=block_size, kv_layout=kv_layout)
    try:
        connect_sources(ps, ds)
        slice_bytes = HEADS // max(p_tp, d_tp) * block_size * UNIT
        for p in ps:
            plans = p.handoff._push_plans  # type: ignore[union-attr]
            assert len(plans) == (d_tp // p_tp or 1)
            for plan in (path.plan for path in plans.values()):
                d_rank = next(d.rank for d in ds if d.transport.agent == plan.peer)
                if p_tp > d_tp:  # P's whole block into its slice of D's
                    assert plan.local_view == BlockView() and plan.remote_view == BlockView(p.rank * slice_bytes,
                                                                                            slice_bytes)
                else:  # D rank's slice of P's block into D's whole block
                    assert plan.local_view == BlockView(d_rank * slice_bytes, slice_bytes)
                    assert plan.remote_view == BlockView()
    finally:
        close_all(ps + ds)


def test_push_after_the_prefill_across_tp_sizes_is_refused_before_any_load_starts() -> None:
    """One PushRequest is one WRITE per (transfer, part): two D ranks sharing P's two-consumer lease would collide
    (the second one's write taken for a duplicate). The post-prefill push refuses them by name; streams and pulls
    cross TP sizes."""
    ps, ds = world(1, 2, block_size=16, kv_layout="HND")
    (p,) = ps
    try:
        sources = connect_sources(ps, ds)
        p.ledger.allocate("r", [3, 0])  # type: ignore[union-attr]
        p.ledger.prefill_done("r")  # type: ignore[union-attr]
        grant = p.handoff.grant("r", consumers=2)  # type: ignore[union-attr]
        d = ds[0]
        d.ledger.reserve("d-r", [4, 9])
        with pytest.raises(ValueError, match="push after the prefill supports one P rank with equal layouts"):
            d.handoff.request_push("d-r", grant, address=sources[0][0])  # type: ignore[union-attr]
        assert d.ledger.requests["d-r"].state == TargetState.RESERVED and not d.ledger.loads
        d.ledger.cancel("d-r")
        p.ledger.cancel("r")  # type: ignore[union-attr]
    finally:
        close_all(ps + ds)


def test_a_p_rank_that_is_not_a_source_of_d_refuses_to_push_naming_both_ranks() -> None:
    p = Rank("p", 4, 0, 16, "HND", seed=3)  # D rank 1 of TP 2 reads P ranks 2 and 3 of TP 4, not 0
    d = Rank("d", 2, 1, 16, "HND", seed=None)
    try:
        with pytest.raises(CompatMismatchError, match="reads P ranks"):  # D refuses it too
            d.handoff.connect(p.handoff.address)  # type: ignore[union-attr]
        refusals = list(p.handoff._push_refusals.values())  # type: ignore[union-attr]
        assert len(refusals) == 1 and "P rank 0" in refusals[0] and "D rank 1" in refusals[0]
        assert not p.handoff._push_plans  # type: ignore[union-attr]
    finally:
        close_all([p, d])


def test_nhd_blocks_of_16_across_differing_tp_are_refused_with_what_works() -> None:
    ps, ds = world(2, 1, block_size=16, kv_layout="NHD")
    try:
        with pytest.raises(CompatMismatchError) as refused:
            ds[0].handoff.connect(ps[0].handoff.address)  # type: ignore[union-attr]
        assert ("heterogeneous TP (P 2 ↔ D 1) needs the HND layout, or NHD blocks of one token (SGLang --page-size "
                "1); got NHD blocks of 16 tokens") in str(refused.value)
    finally:
        close_all(ps + ds)


def p_forward(p: Rank, request: str, src: list[int]) -> None:
    """P's prefill: every layer of every block, then its end; P frees its blocks once its writes settled."""
    ledger, streams = p.ledger, p.streams
    assert isinstance(ledger, SourceLedger) and isinstance(streams, StreamProducer)
    for layer in range(p.layers):
        streams.layer_done(request, layer, src)
    assert streams.prefill_ended(request)
    ledger.prefill_done(request)
    streams.release(request, lambda: ledger.free(request))


def expected_slices(ps: list[Rank], d: Rank, src: list[int]) -> list[np.ndarray]:
    """What D rank ``d``'s blocks must hold per region: the P ranks' heads it reads, side by side (P TP > D TP),
    or its slice of its one P rank's (D TP > P TP); aux rows whole."""
    p_tp = ps[0].tp
    out = []
    for region in range(LAYERS):
        if p_tp >= d.tp:
            ranks = L.tp_source_ranks(p_tp=p_tp, d_tp=d.tp, d_rank=d.rank)
            out.append(np.concatenate([ps[r].kv[region][src] for r in ranks], axis=1))
        else:
            ratio = d.tp // p_tp
            p = ps[d.rank // ratio]
            width = p.page_bytes // ratio
            out.append(p.kv[region][src][:, (d.rank % ratio) * width:(d.rank % ratio + 1) * width])
    return out


def assert_landed(ps: list[Rank], d: Rank, before: list[np.ndarray], src: list[int], dst: list[int]) -> None:
    for region, want in enumerate(expected_slices(ps, d, src)):
        assert np.array_equal(d.kv[region][dst], want)
        others = np.setdiff1d(np.arange(BLOCKS), dst)
        assert np.array_equal(d.kv[region][others], before[region][others])  # untouched blocks untouched


@pytest.mark.parametrize(("block_size", "kv_layout"), [(16, "HND"), (1, "NHD")])
def test_two_p_ranks_stream_their_heads_into_one_d_request(block_size: int, kv_layout: str) -> None:
    ps, ds = world(2, 1, block_size=block_size, kv_layout=kv_layout)
    (d,) = ds
    try:
        sources = connect_sources(ps, ds)
        src, dst = [1, 7, 3, 10], [0, 11, 5, 2]
        for p in ps:
            p.ledger.allocate("r", src)  # type: ignore[union-attr]
        d.ledger.reserve("r", dst)
        before = d.snapshot()
        streams = d.streams
        assert isinstance(streams, StreamConsumer)
        transfer = streams.request_streams("r", sources[0], layers=LAYERS)
        assert transfer is not None and streams.streaming("r")
        assert ps[0].streams.begin("r")  # type: ignore[union-attr]
        p_forward(ps[0], "r", src)
        progress = d.ledger.layer_progress  # type: ignore[union-attr]
        assert until(lambda: transfer in progress and progress[transfer].complete(0), 20.0)
        assert d.ledger.requests["r"].state == TargetState.LOADING  # P rank 1's heads have not landed: not READY
        assert ps[1].streams.begin("r")  # type: ignore[union-attr]
        p_forward(ps[1], "r", src)
        assert until(lambda: streams.pending() == 0, 20.0)
        assert streams.counts["completed"] == 1 and (d.ledger.state[dst] == TargetState.READY_FOR_ATTENTION).all()  # type: ignore[union-attr]
        assert_landed(ps, d, before, src, dst)
        assert until(lambda: all(not p.ledger.requests for p in ps), 20.0)
        d.ledger.finish("r")  # type: ignore[union-attr]
    finally:
        close_all(ps + ds)


def p_end(p: Rank, request: str) -> None:
    ledger, streams = p.ledger, p.streams
    assert isinstance(ledger, SourceLedger) and isinstance(streams, StreamProducer)
    streams.prefill_ended(request, aborted=True)
    ledger.prefill_done(request)
    streams.release(request, lambda: ledger.free(request))


@pytest.mark.parametrize("how", ["p_aborts", "peer_lost"])
def test_vllm_56104_a_failed_part_frees_d_blocks_only_once_the_sibling_p_ranks_write_settled(how: str) -> None:
    """P rank 0's part fails (P aborts it, or D learns P rank 0 is gone) while P rank 1's first layer is still in
    flight into the same D blocks: D fails the load, cancels P rank 1's stream, and keeps the blocks LOADING until
    that write settled; then they are FREE (vLLM #56104: a block freed and reused while a sibling rank's write may
    still land)."""
    ps, ds = world(2, 1, block_size=16, kv_layout="HND", gate_p=1)
    (d,) = ds
    gated = ps[1].transport
    assert isinstance(gated, Gated)
    try:
        sources = connect_sources(ps, ds)
        src, dst = [2, 4, 6], [9, 1, 3]
        for p in ps:
            p.ledger.allocate("r", src)  # type: ignore[union-attr]
        d.ledger.reserve("r", dst)
        streams = d.streams
        assert isinstance(streams, StreamConsumer)
        transfer = streams.request_streams("r", sources[0], layers=LAYERS)
        assert transfer is not None
        assert all(p.streams.begin("r") for p in ps)  # type: ignore[union-attr]
        ps[1].streams.layer_done("r", 0, src)  # type: ignore[union-attr]
        assert until(lambda: len(gated.pending) == 1)  # P rank 1's write of layer 0 is in flight
        if how == "p_aborts":
            ps[0].streams.cancel("r", "P rank 0 aborted")  # type: ignore[union-attr]
        else:
            assert streams.peer_lost(ps[0].transport.agent, "P rank 0 lost") == 1
        assert until(lambda: (transfer, 0) not in streams._streams)  # part 0 settled
        assert until(lambda: ps[1].streams.status("r").state == "stopping")  # type: ignore[union-attr]
        assert streams.streaming("r") and transfer in d.ledger.loads  # type: ignore[union-attr]
        assert (d.ledger.state[dst] == TargetState.LOADING).all()  # type: ignore[union-attr]
        assert gated.let_go() == 1  # the sibling's write lands now, into blocks D still holds
        assert until(lambda: streams.pending() == 0, 20.0)
        assert "r" not in d.ledger.requests and (d.ledger.state[dst] == TargetState.FREE).all()  # type: ignore
        assert streams.counts["failed"] == 1 and streams.counts["completed"] == 0
        for p in ps:
            p_end(p, "r")
        assert until(lambda: all(not p.ledger.requests for p in ps), 20.0)
    finally:
        close_all(ps + ds)


def test_a_decline_by_the_first_p_rank_declines_and_a_later_decline_fails_once_the_others_settled() -> None:
    ps, ds = world(2, 1, block_size=16, kv_layout="HND")
    (d,) = ds
    try:
        sources = connect_sources(ps, ds)
        streams = d.streams
        assert isinstance(streams, StreamConsumer)
        for p in ps:  # both prefills ended before D's reservation: both would decline
            p.ledger.allocate("a", [1])  # type: ignore[union-attr]
            assert not p.streams.prefill_ended("a")  # type: ignore[union-attr]
        d.ledger.reserve("a", [4])
        assert streams.request_streams("a", sources[0], layers=LAYERS) is None
        assert d.ledger.requests["a"].state == TargetState.RESERVED and streams.pending() == 0
        assert ps[1].streams.counts["declined"] == 0  # type: ignore[union-attr]  # P rank 1 was never asked
        # P rank 0 accepts, P rank 1 declines: P rank 0's reservation is cancelled, then the load fails
        ps[1].ledger.allocate("b", [2])  # type: ignore[union-attr]
        assert not ps[1].streams.prefill_ended("b")  # type: ignore[union-attr]
        d.ledger.reserve("b", [5])
        events: list[object] = []
        d.ledger.listeners.append(events.append)  # type: ignore[union-attr]
        transfer = streams.request_streams("b", sources[0], layers=LAYERS)
        assert transfer is not None and streams.declines["b"].startswith("prefill began")
        assert until(lambda: streams.pending() == 0)
        failed = [e for e in events if isinstance(e, ev.TgtLoadFailed) and e.transfer == transfer]
        assert len(failed) == 1 and "declined part 1" in failed[0].reason
        assert "b" not in d.ledger.requests and streams.counts["failed"] == 1
        assert ps[0].streams.status("b").state == "stopped"  # type: ignore[union-attr]  # D cancelled it unbegun
        for p in ps:
            p.ledger.prefill_done("a")  # type: ignore[union-attr]
            p.ledger.free("a")  # type: ignore[union-attr]
            p.streams.release("a", lambda: None)  # type: ignore[union-attr]
        ps[1].ledger.prefill_done("b")  # type: ignore[union-attr]
        ps[1].ledger.free("b")  # type: ignore[union-attr]
        d.ledger.cancel("a")  # type: ignore[union-attr]
    finally:
        close_all(ps + ds)


@pytest.mark.parametrize(("block_size", "kv_layout"), [(16, "HND"), (1, "NHD")])
def test_one_p_rank_streams_each_d_rank_its_head_slice(block_size: int, kv_layout: str) -> None:
    """P TP 1 → D TP 2: both D ranks' reservations for one P request coexist; P waits for both (``reservations``),
    then each layer leaves as one write per D rank, each with its own D's views (its half of P's heads)."""
    ps, ds = world(1, 2, block_size=block_size, kv_layout=kv_layout)
    (p,) = ps
    producer = p.streams
    assert isinstance(producer, StreamProducer)
    try:
        sources = connect_sources(ps, ds)
        src, dsts = [3, 0, 8], {0: [4, 9, 1], 1: [11, 2, 6]}
        p.ledger.allocate("r", src)  # type: ignore[union-attr]
        befores, transfers = {}, {}
        for d in ds:
            d.ledger.reserve("d-r", dsts[d.rank])
            befores[d.rank] = d.snapshot()
            assert producer.reservations("r") == d.rank
            transfers[d.rank] = d.streams.request_streams("d-r", sources[d.rank], layers=LAYERS,  # type: ignore
                                                          source_request="r")
            assert transfers[d.rank] is not None
        assert producer.reservations("r") == 2 and producer.status("r").state == "reserved"
        # who reserved, and the TP size each declared in its handshake: how an engine knows it waits for 2 D ranks
        agents = {d.transport.agent for d in ds}
        assert set(producer.reserving_agents("r")) == agents and producer.reserving_agents("other") == ()
        handoff = p.handoff
        assert isinstance(handoff, Producer)
        assert all(handoff.peer_tp_size(agent) == 2 for agent in agents) and handoff.peer_tp_size("nobody") is None
        assert producer.begin("r")
        assert producer.status("r").state in ("streaming", "complete") and producer.pending() == 2
        p_forward(p, "r", src)
        for d in ds:
            assert until(lambda d=d: d.streams.pending() == 0, 20.0)  # type: ignore[union-attr]
            assert (d.ledger.state[dsts[d.rank]] == TargetState.READY_FOR_ATTENTION).all()  # type: ignore
            assert_landed(ps, d, befores[d.rank], src, dsts[d.rank])
            d.ledger.finish("d-r")  # type: ignore[union-attr]
        assert until(lambda: not p.ledger.requests, 20.0)  # released once both D ranks' writes settled
        assert producer.counts["layers_posted"] == 2 * LAYERS and producer.status("r").state == "none"
    finally:
        close_all(ps + ds)


def test_a_d_rank_reserving_after_the_prefill_began_joins_and_catches_up() -> None:
    ps, ds = world(1, 2, block_size=16, kv_layout="HND")
    (p,) = ps
    producer = p.streams
    assert isinstance(producer, StreamProducer)
    try:
        sources = connect_sources(ps, ds)
        src, dsts = [5, 6], {0: [1, 2], 1: [3, 4]}
        p.ledger.allocate("r", src)  # type: ignore[union-attr]
        ds[0].ledger.reserve("r", dsts[0])
        assert ds[0].streams.request_streams("r", sources[0], layers=LAYERS)  # type: ignore[union-attr]
        assert producer.begin("r")
        producer.layer_done("r", 0, src)  # layer 0 leaves for D rank 0 only
        ds[1].ledger.reserve("r", dsts[1])
        assert ds[1].streams.request_streams("r", sources[1], layers=LAYERS)  # type: ignore[union-attr]
        assert producer.reservations("r") == 2 and producer.counts["joined_late"] == 1
        for layer in range(1, LAYERS):
            producer.layer_done("r", layer, src)
        assert producer.prefill_ended("r")
        p.ledger.prefill_done("r")  # type: ignore[union-attr]
        producer.release("r", lambda: p.ledger.free("r"))  # type: ignore[union-attr]
        for d in ds:
            assert until(lambda d=d: d.streams.pending() == 0, 20.0)  # type: ignore[union-attr]
            assert (d.ledger.state[dsts[d.rank]] == TargetState.READY_FOR_ATTENTION).all()  # type: ignore
            d.ledger.finish("r")  # type: ignore[union-attr]
        for d in ds:
            want = expected_slices(ps, d, src)
            assert all(np.array_equal(d.kv[region][dsts[d.rank]], want[region]) for region in range(LAYERS))
        assert until(lambda: not p.ledger.requests, 20.0)
    finally:
        close_all(ps + ds)


def test_region_groups_stream_across_tp_2_to_1_pages_sliced_and_aux_rows_whole() -> None:
    """SGLang's form: KV pages and aux rows in one layout, one 'layer' of all regions. Each P rank writes its heads
    of the pages and the aux row whole (the same bytes on every P rank)."""
    ps, ds = world(2, 1, block_size=1, kv_layout="NHD", aux=True)
    (d,) = ds
    try:
        sources = connect_sources(ps, ds)
        pages, dpages, row, drow = [2, 9], [7, 0], 3, 1
        src = [*pages, L.group_start(ps[0].layout, 1) + row]
        dst = [*dpages, L.group_start(d.layout, 1) + drow]
        for p in ps:
            p.ledger.allocate("r", src)  # type: ignore[union-attr]
        d.ledger.reserve("r", dst)
        before = d.snapshot()
        streams = d.streams
        assert isinstance(streams, StreamConsumer)
        assert streams.request_streams("r", sources[0], layers=1)
        for p in ps:
            assert p.streams.begin("r")  # type: ignore[union-attr]
            p_forward(p, "r", src)
        assert until(lambda: streams.pending() == 0, 20.0)
        assert (d.ledger.state[dst] == TargetState.READY_FOR_ATTENTION).all()  # type: ignore[union-attr]
        assert_landed(ps, d, before, pages, dpages)
        for region in range(AUX_REGIONS):
            assert np.array_equal(d.rows[region][drow], ps[0].rows[region][row])
            others = np.setdiff1d(np.arange(ROWS), [drow])
            assert np.array_equal(d.rows[region][others], before[LAYERS + region][others])
        assert until(lambda: all(not p.ledger.requests for p in ps), 20.0)
        d.ledger.finish("r")  # type: ignore[union-attr]
    finally:
        close_all(ps + ds)
