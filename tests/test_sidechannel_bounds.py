"""The side channel bounds what one peer can hold, before any authentication: a legitimate client is served within a
second under 1,100 connections that never send a byte, 50 senders dribbling a byte at a time, and a client that
never reads its replies, with and without a secret. Real TCP on 127.0.0.1 (other 127/8 addresses stand for other
hosts); small deadlines through ConnectionLimits, never sleeps of seconds."""

from __future__ import annotations

import contextlib
import logging
import resource
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest

from kvlifecycle.sidechannel import (
    LENGTH,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    ConnectionLimits,
    Ping,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    encode_envelope,
)

SECRETS = [pytest.param(None, id="no-secret"), pytest.param(b"s3cret", id="secret")]
LIVENESS_S = 1.0  # a legitimate request's bound under every flood: served within a second


class Echo(msgspec.Struct, frozen=True, tag=True):
    text: str


class EchoReply(msgspec.Struct, frozen=True, tag=True):
    text: str


def echo_server(secret: bytes | None, limits: ConnectionLimits) -> SideChannelServer:
    return SideChannelServer({Echo: lambda m, _p: EchoReply(m.text)}, secret=secret, limits=limits)


def framed(message: msgspec.Struct, secret: bytes | None) -> bytes:
    frame = encode_envelope(message, secret=secret)
    return LENGTH.pack(len(frame)) + frame


def wait_until(condition: Callable[[], bool], bound_s: float = 10.0) -> bool:
    """Poll ``condition`` until it holds or ``bound_s`` passed (a liveness bound); returns whether it held."""
    end = time.monotonic() + bound_s
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def served(srv: SideChannelServer, secret: bytes | None, text: str, client: SideChannelClient | None = None) -> None:
    """A legitimate request is answered within LIVENESS_S (its own client unless one is given)."""
    own = client is None
    c = client or SideChannelClient(srv.address, [EchoReply], secret=secret, timeout_s=LIVENESS_S)
    try:
        reply = c.request(Echo(text), timeout_s=LIVENESS_S)
    except SideChannelError as exc:
        raise AssertionError(f"legitimate client not served: {exc}") from exc
    finally:
        if own:
            c.close()
    assert reply == EchoReply(text)


def connect_from(srv: SideChannelServer, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((source, 0))
    sock.settimeout(5.0)
    sock.connect((srv.host, srv.port))
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (an end of stream or a reset waits to be read); never blocks."""
    if sock.fileno() < 0:
        return True
    poller = select.poll()  # not select.select: the flood's descriptor numbers pass FD_SETSIZE
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return False
    try:  # readable now, so this returns at once (the socket's own timeout never applies)
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def stream_ends(sock: socket.socket, bound_s: float = 5.0) -> bool:
    """Read ``sock`` to its end (what the server sent before closing it is skipped); False if it stays open."""
    sock.settimeout(bound_s)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:  # a reset is an end too
        pass
    return True


@pytest.fixture(autouse=True)
def enough_descriptors() -> Iterator[None]:
    """The flood holds both ends of ~1,100 connections in this process: raise RLIMIT_NOFILE (root may raise the hard
    limit as well); skip only where it cannot be raised."""
    need = 4096
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        yield
        return
    try:
        new_hard = hard if hard == resource.RLIM_INFINITY or hard >= need else need
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, new_hard))
    except (ValueError, OSError) as exc:
        pytest.skip(f"RLIMIT_NOFILE {soft}/{hard} cannot be raised to {need}: {exc}")
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))


# -- (a) 1,100 connections that never send a byte -------------------------------------------------------------------
FLOOD = 1100


def idle_flood_scenario(secret: bytes | None) -> None:
    """1,100 silent connections past the 1,024-connection bound. The deadline is set far off, so only eviction at
    the bound can admit a newcomer."""
    # the global bound: the per-address one set past it
    limits = ConnectionLimits(max_connections_per_address=2 * MAX_CONNECTIONS, frame_deadline_s=600.0)
    srv = echo_server(secret, limits)
    codes: list[str] = []
    srv.add_refusal_listener(codes.append)
    early, newcomer = (SideChannelClient(srv.address, [EchoReply], secret=secret, timeout_s=LIVENESS_S)
                       for _ in range(2))
    flood: list[socket.socket] = []
    try:
        served(srv, secret, "before", early)
        for i in range(FLOOD):
            flood.append(connect_from(srv))
            if i % 100 == 99:  # let the server take them off its backlog (128): no connect waits out a SYN retry
                assert wait_until(lambda n=i + 2: srv.accepted >= n)
        assert wait_until(lambda: srv.accepted >= FLOOD + 1)
        served(srv, secret, "newcomer", newcomer)  # a new connection, made at the bound (kept open)
        served(srv, secret, "again", early)  # early's own connection was the longest silent: evicted, made again
        # what must hold: never above the bound; each admission evicted the longest-silent connection, so early's
        # first connection and then the oldest of the flood, in order, and nothing else
        assert srv.most_connections == MAX_CONNECTIONS and srv.connection_count == MAX_CONNECTIONS
        evicted = srv.accepted - MAX_CONNECTIONS
        assert srv.evicted_idle == evicted == FLOOD + 3 - MAX_CONNECTIONS
        assert srv.dropped_connections == evicted and srv.dropped["refused_new"] == 0
        assert codes.count("evicted_idle") == evicted
        assert wait_until(lambda: sum(map(closed_by_peer, flood)) >= evicted - 1)
        assert [i for i, sock in enumerate(flood) if closed_by_peer(sock)] == list(range(evicted - 1))
    finally:
        early.close()
        newcomer.close()
        for sock in flood:
            sock.close()
        srv.close()


@pytest.mark.parametrize("secret", SECRETS)
def test_a_client_is_served_under_1100_idle_connections(secret: bytes | None) -> None:
    idle_flood_scenario(secret)


@pytest.mark.mutants
def test_mutant_refusing_the_newcomer_locks_clients_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without eviction the server falls back on refusing a newcomer at the bound: the flood locks a client out."""
    monkeypatch.setattr(SideChannelServer, "_make_room", lambda self, address: None)
    with pytest.raises(AssertionError, match="legitimate client not served"):
        idle_flood_scenario(None)


def test_one_address_cannot_take_every_slot(caplog: pytest.LogCaptureFixture) -> None:
    """At the per-address bound the same address's longest-silent connection goes; other hosts keep theirs (another
    127/8 address stands for another host). Refusing the newcomer instead would let one host's flood lock out that
    host's legitimate clients, and on one node every process is 127.0.0.1."""
    srv = echo_server(None, ConnectionLimits(max_connections=40, max_connections_per_address=10,
                                             frame_deadline_s=600.0))
    codes: list[str] = []
    srv.add_refusal_listener(codes.append)
    other_host: list[socket.socket] = []
    flood: list[socket.socket] = []
    try:
        with caplog.at_level(logging.WARNING, logger="kvlifecycle.sidechannel"):
            other_host = [connect_from(srv, "127.0.0.3") for _ in range(5)]
            assert wait_until(lambda: srv.accepted >= 5)
            flood = [connect_from(srv, "127.0.0.2") for _ in range(30)]
            assert wait_until(lambda: srv.accepted >= 35)
            served(srv, None, "from a third address")
        assert srv.evicted_address == 20 and srv.evicted_idle == 0 and srv.most_connections == 16
        assert wait_until(lambda: sum(map(closed_by_peer, flood)) >= 20)
        assert [i for i, sock in enumerate(flood) if closed_by_peer(sock)] == list(range(20))
        assert not any(map(closed_by_peer, other_host))
        assert codes.count("evicted_address") == 20
        lines = [r for r in caplog.records if "evicted_address" in r.getMessage()]
        assert 1 <= len(lines) <= 6  # a burst, then held back and counted
    finally:
        for sock in other_host + flood:
            sock.close()
        srv.close()


# -- (b) 50 senders dribbling a byte at a time ----------------------------------------------------------------------
SLOW = 50
DEADLINE_S = 0.3


def slow_senders_scenario(secret: bytes | None) -> None:
    """50 connections each sending a legitimate frame one byte per sweep (it would take them seconds): each is
    closed at the deadline, counted from its accept, however many bytes it sent; a client is served meanwhile."""
    srv = echo_server(secret, ConnectionLimits(frame_deadline_s=DEADLINE_S))
    frame = framed(Echo("x" * 400), secret)
    started: list[float] = []
    slow: list[socket.socket] = []
    closed_at: dict[int, float] = {}
    stop = threading.Event()

    def dribble() -> None:
        end = time.monotonic() + DEADLINE_S + 3.0
        sent = 0
        while len(closed_at) < SLOW and time.monotonic() < end and not stop.is_set():
            for i, sock in enumerate(slow):
                if i in closed_at:
                    continue
                if closed_by_peer(sock):
                    closed_at[i] = time.monotonic()
                    continue
                with contextlib.suppress(OSError):  # the close shows on the next sweep
                    sock.send(frame[sent : sent + 1])
            sent = min(sent + 1, len(frame) - 1)  # never the last byte: no frame is ever whole
            time.sleep(0.01)

    try:
        for _ in range(SLOW):
            started.append(time.monotonic())
            slow.append(connect_from(srv))
        dribbler = threading.Thread(target=dribble)
        dribbler.start()
        try:
            assert wait_until(lambda: srv.accepted >= SLOW)
            served(srv, secret, "past the dribblers")
        finally:
            dribbler.join(DEADLINE_S + 10.0)
            stop.set()
        assert len(closed_at) == SLOW, f"{SLOW - len(closed_at)} slow sender(s) still connected"
        assert all(closed_at[i] - started[i] >= DEADLINE_S for i in range(SLOW))  # never before the deadline
        assert srv.closed_slow >= SLOW and srv.dropped_connections == srv.closed_slow
    finally:
        stop.set()
        for sock in slow:
            sock.close()
        srv.close()


@pytest.mark.parametrize("secret", SECRETS)
def test_a_client_is_served_past_50_slow_senders_and_each_is_closed_at_the_deadline(secret: bytes | None) -> None:
    slow_senders_scenario(secret)


@pytest.mark.mutants
def test_mutant_without_the_deadline_slow_senders_keep_their_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(SideChannelServer, "_expire", lambda self, now: None)
    with pytest.raises(AssertionError, match="still connected"):
        slow_senders_scenario(None)


def test_junk_frames_are_no_progress_but_signed_ones_are() -> None:
    """Under a secret only a frame that authenticates keeps a connection: one answered with refusals (unsigned
    pings) is closed at the deadline, one sending signed pings outlives several deadlines."""
    secret = b"s3cret"
    srv = echo_server(secret, ConnectionLimits(frame_deadline_s=DEADLINE_S))
    junk, signed = connect_from(srv), connect_from(srv)
    try:
        begun = time.monotonic()
        end = begun + 4 * DEADLINE_S
        while time.monotonic() < end:
            for sock, frame in ((junk, framed(Ping(), None)), (signed, framed(Ping(), secret))):
                with contextlib.suppress(OSError):
                    sock.sendall(frame)
            time.sleep(0.05)
        assert srv.closed_slow == 1
        assert stream_ends(junk)  # its refusals, then the end of the stream
        assert not closed_by_peer(signed)
        assert srv.refused["unauthenticated"] >= 1 and srv.served >= 1
    finally:
        junk.close()
        signed.close()
        srv.close()


def test_a_client_idle_past_the_deadline_is_served_on_a_new_connection() -> None:
    srv = echo_server(None, ConnectionLimits(frame_deadline_s=DEADLINE_S))
    c = SideChannelClient(srv.address, [EchoReply], timeout_s=LIVENESS_S)
    try:
        served(srv, None, "first", c)
        assert wait_until(lambda: srv.closed_slow == 1)  # its idle connection closed at the deadline
        served(srv, None, "second", c)  # made again, unseen by the caller
        assert srv.accepted == 2
    finally:
        c.close()
        srv.close()


# -- (c) a client that never reads ----------------------------------------------------------------------------------
UNSENT_BOUND = 1 << 20


def non_reader_scenario(secret: bytes | None) -> None:
    """A peer sends requests and never reads a reply. First it stops with its replies backed up (kernel buffers
    full, the rest in the server's outbox): a client is served meanwhile, the loop never waits on the non-reader.
    Then it goes on: its unread replies pass the bound and the server closes it."""
    srv = echo_server(secret, ConnectionLimits(max_unsent_bytes=UNSENT_BOUND))
    request = framed(Echo("x" * 16_000), secret)
    hog = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window, no autotuning
    hog.settimeout(5.0)
    try:
        hog.connect((srv.host, srv.port))
        for _ in range(32):  # 512 KB of replies it will not read: under the bound
            hog.sendall(request)
        assert wait_until(lambda: srv.served >= 32)
        for i in range(5):
            served(srv, secret, f"beside a non-reader {i}")
        assert srv.closed_unread == 0
        closed_by_server = False
        for _ in range(4096):  # at most 64 MiB more: far past the bound and every kernel buffer
            try:
                hog.sendall(request)
            except OSError:  # reset: the server closed it
                closed_by_server = True
                break
        assert closed_by_server or wait_until(lambda: srv.closed_unread == 1)
        assert srv.closed_unread == 1 and srv.dropped_connections == 1
        served(srv, secret, "after the non-reader")
    finally:
        hog.close()
        srv.close()


@pytest.mark.parametrize("secret", SECRETS)
def test_a_client_is_served_beside_a_client_that_never_reads(secret: bytes | None) -> None:
    non_reader_scenario(secret)


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="max_connections"):
        ConnectionLimits(max_connections=0)
    with pytest.raises(ValueError, match="frame_deadline_s"):
        ConnectionLimits(frame_deadline_s=0.0)
    with pytest.raises(TypeError, match="max_unsent_bytes"):
        ConnectionLimits(max_unsent_bytes=1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("secret", SECRETS)
def test_under_the_default_limits_one_local_process_flooding_locks_no_client_out(secret: bytes | None) -> None:
    """The default limits, as a Producer runs them: 1,100 silent connections from 127.0.0.1 (where every local
    client also comes from) meet the per-address bound first; a client is served within a second."""
    srv = echo_server(secret, ConnectionLimits())
    flood: list[socket.socket] = []
    try:
        for i in range(FLOOD):
            flood.append(connect_from(srv))
            if i % 100 == 99:
                assert wait_until(lambda n=i + 1: srv.accepted >= n)
        assert wait_until(lambda: srv.accepted >= FLOOD)
        served(srv, secret, "beside the flood")
        assert srv.most_connections <= MAX_CONNECTIONS_PER_ADDRESS
        assert srv.evicted_address == FLOOD + 1 - MAX_CONNECTIONS_PER_ADDRESS
    finally:
        for sock in flood:
            sock.close()
        srv.close()
