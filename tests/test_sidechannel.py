"""The side channel refuses bad input clearly and keeps serving everyone else."""

from __future__ import annotations

import logging
import threading

import msgspec
import pytest
import zmq

from kvlifecycle.sidechannel import (
    MAC_BYTES,
    Ack,
    ErrorReply,
    Ping,
    SideChannelClient,
    SideChannelError,
    SideChannelRefused,
    SideChannelServer,
    SideChannelTimeout,
    encode_envelope,
    encode_frame,
    open_frame,
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


def deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\xc0"  # [[[...[nil]...]]]


def test_twenty_thousand_levels_deep_does_not_stop_the_server() -> None:
    """msgspec raises RecursionError on such a value; the depth is refused before decoding, the server lives."""
    srv = SideChannelServer({Echo: lambda m, _p: EchoReply(m.text)})
    try:
        c = client(srv)
        hidden = b"\x82\xa4type\xa4Echo\xa1x" + deep(20_000)  # an unknown field msgspec would skip recursively
        for frame in (encode_frame(hidden, 7), deep(20_000)):  # inside a frame, and as the raw frame
            with pytest.raises(SideChannelRefused) as info:
                c.request_raw(frame)
            assert info.value.code == "malformed"
        assert srv.refused == {"malformed": 2} and srv.bad_messages == 2
        assert c.request(Echo("alive")) == EchoReply("alive")
    finally:
        srv.close()


def test_hmac_is_checked_before_anything_is_parsed(secret_server: SideChannelServer) -> None:
    """An unsigned frame whose body would be refused as malformed is refused as unauthenticated: not parsed."""
    c = client(secret_server)
    for unsigned in (encode_frame(deep(20_000), 1), deep(20_000), b"KV", encode_envelope(Echo("x"))):
        with pytest.raises(SideChannelRefused) as info:
            c.request_raw(unsigned)
        assert info.value.code == "unauthenticated"
    assert secret_server.refused == {"unauthenticated": 4}
    assert client(secret_server, secret=b"s3cret").request(Echo("x")) == EchoReply("x")


def test_a_reply_that_does_not_encode_is_an_internal_refusal() -> None:
    srv = SideChannelServer({Echo: lambda _m, _p: object()})  # a handler bug
    try:
        c = client(srv)
        with pytest.raises(SideChannelRefused) as info:
            c.request(Echo("x"))
        assert info.value.code == "internal"
        assert c.request(Ping()) == Ack(True)
    finally:
        srv.close()


def test_a_req_socket_gets_its_reply(server: SideChannelServer) -> None:
    """REQ prefixes an empty delimiter frame and drops a reply without it."""
    req = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.address)
    try:
        req.send(encode_envelope(Echo("req"), rid=42))
        assert req.poll(5000, zmq.POLLIN)
        rid, body = open_frame(req.recv(), None, max_bytes=1 << 20, max_depth=32)
        assert rid == 42 and msgspec.msgpack.decode(body, type=EchoReply) == EchoReply("REQ")
    finally:
        req.close(0)


def test_extra_frames_are_refused_with_a_reply(server: SideChannelServer) -> None:
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(server.address)
    try:
        dealer.send_multipart([b"one", b"two", encode_envelope(Echo("x"))])
        assert dealer.poll(5000, zmq.POLLIN)
        _, body = open_frame(dealer.recv(), None, max_bytes=1 << 20, max_depth=32)
        assert msgspec.msgpack.decode(body, type=ErrorReply).code == "malformed"
    finally:
        dealer.close(0)
    assert client(server).request(Echo("fine")) == EchoReply("FINE")


def test_ten_thousand_junk_frames_are_counted_not_logged_one_by_one(
    server: SideChannelServer, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[str] = []
    server.add_refusal_listener(seen.append)
    with caplog.at_level(logging.WARNING, logger="kvlifecycle.sidechannel"):
        for i in range(10_000):
            _, reply = server.handle_frame(b"junk %d" % i, b"peer")
            assert isinstance(reply, ErrorReply)
    assert server.refused["malformed"] == 10_000 and len(seen) == 10_000
    lines = [r for r in caplog.records if r.name == "kvlifecycle.sidechannel"]
    assert 1 <= len(lines) <= 10  # a burst, then one line per window that says how many were held back


def test_client_survives_a_hostile_server() -> None:
    """Whatever a server answers, a request returns a reply or raises a SideChannelError."""
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    c = SideChannelClient(f"tcp://127.0.0.1:{port}", [EchoReply], timeout_s=5.0)
    # framed answers carry request id 0, which a client takes as meant for whatever it asked (a refusal of a frame
    # whose id could not be read); an answer for another id is a late reply, skipped until the timeout
    answers = [deep(20_000), encode_frame(deep(20_000), 0), encode_frame(b"\xc1", 0), b"",
               encode_frame(msgspec.msgpack.encode({"type": "EchoReply", "text": 5}), 0)]
    try:
        for answer in answers:
            done: list[BaseException] = []

            def ask(done: list[BaseException] = done) -> None:
                try:
                    c.request(Echo("q"))
                except BaseException as exc:
                    done.append(exc)

            t = threading.Thread(target=ask)
            t.start()
            assert router.poll(5000, zmq.POLLIN)
            peer, _ = router.recv_multipart()
            router.send_multipart([peer, answer])
            t.join(10)
            assert len(done) == 1 and isinstance(done[0], SideChannelError), done
            assert not isinstance(done[0], SideChannelTimeout), done  # answered, and the answer judged
    finally:
        c.close()
        router.close(0)
