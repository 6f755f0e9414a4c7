"""The SGLang backend's control messages and data plane, without SGLang (main venv: msgspec, nixl)."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvlifecycle.adapters.sglang import wire

MESSAGE_TYPES = (wire.Register, wire.RoomMeta, wire.Claim, wire.Heartbeat, wire.Status, wire.AbortAck, wire.Refused,
                 wire.GiveUp)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# msgpack-shaped values, nested and of every kind a peer could send, some tagged as our messages
_leaves = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=20) \
    | st.binary(max_size=40) | st.sampled_from(["reg", "meta", "claim", "hb", "status", "ack", "refused", "giveup"])
_values = st.recursive(_leaves, lambda inner: st.lists(inner, max_size=6)
                       | st.dictionaries(st.sampled_from(["type", "room", "agent", "epoch", "rooms", "reason"])
                                         | st.text(max_size=8), inner, max_size=6), max_leaves=30)


def _decode_is_total(frames: list[bytes]) -> None:
    """Either a typed message or MalformedMessage: any other exception fails the test."""
    try:
        msg = wire.decode(frames)
    except wire.MalformedMessage:
        return
    assert isinstance(msg, MESSAGE_TYPES)


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


@FUZZ
@given(body=st.binary(max_size=512))
def test_any_body_decodes_to_a_message_or_is_refused(body: bytes) -> None:
    _decode_is_total([wire.TAG, body])


@FUZZ
@given(frames=st.lists(st.binary(max_size=64) | st.just(wire.TAG), max_size=4))
def test_any_frames_decode_to_a_message_or_are_refused(frames: list[bytes]) -> None:
    _decode_is_total(frames)


@FUZZ
@given(value=_values)
def test_any_msgpack_value_decodes_to_a_message_or_is_refused(value: object) -> None:
    _decode_is_total([wire.TAG, msgspec.msgpack.encode(value)])


@FUZZ
@given(data=st.data())
def test_a_corrupted_message_decodes_to_a_message_or_is_refused(data: st.DataObject) -> None:
    hb = wire.Heartbeat("d0", 3, "decode", "127.0.0.1", 5000, rooms=list(range(6)), hlc=9)
    body = bytearray(wire.encode(hb)[1])
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    _decode_is_total([wire.TAG, bytes(body[:cut])])


@pytest.mark.parametrize("opener", [b"\x91", b"\x81\xa1k"])  # fixarray of one; fixmap {"k": ...}
def test_deep_nesting_is_refused_before_the_decoder_sees_it(opener: bytes) -> None:
    """msgspec recurses without a limit (RecursionError, or a C stack overflow): the pre-scan refuses first."""
    body = opener * 200_000 + b"\xc0"
    with pytest.raises(wire.MalformedMessage, match="deeper than"):
        wire.decode([wire.TAG, body])


def test_nesting_at_the_bound_reaches_the_decoder() -> None:
    """A value exactly MAX_DEPTH deep passes the pre-scan and is judged (and refused) by the typed decoder."""
    body = b"\x91" * wire.MAX_DEPTH + b"\xc0"
    with pytest.raises(wire.MalformedMessage, match="undecodable"):
        wire.decode([wire.TAG, body])


def test_non_bytes_body_is_refused() -> None:
    with pytest.raises(wire.MalformedMessage, match="bytes"):
        wire.decode([wire.TAG, "not bytes"])  # type: ignore[list-item]
