"""The side channel refuses bad input clearly and keeps serving everyone else."""

from __future__ import annotations

import logging
import socket
import threading

import msgspec
import pytest

from kvlifecycle import sidechannel
from kvlifecycle.sidechannel import (
    LENGTH,
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
    format_address,
    hard_cap,
    open_frame,
    parse_address,
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
    """A server that accepts and never answers: the request ends at its bound."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        c = SideChannelClient(f"tcp://127.0.0.1:{silent.getsockname()[1]}", [EchoReply], timeout_s=0.2)
        with pytest.raises(SideChannelTimeout):
            c.request(Echo("anyone?"))
        c.close()
    finally:
        silent.close()


def test_nobody_listening_is_a_timeout_at_the_bound() -> None:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # free once closed
    c = SideChannelClient(f"tcp://127.0.0.1:{port}", [EchoReply], timeout_s=0.3)
    with pytest.raises(SideChannelTimeout) as info:
        c.request(Echo("x"))
    assert "not listening" in str(info.value)


def test_a_server_that_starts_within_the_bound_answers() -> None:
    """A restarted P rank comes back on its port: a request sent while it was down is answered once it listens."""
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    c = SideChannelClient(f"tcp://127.0.0.1:{port}", [EchoReply], timeout_s=10.0)
    started: list[SideChannelServer] = []
    later = threading.Timer(0.3, lambda: started.append(
        SideChannelServer({Echo: lambda m, _p: EchoReply(m.text)}, port=port)))
    later.start()
    try:
        assert c.request(Echo("late")) == EchoReply("late")
    finally:
        later.join()
        c.close()
        for srv in started:
            srv.close()


def test_a_server_restarted_between_requests_is_asked_again() -> None:
    """The connection of the first request died with its server: the next request reconnects and is answered."""
    first = SideChannelServer({Echo: lambda m, _p: EchoReply("first")})
    port = first.port
    c = SideChannelClient(first.address, [EchoReply], timeout_s=10.0)
    try:
        assert c.request(Echo("x")) == EchoReply("first")
        first.close()
        second = SideChannelServer({Echo: lambda m, _p: EchoReply("second")}, port=port)
        try:
            assert c.request(Echo("x")) == EchoReply("second")
        finally:
            second.close()
    finally:
        c.close()


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


def raw_connection(srv: SideChannelServer) -> socket.socket:
    sock = socket.create_connection((srv.host, srv.port), timeout=5.0)
    sock.settimeout(5.0)
    return sock


def read_frames(sock: socket.socket, count: int) -> list[bytes]:
    """``count`` length-prefixed frames off a raw connection (bounded by its timeout)."""
    data, frames = b"", []
    while len(frames) < count:
        chunk = sock.recv(1 << 16)
        assert chunk, f"connection closed after {len(frames)} frame(s)"
        data += chunk
        while len(data) >= LENGTH.size and len(data) >= LENGTH.size + LENGTH.unpack_from(data)[0]:
            size = LENGTH.unpack_from(data)[0]
            frames.append(data[LENGTH.size : LENGTH.size + size])
            data = data[LENGTH.size + size :]
    return frames


def test_frames_in_one_write_and_a_frame_byte_by_byte_are_all_answered(server: SideChannelServer) -> None:
    """The stream's framing, not its segments, delimits messages."""
    frames = [encode_envelope(Echo(f"m{i}"), rid=10 + i) for i in range(3)]
    with raw_connection(server) as sock:
        sock.sendall(b"".join(LENGTH.pack(len(f)) + f for f in frames[:2]))
        for byte in LENGTH.pack(len(frames[2])) + frames[2]:
            sock.sendall(bytes([byte]))
        replies = [open_frame(f, None, max_bytes=1 << 20, max_depth=32) for f in read_frames(sock, 3)]
    assert [rid for rid, _ in replies] == [10, 11, 12]
    assert [msgspec.msgpack.decode(body, type=EchoReply).text for _, body in replies] == ["M0", "M1", "M2"]


def test_a_length_past_the_hard_cap_closes_that_connection_alone(server: SideChannelServer) -> None:
    """The stream cannot be resynchronised after such a length: refused in words, then closed; others served."""
    other = client(server)
    assert other.request(Echo("before")) == EchoReply("BEFORE")
    with raw_connection(server) as sock:
        sock.sendall(LENGTH.pack(hard_cap(server.max_bytes) + 1) + b"xyz")
        [refusal] = read_frames(sock, 1)
        _, body = open_frame(refusal, None, max_bytes=1 << 20, max_depth=32)
        assert msgspec.msgpack.decode(body, type=ErrorReply).code == "oversized"
        assert sock.recv(1) == b""  # closed by the server
    assert server.refused["oversized"] == 1 and server.dropped_connections == 1
    assert other.request(Echo("after")) == EchoReply("AFTER")


def test_a_half_sent_frame_and_a_vanished_peer_leave_the_server_serving(server: SideChannelServer) -> None:
    for partial in (b"\x00", LENGTH.pack(100) + b"only part of it"):
        with raw_connection(server) as sock:
            sock.sendall(partial)
    assert client(server).request(Echo("fine")) == EchoReply("FINE")


def test_a_connection_past_the_limit_evicts_the_longest_silent_and_everyone_is_served() -> None:
    srv = SideChannelServer({Echo: lambda m, _p: EchoReply(m.text.upper())},
                            limits=sidechannel.ConnectionLimits(max_connections=2))
    try:
        first, second = client(srv), client(srv)
        assert first.request(Echo("a")) == EchoReply("A") and second.request(Echo("b")) == EchoReply("B")
        with raw_connection(srv) as third:
            third.sendall(LENGTH.pack(len(ping := encode_envelope(Ping()))) + ping)
            assert len(read_frames(third, 1)) == 1  # admitted: first's connection, the longest silent, made room
        assert srv.evicted_idle == 1 and srv.dropped_connections == 1 and srv.most_connections == 2
        assert first.request(Echo("c")) == EchoReply("C")  # connected again, unseen by the caller
    finally:
        srv.close()


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
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(5.0)
    c = SideChannelClient(f"tcp://127.0.0.1:{listener.getsockname()[1]}", [EchoReply], timeout_s=5.0)
    # framed answers carry request id 0, which a client takes as meant for whatever it asked (a refusal of a frame
    # whose id could not be read); an answer for another id is a late reply, skipped until the timeout
    framed = [deep(20_000), encode_frame(deep(20_000), 0), encode_frame(b"\xc1", 0), b"",
              encode_frame(msgspec.msgpack.encode({"type": "EchoReply", "text": 5}), 0)]
    answers = [LENGTH.pack(len(f)) + f for f in framed]
    answers += [LENGTH.pack(2**32 - 1) + b"x", b"\x00\x00"]  # a length past any cap; a stream that ends mid-length
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
            peer, _ = listener.accept()
            with peer:
                peer.settimeout(5.0)
                peer.recv(1 << 16)
                peer.sendall(answer)
            t.join(10)  # the peer closed: a stream that ended mid-frame is judged, not waited out
            assert len(done) == 1 and isinstance(done[0], SideChannelError), done
            assert not isinstance(done[0], SideChannelTimeout), done  # answered, and the answer judged
    finally:
        c.close()
        listener.close()


@pytest.mark.parametrize("address", ["127.0.0.1:80", "tcp://127.0.0.1", "tcp://:80", "tcp://h:0", "tcp://h:99999",
                                     "tcp://h:8x", "ipc:///tmp/x", ""])
def test_an_address_that_is_not_tcp_host_port_is_refused_in_words(address: str) -> None:
    with pytest.raises(SideChannelError, match="is not tcp://HOST:PORT") as info:
        SideChannelClient(address, [EchoReply])
    assert isinstance(info.value, ValueError)  # configuration reads it as the bad value it is


def test_addresses_round_trip() -> None:
    assert parse_address(format_address("::1", 5)) == ("::1", 5)
    assert parse_address("tcp://10.0.0.7:5557") == ("10.0.0.7", 5557)
