"""The SGLang backend's control messages and data plane, without SGLang (main venv: msgspec, nixl)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from kvlifecycle.adapters.sglang import wire


def test_messages_round_trip() -> None:
    meta = wire.RoomMeta(7, "d0", 3, "room-7", np.arange(4, dtype=np.int32).tobytes(), 2, 1)
    assert wire.decode(wire.encode(meta)) == meta
    hb = wire.Heartbeat("d0", 3, "decode", rooms=[7, 8])
    assert wire.decode(wire.encode(hb)) == hb


@pytest.mark.parametrize("frames", [[b"KVL1"], [b"KVL1", b"\x00garbage"], [b"OTHER", b"x"], [b"KVL1", b"a", b"b"]])
def test_malformed_frames_are_refused_with_a_reason(frames: list[bytes]) -> None:
    with pytest.raises(wire.MalformedMessage):
        wire.decode(frames)


def test_oversized_message_is_refused() -> None:
    big = wire.RoomMeta(7, "d0", 3, "room-7", b"\x00" * (wire.MAX_BODY_BYTES + 1), 2, 1)
    with pytest.raises(ValueError, match="cap"):
        wire.encode(big)


@pytest.mark.nixl
def test_plane_pushes_pages_and_an_aux_row_byte_exact() -> None:
    pytest.importorskip("nixl._api")
    from kvlifecycle.adapters.sglang.plane import NixlPlane, PlaneError, Regions

    pages, layers, item = 32, 4, 2048
    rng = np.random.default_rng(0)
    src = [rng.integers(0, 256, (pages, item), dtype=np.uint8) for _ in range(layers)]
    dst = [np.full((pages, item), 0xA5, np.uint8) for _ in range(layers)]
    src_aux = [rng.integers(0, 256, (8, 64), dtype=np.uint8), rng.integers(0, 256, (8, 16), dtype=np.uint8)]
    dst_aux = [np.full((8, 64), 0xA5, np.uint8), np.full((8, 16), 0xA5, np.uint8)]

    def regions(bufs: list[np.ndarray]) -> Regions:
        return Regions(tuple(b.ctypes.data for b in bufs), tuple(b.shape[1] for b in bufs),
                       tuple(b.shape[0] for b in bufs))

    a = NixlPlane("kvl-test-a", regions(src), regions(src_aux))
    b = NixlPlane("kvl-test-b", regions(dst), regions(dst_aux))
    stop = threading.Event()

    def pump() -> None:  # the target's side of UCX wire-up (no progress thread)
        while not stop.is_set():
            b.agent.get_new_notifs()
            time.sleep(0.001)

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        peer = a.add_peer(b.metadata(), regions(dst), regions(dst_aux))
        nbytes, descs, _, _ = a.write(peer, np.array([3, 9, 30]), np.array([0, 1, 31]), 5, 2, timeout_s=30)
        assert nbytes == 3 * layers * item + 64 + 16 and descs == 3 * layers + 2
        for r in range(layers):
            assert np.array_equal(dst[r][[0, 1, 31]], src[r][[3, 9, 30]])
            assert (np.delete(dst[r], [0, 1, 31], axis=0) == 0xA5).all()
        for s, d in zip(src_aux, dst_aux, strict=True):
            assert np.array_equal(d[2], s[5]) and (np.delete(d, 2, axis=0) == 0xA5).all()
        with pytest.raises(PlaneError, match="out of range"):
            a.write(peer, np.array([pages]), np.array([0]))
        with pytest.raises(PlaneError, match="unknown peer"):
            a.write("nobody", np.array([1]), np.array([1]))
        with pytest.raises(PlaneError, match="layout mismatch"):
            a.add_peer(b.metadata(), regions(dst[:2]), regions(dst_aux))
    finally:
        stop.set()
        t.join(timeout=5)
        a.close()
        b.close()
