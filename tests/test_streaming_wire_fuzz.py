"""Fuzz a stream's wire: the per-layer note's payload (``decode_batch``) and the stream messages as P's side channel
decodes them (heartbeats included). Any bytes in give a value inside its bounds (positions, a finite positive write
window, a bounded list of bounded tokens) or one typed refusal, never an exception of another kind; what was
accepted survives its own round trip."""

from __future__ import annotations

import math

import msgspec
from fuzz_msgpack import FUZZ, hostile, tagged
from hypothesis import given
from hypothesis import strategies as st

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamQuery, StreamRequest
from kvlifecycle.sidechannel import FrameError, _decode_body
from kvlifecycle.streaming.wire import MAX_HEARTBEAT_STREAMS, LayerBatch, StreamHeartbeat, decode_batch, encode_batch

TOKEN = b"\x07" * TOKEN_BYTES
BATCHES = [encode_batch(TOKEN, LayerBatch(0, 1, 0, 4)), encode_batch(TOKEN, LayerBatch(31, 1, 2**20, 2**20 + 1))]
ASK = StreamRequest("r", "stream:r:1", "d", 3, [1, 2, 3], 32, TOKEN, 48.0, 0)
STREAM_FIELDS = ["request", "transfer", "agent", "epoch", "blocks", "layers", "token", "write_window_s", "part",
                 "reason", "tokens"]
WINDOWS = [0.0, -1.0, 1e-300, 86400.0, 86400.0001, math.inf, -math.inf, math.nan, True, 48, "48", None]
VALID = [msgspec.msgpack.encode(ASK), msgspec.msgpack.encode(StreamCancel("r", "stream:r:1", TOKEN, "why")),
         msgspec.msgpack.encode(StreamHeartbeat("d", 3, [TOKEN, b"\x01" * TOKEN_BYTES]))]
STREAM_TYPES = StreamRequest | StreamCancel | StreamQuery | StreamHeartbeat
STREAM_DECODER = msgspec.msgpack.Decoder(STREAM_TYPES)

batch_bytes = st.one_of(
    hostile(BATCHES, st.lists(st.integers(-(2**63), 2**64 - 1), max_size=6).map(msgspec.msgpack.encode)),
    st.builds(lambda token, rest: token + rest, st.binary(max_size=TOKEN_BYTES + 2), st.binary(max_size=40)),
)


@FUZZ
@given(payload=batch_bytes)
def test_decode_batch_is_total(payload: bytes) -> None:
    try:
        token, batch = decode_batch(payload)
    except ValueError:
        return
    assert token == payload[:TOKEN_BYTES]
    assert all(0 <= v < 2**31 for v in (batch.first_layer, batch.num_layers, batch.lo, batch.hi))
    assert decode_batch(encode_batch(token, batch))[1] == batch


@FUZZ
@given(raw=hostile(VALID, tagged(["StreamRequest", "StreamCancel", "StreamQuery", "StreamHeartbeat"], STREAM_FIELDS,
                                 known=[*WINDOWS, TOKEN, [1, 2], [TOKEN], [TOKEN, b"x" * 65], [2**63]])))
def test_stream_messages_decode_totally(raw: bytes) -> None:
    try:
        msg = _decode_body(STREAM_DECODER, raw)
    except FrameError:
        return
    assert isinstance(msg, STREAM_TYPES)
    if isinstance(msg, StreamHeartbeat):
        assert 0 <= msg.epoch < 2**63 and len(msg.tokens) <= MAX_HEARTBEAT_STREAMS
        assert all(isinstance(t, bytes) and len(t) <= 64 for t in msg.tokens)
    if isinstance(msg, StreamRequest):
        assert isinstance(msg.write_window_s, float) and math.isfinite(msg.write_window_s)
        assert 0 < msg.write_window_s <= 86400.0
    assert STREAM_DECODER.decode(msgspec.msgpack.encode(msg)) == msg


@given(window=st.sampled_from(WINDOWS) | st.floats(allow_nan=True, allow_infinity=True))
def test_a_stream_request_without_a_valid_window_is_refused(window: object) -> None:
    fields = msgspec.structs.asdict(ASK)
    body = msgspec.msgpack.encode({**fields, "type": "StreamRequest", "write_window_s": window})
    missing = msgspec.msgpack.encode({k: v for k, v in {**fields, "type": "StreamRequest"}.items()
                                      if k != "write_window_s"})
    try:
        msg = _decode_body(STREAM_DECODER, body)
    except FrameError:
        msg = None
    valid = isinstance(window, int | float) and not isinstance(window, bool) and 0 < window <= 86400.0
    assert (msg is not None) == valid
    try:
        _decode_body(STREAM_DECODER, missing)
        raise AssertionError("a stream request without a write window decoded")
    except FrameError as exc:
        assert "write_window_s" in str(exc)


@given(tokens=st.lists(st.binary(max_size=70), max_size=4) | st.just([TOKEN] * (MAX_HEARTBEAT_STREAMS + 1)))
def test_a_heartbeat_with_too_many_or_too_long_tokens_is_refused(tokens: list[bytes]) -> None:
    body = msgspec.msgpack.encode({"type": "StreamHeartbeat", "agent": "d", "epoch": 1, "tokens": tokens})
    valid = len(tokens) <= MAX_HEARTBEAT_STREAMS and all(len(t) <= 64 for t in tokens)
    try:
        msg = _decode_body(STREAM_DECODER, body)
    except FrameError as exc:
        assert not valid and exc.code == "malformed"
        return
    assert valid and isinstance(msg, StreamHeartbeat) and msg.tokens == tokens
