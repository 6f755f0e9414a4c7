"""The SGLang backend's data plane without SGLang (main venv: real NIXL on DRAM, UCX over loopback): its transport
over KV pages and aux rows (two region groups of one layout), moved by the handoff's stream exactly as the backend
drives it: one "layer" over every region, one post per prefill chunk, the room's aux row the reservation's last
block, carried by the last chunk's post."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytestmark = pytest.mark.nixl

PAGES, LAYERS, ITEM, AUX_ROWS = 32, 4, 2048, 8
COMPAT_FIELDS = dict(model_id="dummy", dtype="auto", num_layers=LAYERS, num_kv_heads=1, head_size=1, block_size=16,
                     kv_layout="NHD")


def _buffers(fill: int | None, rng: np.random.Generator, item: int = ITEM) -> tuple[list[np.ndarray], list[np.ndarray]]:
    def make(shape: tuple[int, int]) -> np.ndarray:
        return rng.integers(0, 256, shape, dtype=np.uint8) if fill is None else np.full(shape, fill, np.uint8)

    return [make((PAGES, item)) for _ in range(LAYERS)], [make((AUX_ROWS, 64)), make((AUX_ROWS, 16))]


def _plane(name: str, kv: list[np.ndarray], aux: list[np.ndarray]):
    from kvlifecycle.adapters.sglang.transfer import DataPlane, layouts

    def triples(bufs: list[np.ndarray]) -> tuple[list[int], list[int], list[int]]:
        return [b.ctypes.data for b in bufs], [b.nbytes for b in bufs], [b.shape[1] for b in bufs]

    return DataPlane(name, time.time_ns() // 1000, layouts(*triples(kv), *triples(aux)))


def until(fn, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False


class _Pair:
    """A prefill and a decode side as the backend builds them: Producer + StreamProducer, Consumer + StreamConsumer."""

    def __init__(self, p_plane, d_plane) -> None:
        from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
        from kvlifecycle.handshake import CompatInfo
        from kvlifecycle.ledger import SourceLedger, TargetLedger
        from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer

        compat = CompatInfo(**COMPAT_FIELDS)
        self.planes = (p_plane, d_plane)
        options = StreamOptions(regions_per_layer=p_plane.layout.num_regions, stream_timeout_s=30.0)
        self.prod = Producer(SourceLedger(p_plane.layout.num_blocks, worker="p"), p_plane.transport, compat,
                             options=HandoffOptions(probe=False))
        self.cons = Consumer(TargetLedger(d_plane.layout.num_blocks, worker="d"), d_plane.transport, compat,
                             options=HandoffOptions(probe=False))
        self.sp = StreamProducer(self.prod, layers=1, options=options)
        self.sc = StreamConsumer(self.cons, options=options)

    def close(self) -> None:
        for part in (self.sc, self.sp, self.cons, self.prod, *self.planes):
            part.close()


def test_a_room_streams_its_pages_per_chunk_and_its_aux_row_with_the_last_byte_exact() -> None:
    pytest.importorskip("nixl._api")
    rng = np.random.default_rng(0)
    src, src_aux = _buffers(None, rng)
    dst, dst_aux = _buffers(0xA5, rng)
    p_plane, d_plane = _plane("kvl-test-p", src, src_aux), _plane("kvl-test-d", dst, dst_aux)
    pair = _Pair(p_plane, d_plane)
    try:
        assert p_plane.aux_start == d_plane.aux_start == PAGES and d_plane.aux_rows == AUX_ROWS
        pair.cons.connect(pair.prod.address)
        src_pages, dst_pages, src_row, dst_row = [3, 9, 30], [0, 1, 31], 5, 2
        pair.sc.ledger.reserve("7", [*dst_pages, PAGES + dst_row])  # the pages, then the aux row
        assert pair.sc.request_stream("7", pair.prod.address, layers=1)
        assert pair.sp.status("7").state == "reserved"  # SGLang's WaitingForInput
        assert pair.sp.begin("7")
        pair.sp.layer_done("7", 0, src_pages[:2])  # the first chunk
        pair.sp.layer_done("7", 0, [*src_pages, PAGES + src_row])  # the last: one more page and the aux row
        assert until(lambda: pair.sp.status("7").state == "complete") and until(lambda: pair.sc.pending() == 0)
        assert pair.sp.counts["layers_posted"] == 2 and pair.sc.counts["completed"] == 1
        for r in range(LAYERS):
            assert np.array_equal(dst[r][dst_pages], src[r][src_pages])
            assert (np.delete(dst[r], dst_pages, axis=0) == 0xA5).all()
        for s, d in zip(src_aux, dst_aux, strict=True):
            assert np.array_equal(d[dst_row], s[src_row]) and (np.delete(d, dst_row, axis=0) == 0xA5).all()
        pair.sp.release("7", lambda: None)
        pair.sc.ledger.finish("7")
    finally:
        pair.close()


def test_a_decode_of_another_kv_layout_is_refused_at_the_handshake_with_the_transports_words() -> None:
    pytest.importorskip("nixl._api")
    from kvlifecycle.handoff import SideChannelError
    from kvlifecycle.transport import TransportError

    rng = np.random.default_rng(1)
    pair = _Pair(_plane("kvl-test-c", *_buffers(None, rng)), _plane("kvl-test-e", *_buffers(0, rng, ITEM // 2)))
    try:
        try:
            pair.cons.connect(pair.prod.address)
        except (TransportError, SideChannelError) as exc:  # D's own read plan refused the pairing
            assert str(exc)
            return
        pair.sc.ledger.reserve("8", [0, PAGES])
        assert pair.sc.request_stream("8", pair.prod.address, layers=1) is None  # nothing may be written
        assert pair.sc.declines["8"].startswith("push unavailable")
    finally:
        pair.close()


def test_a_dram_plane_offers_no_fast_path_and_a_vram_layout_is_on_the_engines_gpu() -> None:
    from kvlifecycle.adapters.sglang.transfer import layouts

    from kvlifecycle.transport import MemoryKind

    rng = np.random.default_rng(3)
    kv, aux = _buffers(None, rng)
    plane = _plane(f"sg-fast-{time.monotonic_ns()}", kv, aux)
    try:
        assert plane.layout.kind is MemoryKind.DRAM and plane.fast_transport is None  # NIXL alone
    finally:
        plane.close()
    vram = layouts([0x10000], [PAGES * ITEM], [ITEM], [0x90000], [AUX_ROWS * 64], [64], kind=MemoryKind.VRAM,
                   device_id=3)
    assert vram.kind is MemoryKind.VRAM and vram.device_id == 3 and len(vram.region_groups) == 2
