"""SGLang's data plane on a GPU, worker-side (SGLang itself does not run here): KV pages in VRAM, aux rows in host
memory, one layout whose groups name their kinds (``adapters/sglang/transfer.layouts``). NIXL registers each kind,
and one post over pages and an aux row moves each group in its own transfer; the bytes land on both kinds, and a
push's notification reaches D only once both parts are DONE. CUDA IPC is not offered: it cannot map the host
rows (one log line says so).

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


def test_the_layout_names_vram_pages_and_host_rows_and_cuda_ipc_is_not_offered(pair) -> None:
    p, _d, logged = pair
    assert p.layout.group_kinds == (MemoryKind.VRAM, MemoryKind.DRAM)
    assert p.plane.fast_transport is None
    assert "region group 1 is in host memory" in logged


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
    torch.cuda.synchronize()
    for r in range(KV_REGIONS):  # the pages, in VRAM, and nothing else
        assert torch.equal(d.kv[r][d_pages], p.kv[r][p_pages])
        others = [i for i in range(PAGES) if i not in d_pages]
        assert torch.equal(d.kv[r][others], before_kv[r][others])
    for r in range(AUX_REGIONS):  # the aux row, in host memory, and nothing else
        assert np.array_equal(d.aux[r][d_row], p.aux[r][p_row])
        others = [i for i in range(ROWS) if i != d_row]
        assert np.array_equal(d.aux[r][others], before_aux[r][others])
    # the peer hears of it (sent once both parts were DONE)
    deadline = time.monotonic() + WAIT_S
    got: list = []
    while not got and time.monotonic() < deadline:
        got = [n for _, n in peer.plane.transport.notifications() if n.transfer == "t1"]
        time.sleep(0.002)
    assert [n.kind for n in got] == ["done"]
