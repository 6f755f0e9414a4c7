"""The control plane a prefill of the SGLang backend serves, without SGLang (main venv: real TCP on 127.0.0.1, the
loopback transport): the shared side channel with the handshake and the stream of one "layer" over every region
(``adapters/sglang/prefill.py`` builds the same Producer + StreamProducer). Whatever a peer sends, the prefill
answers it (a reply or a refusal, never silence), counts what it refuses, and a room streamed right after still
lands byte-exact; a reservation that does not fit the room's shape is declined with the reason."""

from __future__ import annotations

import secrets
import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import StreamCancel, StreamQuery, StreamRequest
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.sidechannel import SideChannelClient, SideChannelError, SideChannelTimeout, encode_frame
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.transport import KVLayout, MemoryKind

PAGES, REGIONS, ITEM = 16, 4, 64  # K and V of two layers: one room's chunk moves all four in one post
COMPAT = CompatInfo(model_id="dummy", dtype="auto", num_layers=REGIONS, num_kv_heads=1, head_size=1, block_size=16,
                    kv_layout="NHD")
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
_encode = msgspec.msgpack.Encoder().encode


def until(fn, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False


@pytest.fixture(scope="module")
def pd():
    import torch

    suffix = f"sglang-control-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (PAGES, ITEM), dtype=torch.uint8) for _ in range(REGIONS)]
    dst = [torch.zeros((PAGES, ITEM), dtype=torch.uint8) for _ in range(REGIONS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, PAGES, tuple(x.data_ptr() for x in kv), (ITEM,) * REGIONS))
    prod = Producer(SourceLedger(PAGES, worker="p"), tp, COMPAT, options=HandoffOptions(probe=False))
    cons = Consumer(TargetLedger(PAGES, worker="d"), td, COMPAT, options=HandoffOptions(probe=False))
    cons.connect(prod.address)
    options = StreamOptions(regions_per_layer=REGIONS, stream_timeout_s=10.0)
    sp, sc = StreamProducer(prod, layers=1, options=options), StreamConsumer(cons, options=options)
    raw = SideChannelClient(prod.address, [], timeout_s=5.0)
    yield sp, sc, src, dst, raw
    raw.close()
    for part in (sc, sp, cons, prod, tp, td):
        part.close()


def _answered(raw: SideChannelClient, frame: bytes) -> bool:
    """A reply or a refusal came back (anything but silence)."""
    try:
        raw.request_raw(frame)
    except SideChannelTimeout:
        return False
    except SideChannelError:
        return True
    return True


_hostile = st.one_of(
    st.builds(StreamRequest, st.text(max_size=12), st.text(max_size=12), st.text(max_size=12),
              st.integers(0, 2**63 - 1), st.lists(st.integers(0, 2**31 - 1), max_size=6), st.integers(0, 4),
              st.binary(max_size=TOKEN_BYTES + 2), st.floats(0.001, 100.0), st.integers(0, 3)),
    st.builds(StreamCancel, st.text(max_size=12), st.text(max_size=12), st.binary(max_size=20), st.text(max_size=20)),
    st.builds(StreamQuery, st.text(max_size=12)),
)


@FUZZ
@given(data=st.data())
def test_any_frame_to_a_prefills_side_channel_is_answered_and_refusals_are_counted(pd, data: st.DataObject) -> None:
    sp, _, _, _, raw = pd
    server = sp.producer.server
    kind = data.draw(st.sampled_from(["bytes", "framed", "typed"]))
    if kind == "bytes":
        frame = data.draw(st.binary(max_size=256))
    elif kind == "framed":  # a header, then a body that is no message (or nests too deep, or is not msgpack)
        frame = encode_frame(data.draw(st.binary(max_size=64) | st.just(b"\x91" * 5000 + b"\xc0")), 7)
    else:
        frame = encode_frame(_encode(data.draw(_hostile)), 9)
    before = server.bad_messages
    assert _answered(raw, frame)  # never silence
    if kind == "bytes" and not frame.startswith(b"KV"):
        assert server.bad_messages == before + 1  # counted


def test_a_reservation_that_does_not_fit_the_room_is_declined_with_the_reason(pd) -> None:
    sp, sc, _, _, _ = pd
    sc.ledger.reserve("bad-layers", [1])
    assert sc.request_stream("bad-layers", sp.producer.address, layers=2) is None  # per layer, not per chunk
    assert "layers: D streams 2, P has 1" in sc.declines["bad-layers"]
    assert sc.ledger.requests["bad-layers"].state == TargetState.RESERVED  # nothing may have been written
    sc.ledger.cancel("bad-layers")


def test_after_the_fuzzing_a_room_still_streams_byte_exact(pd) -> None:
    sp, sc, src, dst, _ = pd
    room = f"room-{secrets.token_hex(4)}"
    sc.ledger.reserve(room, [9, 10, 11])
    assert sc.request_stream(room, sp.producer.address, layers=1)
    assert until(lambda: sp.status(room).state == "reserved")
    assert sp.begin(room)
    sp.layer_done(room, 0, [2, 3])  # first chunk
    sp.layer_done(room, 0, [2, 3, 4])  # last chunk: one more block
    assert until(lambda: sp.status(room).state == "complete") and until(lambda: sc.pending() == 0)
    for region in range(REGIONS):
        assert np.array_equal(dst[region][[9, 10, 11]].numpy(), src[region][[2, 3, 4]].numpy())
    sp.release(room, lambda: None)
    sc.ledger.finish(room)
