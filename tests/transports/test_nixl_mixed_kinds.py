"""SGLang's data plane on a GPU, worker-side (SGLang itself does not run here): KV pages in VRAM, aux rows in host
memory, one layout whose groups name their kinds (``adapters/sglang/transfer.layouts``). NIXL registers each kind,
and one post over pages and an aux row moves each group in its own transfer; the bytes land on both kinds, and a
push's notification reaches D only once both parts are DONE.

The same-node fast path is a split transport: CUDA IPC over the VRAM pages, a NIXL agent of its own over the host
rows (``transports/split.py``). The selector picks it for a peer split the same way (CUDA IPC's self-test passed),
and a post, and a whole handoff, pull and push, move the pages through CUDA IPC and the rows through NIXL.

Skipped without CUDA (``pytest -rs`` prints why). Every wait is bounded.
"""

from __future__ import annotations

import itertools
import logging
import time

import numpy as np
import pytest
import torch

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.adapters.sglang.transfer import DataPlane, layouts

from kvlifecycle.layout import group_start
from kvlifecycle.transport import MemoryKind, Notification, XferOp, XferStatus

HAVE_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not HAVE_CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False")
PAGES, PAGE_BYTES, KV_REGIONS = 16, 2048, 4
ROWS, ROW_BYTES, AUX_REGIONS = 6, 64, 2
WAIT_S = 60.0
_names = itertools.count()


class Worker:
    """One SGLang worker's pages (VRAM, cuda:0) and aux rows (host memory), and its data plane."""

    def __init__(self, seed: int | None) -> None:
        gen = torch.Generator().manual_seed(seed or 0)
        fill = (lambda n: torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)) if seed is not None else \
            (lambda n: torch.zeros(n, dtype=torch.uint8))
        self.kv = [fill(PAGES * PAGE_BYTES).view(PAGES, PAGE_BYTES).to("cuda:0") for _ in range(KV_REGIONS)]
        self.aux = [fill(ROWS * ROW_BYTES).view(ROWS, ROW_BYTES).numpy().copy() for _ in range(AUX_REGIONS)]
        torch.cuda.synchronize()
        self.layout = layouts(
            [t.data_ptr() for t in self.kv], [t.numel() for t in self.kv], [PAGE_BYTES] * KV_REGIONS,
            [a.ctypes.data for a in self.aux], [a.nbytes for a in self.aux], [ROW_BYTES] * AUX_REGIONS,
            kind=MemoryKind.VRAM, device_id=0, aux_kind=MemoryKind.DRAM)
        self.plane = DataPlane(f"mixed-{next(_names)}", 1, self.layout)

    def aux_block(self, row: int) -> int:
        return group_start(self.layout, 1) + row

    def close(self) -> None:
        self.plane.close()


def wait_settled(transport, handle) -> XferStatus:
    deadline = time.monotonic() + WAIT_S
    while transport.poll(handle) is XferStatus.PENDING and time.monotonic() < deadline:
        time.sleep(0.001)
    return transport.poll(handle)


@pytest.fixture
def pair(caplog: pytest.LogCaptureFixture):
    with caplog.at_level(logging.WARNING, logger="kvlifecycle.adapters.sglang"):
        p, d = Worker(7), Worker(None)
    try:
        yield p, d, caplog.text
    finally:
        d.close()
        p.close()


def test_the_fast_path_is_cuda_ipc_over_the_pages_and_nixl_over_the_rows(pair) -> None:
    from kvlifecycle.transports.cuda_ipc import CudaIpcTransport
    from kvlifecycle.transports.nixl import NixlTransport
    from kvlifecycle.transports.split import SplitTransport

    p, _d, logged = pair
    assert p.layout.group_kinds == (MemoryKind.VRAM, MemoryKind.DRAM)
    fast = p.plane.fast_transport
    assert isinstance(fast, SplitTransport), logged
    (ipc, pages), (host, rows) = zip(fast.parts, fast.groups, strict=True)
    assert isinstance(ipc, CudaIpcTransport) and pages == (0,)
    assert isinstance(host, NixlTransport) and rows == (1,)
    assert ipc.registered_regions() == KV_REGIONS and host.registered_regions() == AUX_REGIONS
    assert "no CUDA IPC fast path" not in logged


def _check_moved(p: Worker, d: Worker, before_kv, before_aux, p_pages, d_pages, p_row: int, d_row: int) -> None:
    torch.cuda.synchronize()
    for r in range(KV_REGIONS):  # the pages, in VRAM, and nothing else
        assert torch.equal(d.kv[r][d_pages], p.kv[r][p_pages])
        others = [i for i in range(PAGES) if i not in d_pages]
        assert torch.equal(d.kv[r][others], before_kv[r][others])
    for r in range(AUX_REGIONS):  # the aux row, in host memory, and nothing else
        assert np.array_equal(d.aux[r][d_row], p.aux[r][p_row])
        others = [i for i in range(ROWS) if i != d_row]
        assert np.array_equal(d.aux[r][others], before_aux[r][others])


@pytest.mark.parametrize("op", [XferOp.READ, XferOp.WRITE], ids=["pull", "push"])
def test_one_post_moves_vram_pages_and_a_host_aux_row(pair, op: XferOp) -> None:
    p, d, _ = pair
    p_pages, d_pages, p_row, d_row = [3, 9, 0], [11, 2, 15], 4, 1
    if op is XferOp.READ:  # D reads P's pages and row
        me, peer, mine, theirs = d, p, [*d_pages, d.aux_block(d_row)], [*p_pages, p.aux_block(p_row)]
    else:  # P writes them into D's
        me, peer, mine, theirs = p, d, [*p_pages, p.aux_block(p_row)], [*d_pages, d.aux_block(d_row)]
    plan = me.plane.transport.prepare(me.plane.transport.add_peer(peer.plane.transport.local_metadata()))
    before_kv = [t.clone() for t in d.kv]
    before_aux = [a.copy() for a in d.aux]
    note = Notification("r", "t1", 1, kind="done")
    handle = me.plane.transport.post(op, plan, mine, theirs, notification=note, transfer="t1")
    assert wait_settled(me.plane.transport, handle) is XferStatus.DONE, me.plane.transport.error(handle)
    stats = me.plane.transport.stats(handle)
    assert stats is not None and stats.bytes == 3 * KV_REGIONS * PAGE_BYTES + AUX_REGIONS * ROW_BYTES
    me.plane.transport.release(handle)
    _check_moved(p, d, before_kv, before_aux, p_pages, d_pages, p_row, d_row)
    # the peer hears of it (sent once both parts were DONE)
    deadline = time.monotonic() + WAIT_S
    got: list = []
    while not got and time.monotonic() < deadline:
        got = [n for _, n in peer.plane.transport.notifications() if n.transfer == "t1"]
        time.sleep(0.002)
    assert [n.kind for n in got] == ["done"]


@pytest.mark.parametrize("op", [XferOp.READ, XferOp.WRITE], ids=["pull", "push"])
def test_the_selector_picks_the_split_path_and_one_post_moves_both_kinds(pair, op: XferOp) -> None:
    from kvlifecycle.transports.select import SameNodeSelector

    p, d, _ = pair
    me, peer = (d, p) if op is XferOp.READ else (p, d)
    peer.plane.fast_transport.add_peer(me.plane.fast_transport.local_metadata())  # the handshake's other half
    path = SameNodeSelector().select(me.plane.transport, me.plane.fast_transport,
                                     peer.plane.fast_transport.local_metadata())
    assert path.transport is me.plane.fast_transport and path.choice is not None
    assert path.choice.backend == "cuda_ipc+nixl", path.choice.reason
    assert path.choice.probe is not None and path.choice.probe.backend.startswith("cuda_ipc/")
    p_pages, d_pages, p_row, d_row = [3, 9, 0], [11, 2, 15], 4, 1
    mine, theirs = (([*d_pages, d.aux_block(d_row)], [*p_pages, p.aux_block(p_row)]) if op is XferOp.READ else
                    ([*p_pages, p.aux_block(p_row)], [*d_pages, d.aux_block(d_row)]))
    before_kv, before_aux = [t.clone() for t in d.kv], [a.copy() for a in d.aux]
    fast = path.transport
    note = Notification("r", "t2", 1, kind="done")
    handle = fast.post(op, fast.prepare(path.peer), mine, theirs, notification=note, transfer="t2")
    assert wait_settled(fast, handle) is XferStatus.DONE, fast.error(handle)
    stats = fast.stats(handle)
    assert stats is not None and stats.bytes == 3 * KV_REGIONS * PAGE_BYTES + AUX_REGIONS * ROW_BYTES
    backends = stats.backend.split("+")  # each kind on its own part
    assert "UCX" in backends and any(b.startswith("cuda_ipc/") for b in backends), stats.backend
    fast.release(handle)
    _check_moved(p, d, before_kv, before_aux, p_pages, d_pages, p_row, d_row)
    deadline = time.monotonic() + WAIT_S
    got: list = []
    while not got and time.monotonic() < deadline:
        got = [(sender, n) for sender, n in peer.plane.fast_transport.notifications() if n.transfer == "t2"]
        time.sleep(0.002)
    assert got == [(me.plane.fast_transport.agent, note)]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_handoff_moves_pages_through_cuda_ipc_and_the_row_through_nixl(pair, mode: str) -> None:
    from kvlifecycle.transports.select import SameNodeSelector

    from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
    from kvlifecycle.handshake import CompatInfo
    from kvlifecycle.invariants import check_source, check_target
    from kvlifecycle.ledger import SourceLedger, TargetLedger
    from kvlifecycle.machines import TargetState

    p, d, _ = pair
    compat = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=4,
                        kv_layout="NHD")
    primary_posts: list[str] = []
    for t in (p.plane.transport, d.plane.transport):
        post = t.post
        t.post = lambda *a, _post=post, **kw: primary_posts.append(kw.get("transfer", "")) or _post(*a, **kw)
    sl = SourceLedger(p.layout.num_blocks, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(d.layout.num_blocks, worker="d")
    prod = Producer(sl, p.plane.transport, compat, fast_transport=p.plane.fast_transport,
                    path_selector=SameNodeSelector())
    cons = Consumer(tl, d.plane.transport, compat, options=HandoffOptions(heartbeat_every_s=0.05, probe=False),
                    fast_transport=d.plane.fast_transport, path_selector=SameNodeSelector())
    try:
        link = cons.connect(prod.address)
        assert link.choice is not None and link.choice.backend == "cuda_ipc+nixl", link.choice
        p_pages, d_pages, p_row, d_row = [2, 4, 6], [10, 0, 5], 1, 3
        sl.allocate(mode, [*p_pages, p.aux_block(p_row)])
        sl.prefill_done(mode)
        grant = prod.grant(mode)
        tl.reserve(mode, [*d_pages, d.aux_block(d_row)])
        before_kv, before_aux = [t.clone() for t in d.kv], [a.copy() for a in d.aux]
        if mode == "pull":
            cons.pull(mode, grant, address=prod.address)
        else:
            cons.request_push(mode, grant, address=prod.address)
        assert cons.wait_idle(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while grant.transfer in sl.leases and time.monotonic() < deadline:
            time.sleep(0.002)
        assert [r.reason for r in sl.take_released()] == ["completed"]
        assert tl.requests[mode].state == TargetState.READY_FOR_ATTENTION
        _check_moved(p, d, before_kv, before_aux, p_pages, d_pages, p_row, d_row)
        assert primary_posts == []  # every byte went through the split fast path
        tl.finish(mode)
    finally:
        cons.close()
        prod.close()
    assert check_source(sl) == [] and check_target(tl) == []
