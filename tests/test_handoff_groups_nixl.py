"""One request spanning two region groups (KV pages and aux rows, SGLang's form) over the real NIXL DRAM transport:
one post moves both, and the handoff grants, claims and loads it under one lease. Every wait is bounded."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from grouped_sides import (
    AUX_REGIONS,
    COMPAT,
    KV_REGIONS,
    PAGE_BYTES,
    PAGES,
    ROW_BYTES,
    ROWS,
    Side,
    assert_moved,
    aux_block,
    wait,
)
from kvlifecycle.transports.loopback import LoopbackTransport
from kvlifecycle.transports.nixl import NixlTransport

from kvlifecycle import layout as L
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.transport import KVLayout, RemoteMismatchError, XferOp, XferStatus

pytestmark = pytest.mark.nixl

_names = itertools.count()


@pytest.mark.parametrize("kinds", [False, True], ids=["one-list", "list-per-group"])
@pytest.mark.parametrize("strided", [True, False], ids=["strided", "per-block"])
def test_one_post_moves_pages_and_an_aux_row(strided: bool, kinds: bool) -> None:
    src, dst = Side(1, kinds), Side(None, kinds)
    n = next(_names)
    a = NixlTransport(f"groups-a{n}", strided_descriptors=strided, probe_bytes=0)
    b = NixlTransport(f"groups-b{n}", strided_descriptors=strided, probe_bytes=0)
    try:
        a.register(src.layout)
        b.register(dst.layout)
        plan = b.prepare(b.add_peer(a.local_metadata()))
        before = dst.snapshot()
        local = [3, 9, 0, aux_block(dst.layout, 4)]
        remote = [7, 1, 11, aux_block(src.layout, 2)]
        made = []
        make = b._nixl.make_prepped_xfer
        b._nixl.make_prepped_xfer = lambda *args: made.append(len(args[2])) or make(*args)
        handle = b.post(XferOp.READ, plan, local, remote)
        assert wait(lambda: b.poll(handle) is not XferStatus.PENDING)
        assert b.poll(handle) is XferStatus.DONE, b.error(handle)
        # one NIXL transfer over both groups, or one per group (pages, then the aux row) when they name kinds
        assert made == ([3 * KV_REGIONS, AUX_REGIONS] if kinds else [3 * KV_REGIONS + AUX_REGIONS])
        stats = b.stats(handle)
        assert stats is not None and stats.desc_count == 3 * KV_REGIONS + AUX_REGIONS
        assert stats.bytes == 3 * KV_REGIONS * PAGE_BYTES + AUX_REGIONS * ROW_BYTES
        b.release(handle)
        assert_moved(src, dst, before, ([7, 1, 11], [3, 9, 0]), (2, 4))
        with pytest.raises(RemoteMismatchError, match="cannot pair"):  # a page into an aux row: refused at post
            b.post(XferOp.READ, plan, [aux_block(dst.layout, 0)], [5])
    finally:
        b.close()
        a.close()


def test_a_transport_that_cannot_post_groups_refuses_them_at_prepare() -> None:
    src, dst = Side(1), Side(None)
    n = next(_names)
    a, b = LoopbackTransport(f"groups-la{n}"), LoopbackTransport(f"groups-lb{n}")
    try:
        a.register(src.layout)
        b.register(dst.layout)
        with pytest.raises(RemoteMismatchError, match="region groups"):
            b.prepare(b.add_peer(a.local_metadata()))
    finally:
        b.close()
        a.close()


@pytest.fixture(params=[False, True], ids=["one-list", "list-per-group"])
def pd(request: pytest.FixtureRequest):
    src, dst = Side(2, request.param), Side(None, request.param)
    n = next(_names)
    tp, td = NixlTransport(f"groups-p{n}", probe_bytes=0), NixlTransport(f"groups-d{n}", probe_bytes=0)
    tp.register(src.layout)
    td.register(dst.layout)
    posts: list[str] = []
    post = td.post

    def counted(*args, **kwargs):
        posts.append(kwargs.get("transfer", ""))
        return post(*args, **kwargs)

    td.post = counted  # type: ignore[method-assign]
    sl = SourceLedger(src.layout.num_blocks, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(dst.layout.num_blocks, worker="d")
    prod = Producer(sl, tp, COMPAT)
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05, probe=False))
    link = cons.connect(prod.address)
    yield prod, cons, src, dst, link, posts
    cons.close()
    prod.close()
    td.close()
    tp.close()
    assert check_source(sl) == [] and check_target(tl) == []


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_handoff_moves_a_request_spanning_both_groups_under_one_lease(pd, mode: str) -> None:
    prod, cons, src, dst, link, posts = pd
    assert link.prepared.local_groups == dst.layout.region_groups  # the handshake carried P's groups
    p_blocks = [2, 4, 6, aux_block(src.layout, 1)]
    d_blocks = [10, 0, 5, aux_block(dst.layout, 3)]
    prod.ledger.allocate(mode, p_blocks)
    prod.ledger.prefill_done(mode)
    grant = prod.grant(mode)
    cons.ledger.reserve(mode, d_blocks)
    before = dst.snapshot()
    if mode == "pull":
        cons.pull(mode, grant, address=prod.address)
    else:
        cons.request_push(mode, grant, address=prod.address)
    assert cons.wait_idle(20)
    assert wait(lambda: grant.transfer not in prod.ledger.leases)
    assert [r.reason for r in prod.ledger.take_released()] == ["completed"]
    assert cons.ledger.requests[mode].state == TargetState.READY_FOR_ATTENTION
    assert_moved(src, dst, before, ([2, 4, 6], [10, 0, 5]), (1, 3))
    assert posts == ([grant.transfer] if mode == "pull" else [])  # a pull is one READ over both groups
    cons.ledger.finish(mode)


def _tp_side(seed: int | None, page_bytes: int) -> tuple[list[np.ndarray], list[np.ndarray], KVLayout]:
    rng = np.random.default_rng(seed)
    fill = (lambda n: rng.integers(0, 256, n, dtype=np.uint8)) if seed is not None else \
        (lambda n: np.zeros(n, dtype=np.uint8))
    kv = [fill(PAGES * page_bytes).reshape(PAGES, page_bytes) for _ in range(KV_REGIONS)]
    aux = [fill(ROWS * ROW_BYTES).reshape(ROWS, ROW_BYTES) for _ in range(AUX_REGIONS)]
    layout = L.grouped_layout(
        L.rows_layout("DRAM", 0, [a.ctypes.data for a in kv], [a.nbytes for a in kv], [page_bytes] * KV_REGIONS),
        L.rows_layout("DRAM", 0, [a.ctypes.data for a in aux], [a.nbytes for a in aux], [ROW_BYTES] * AUX_REGIONS))
    return kv, aux, layout


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)])
def test_tp_plans_slice_the_pages_and_move_aux_rows_whole(p_tp: int, d_tp: int) -> None:
    """Heterogeneous TP over grouped layouts: each read's views (the core's TP plan, HND pages) slice the KV group;
    the aux rows, the same on every rank, move whole. D's pages end up the concatenation (P TP 2 → D TP 1) or the
    slice (P TP 1 → D TP 2) of P's, byte for byte."""
    heads = 2
    unit = PAGE_BYTES // 2  # bytes of one head's share of a page, the same on every rank
    p_page, d_page = unit * heads // p_tp, unit * heads // d_tp
    n = next(_names)
    ps = [(*_tp_side(10 + r, p_page), NixlTransport(f"tp-p{r}-{n}", probe_bytes=0)) for r in range(p_tp)]
    ds = [(*_tp_side(None, d_page), NixlTransport(f"tp-d{r}-{n}", probe_bytes=0)) for r in range(d_tp)]
    try:
        for _, _, layout, t in ps + ds:
            t.register(layout)
        src, dst, row_src, row_dst = [1, 8, 3], [0, 11, 6], 4, 2
        for d_rank, (_, _, d_layout, td) in enumerate(ds):
            plan = L.tp_plan(p_tp=p_tp, d_tp=d_tp, d_rank=d_rank, p_block_bytes=p_page, d_block_bytes=d_page,
                             num_kv_heads=heads, kv_layout="HND")
            for read in plan.reads:
                _, _, p_layout, tp = ps[read.p_rank]
                prepared = td.prepare(td.add_peer(tp.local_metadata()), local_view=read.local_view,
                                      remote_view=read.remote_view)
                handle = td.post(XferOp.READ, prepared, [*dst, aux_block(d_layout, row_dst)],
                                 [*src, aux_block(p_layout, row_src)])
                assert wait(lambda h=handle, t=td: t.poll(h) is not XferStatus.PENDING)
                assert td.poll(handle) is XferStatus.DONE, td.error(handle)
                td.release(handle)
        for d_rank, (d_kv, d_aux, _, _) in enumerate(ds):
            for r in range(KV_REGIONS):
                if p_tp > d_tp:  # D's page: P rank 0's heads, then P rank 1's
                    want = np.concatenate([p_kv[r][src] for p_kv, _, _, _ in ps], axis=1)
                else:  # D rank's share of P's page
                    want = ps[0][0][r][src][:, d_rank * d_page:(d_rank + 1) * d_page]
                assert np.array_equal(d_kv[r][dst], want)
                assert not d_kv[r][np.setdiff1d(np.arange(PAGES), dst)].any()  # no other page written
            for r in range(AUX_REGIONS):
                assert np.array_equal(d_aux[r][row_dst], ps[-1][1][r][row_src])  # whole, from the last P rank read
                assert not d_aux[r][np.setdiff1d(np.arange(ROWS), [row_dst])].any()
    finally:
        for _, _, _, t in ds + ps:
            t.close()
