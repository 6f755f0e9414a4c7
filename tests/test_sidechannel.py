"""The side channel refuses bad input clearly and keeps serving everyone else."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from kvlifecycle.sidechannel import (
    MAC_BYTES,
    Ack,
    Ping,
    SideChannelClient,
    SideChannelRefused,
    SideChannelServer,
    SideChannelTimeout,
    encode_envelope,
    encode_frame,
)
from kvlifecycle.transport import WIRE_VERSION


class Echo(msgspec.Struct, frozen=True, tag=True):
    text: str


class EchoReply(msgspec.Struct, frozen=True, tag=True):
    text: str


class Boom(msgspec.Struct, frozen=True, tag=True):
    pass


def _boom(_m: Boom, _p: bytes) -> Ack:
    raise RuntimeError("handler exploded")


@pytest.fixture
def server():
    srv = SideChannelServer({Echo: lambda m, _p: EchoReply(m.text.upper()), Boom: _boom}, max_bytes=4096)
    yield srv
    srv.close()


@pytest.fixture
def secret_server():
    srv = SideChannelServer({Echo: lambda m, _p: EchoReply(m.text)}, secret=b"s3cret")
    yield srv
    srv.close()


def client(srv: SideChannelServer, **kw) -> SideChannelClient:
    return SideChannelClient(srv.address, [EchoReply], timeout_s=5.0, **kw)


def test_binds_loopback_by_default(server: SideChannelServer) -> None:
    assert server.address.startswith("tcp://127.0.0.1:")


def test_round_trip(server: SideChannelServer) -> None:
    c = client(server)
    assert c.request(Echo("hi")) == EchoReply("HI")
    assert c.request(Ping()) == Ack(True)
    c.close()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b"\xc1not msgpack", "malformed"),
        (msgspec.msgpack.encode(["x", 2, 3]), "malformed"),
        (msgspec.msgpack.encode([1, 1, b"", b""]), "version"),  # a wire version 1 envelope: told, not guessed
        (encode_frame(b"\x93\x01\x02\x03", 1), "malformed"),
        (encode_frame(msgspec.msgpack.encode({"type": "Nope"}), 1), "unknown_kind"),
        (encode_frame(b"", 1, version=WIRE_VERSION + 9), "version"),
        (encode_frame(b"\x91" * 40 + b"\xc0", 1), "malformed"),  # deeper than the cap: refused undecoded
        (b"x" * 5000, "oversized"),
    ],
)
def test_bad_frames_refused_and_others_unaffected(server: SideChannelServer, frame: bytes, code: str) -> None:
    bad, good = client(server), client(server)
    with pytest.raises(SideChannelRefused) as info:
        bad.request_raw(frame)
    assert info.value.code == code
    assert server.refused[code] == 1
    assert good.request(Echo("still here")) == EchoReply("STILL HERE")
    assert bad.request(Echo("me too")) == EchoReply("ME TOO")


def test_pickle_is_not_accepted(server: SideChannelServer) -> None:
    import pickle

    c = client(server)
    with pytest.raises(SideChannelRefused) as info:
        c.request_raw(pickle.dumps(Echo("x")))
    assert info.value.code == "malformed"


def test_handler_error_is_a_clear_refusal(server: SideChannelServer) -> None:
    c = client(server)
    with pytest.raises(SideChannelRefused) as info:
        c.request(Boom())
    assert info.value.code == "internal" and "handler exploded" in info.value.message
    assert c.request(Echo("ok")) == EchoReply("OK")


def test_hmac_required_when_configured(secret_server: SideChannelServer) -> None:
    no_key = client(secret_server)
    with pytest.raises(SideChannelRefused) as info:
        no_key.request(Echo("x"))
    assert info.value.code == "unauthenticated"
    wrong = client(secret_server, secret=b"wrong")
    with pytest.raises(SideChannelRefused):
        wrong.request(Echo("x"))
    right = client(secret_server, secret=b"s3cret")
    assert right.request(Echo("x")) == EchoReply("x")
    # a correctly signed frame with a tampered body is refused
    frame = encode_envelope(Echo("a"), secret=b"s3cret")
    tampered = encode_frame(msgspec.msgpack.encode(Echo("b")), 1) + frame[-MAC_BYTES:]
    with pytest.raises(SideChannelRefused) as info:
        right.request_raw(tampered)
    assert info.value.code == "unauthenticated"


def test_client_wait_is_bounded() -> None:
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.ROUTER)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        c = SideChannelClient(f"tcp://127.0.0.1:{port}", [EchoReply], timeout_s=0.2)
        with pytest.raises(SideChannelTimeout):
            c.request(Echo("anyone?"))
        c.close()
    finally:
        silent.close(0)
