"""The side channel: request/reply over plain TCP (one server thread with a selector, blocking clients), msgspec
messages, never pickle.

On the wire each frame is preceded by its length (``u32``, big-endian). A frame (wire version 3, see
:data:`kvlifecycle.transport.WIRE_VERSION`) is a fixed binary header (``b"KV"``, wire version ``u16``, flags ``u8``,
request id ``u64``, big-endian), a msgpack body (a tagged msgspec struct from the set the server was built with)
and, under a shared secret, an HMAC-SHA256 trailer over header and body. With a secret the trailer is checked
before a single byte is parsed; the body's size and nesting depth are checked
(:func:`kvlifecycle.untrusted.check_msgpack`) before it is decoded. A message that is oversized, malformed, too
deep, of an unknown kind or unauthenticated is answered with an :class:`ErrorReply` saying so, counted
(``refused``, and each listener added with :meth:`SideChannelServer.add_refusal_listener`), logged at a bounded rate
and dropped; nothing a peer sends can raise out of the serving loop, which keeps serving every other peer. A length
past the hard cap (4x the frame cap) is answered ``oversized`` and that connection closed, since the stream cannot
be resynchronised. Binds 127.0.0.1 unless told otherwise; every receive is bounded by a timeout.

What one peer can hold is bounded too (:class:`ConnectionLimits`), before any authentication: a connection that sent
no whole frame that reached a handler within ``frame_deadline_s`` of its accept or its last such frame is closed
(silent, dribbling a byte at a time, or sending only junk); at the connection bound, and at the bound per peer
address, the connection longest without such a frame is closed to admit the newcomer (the one the deadline would
close first); replies a peer leaves unread past ``max_unsent_bytes`` close its connection. Each closing is counted
(:attr:`SideChannelServer.dropped`), told to the refusal listeners and logged at a bounded rate. A client whose idle
connection was closed connects again on its next request, unseen by its caller.

Why not zmq: one thread that reads the kernel socket itself, with bounded buffers, in place of zmq's I/O thread,
pipes and mailboxes; fewer threads to schedule in an engine's worker process. (It was first made for a stall of
P TP 2 ranks under vLLM that turned out to be the kernel's scheduler starving whole processes: docs/vllm.md.)

One concept, longer than most: the request/reply channel, server and client, which share the frame format, the
bounds and the one frame-taking helper; the messages live in :mod:`kvlifecycle.control`.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import selectors
import socket
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, Literal, Union, get_args

import attrs
import msgspec

from kvlifecycle import validators as v
from kvlifecycle.transport import WIRE_VERSION
from kvlifecycle.untrusted import DEFAULT_MAX_DEPTH, RateLimitedLog, UntrustedInputError, check_msgpack

log = logging.getLogger("kvlifecycle.sidechannel")

DEFAULT_MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 5.0

MAGIC = b"KV"
HEADER = struct.Struct(">2sHBQ")  # magic, wire version, flags, request id
LENGTH = struct.Struct(">I")  # before every frame on the stream
# The defaults of ConnectionLimits (docs/design.md, "Hostile input is counted and dropped, never fatal").
MAX_CONNECTIONS = 1024  # a server's open connections; a newcomer past it evicts the longest-silent one
# one peer address's; a quarter of the slots, so one host (or every process of a single node, all 127.0.0.1) can never
# hold them all, yet far above what a host's legitimate clients open (one per D rank per P rank, and a few tools)
MAX_CONNECTIONS_PER_ADDRESS = 256
# no whole frame for this long closes a connection: above twice a lease heartbeat's rhythm (a sixth of the default
# 30 s TTL), so a D renewing a lease keeps its connection, and far above the time a 1 MiB frame takes to arrive
FRAME_DEADLINE_S = 10.0
MAX_UNSENT_BYTES = 16 << 20  # replies a peer does not read; past it its connection is closed
ACCEPTS_PER_WAKEUP = 64  # a flood of connects takes turns with the peers already connected
FLAG_MAC = 0x01  # an HMAC-SHA256 trailer follows the body
MAC_BYTES = 32


class ErrorReply(msgspec.Struct, frozen=True, tag=True):
    code: str  # oversized | malformed | unknown_kind | unauthenticated | version | refused | internal | a handler's
    message: str
    detail: bytes = b""  # msgpack the refusing handler attached for the caller (e.g. the mismatching fields)


class Ack(msgspec.Struct, frozen=True, tag=True):
    ok: bool = True
    detail: str = ""


class Ping(msgspec.Struct, frozen=True, tag=True):
    pass


class SideChannelError(Exception):
    pass


class SideChannelTimeout(SideChannelError):
    pass


class SideChannelAddressError(SideChannelError, ValueError):
    """An address that is not ``tcp://HOST:PORT`` (a side-channel error to a client's callers, a ValueError to
    configuration)."""


class SideChannelRefused(SideChannelError):
    """The server refused the message; ``code`` says why (see :class:`ErrorReply`)."""

    def __init__(self, code: str, message: str, detail: bytes = b"") -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.detail = detail


def _mac(secret: bytes, signed: bytes) -> bytes:
    return hmac.new(secret, signed, hashlib.sha256).digest()


def _union(types: Iterable[type]) -> Any:
    types = tuple(types)
    return types[0] if len(types) == 1 else Union[types]  # noqa: UP007 - a runtime union of struct types


_encoder = msgspec.msgpack.Encoder()


def encode_frame(body: bytes, rid: int, secret: bytes | None = None, *, version: int = WIRE_VERSION) -> bytes:
    """One side-channel frame around an encoded ``body``: header, body, and the HMAC trailer under ``secret``."""
    signed = HEADER.pack(MAGIC, version, FLAG_MAC if secret else 0, rid) + body
    return signed + _mac(secret, signed) if secret else signed


class FrameError(Exception):
    """A frame that cannot be opened; ``code`` is the :class:`ErrorReply` code, ``rid`` the request id if read."""

    def __init__(self, code: str, message: str, rid: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.rid = code, message, rid


def open_frame(frame: bytes, secret: bytes | None, *, max_bytes: int, max_depth: int) -> tuple[int, bytes]:
    """(request id, body) of a frame, checked in this order: size, HMAC (when ``secret``: over the raw bytes, before
    anything is parsed), header, wire version, body depth. Raises :class:`FrameError` for anything else; total."""
    if not isinstance(frame, bytes):
        raise FrameError("malformed", f"a frame is bytes, not {type(frame).__name__}")
    if len(frame) > max_bytes:
        raise FrameError("oversized", f"{len(frame)} bytes > cap {max_bytes}")
    if secret:
        if len(frame) < HEADER.size + MAC_BYTES:
            raise FrameError("unauthenticated", "no HMAC trailer")
        signed, mac = frame[:-MAC_BYTES], frame[-MAC_BYTES:]
        if not hmac.compare_digest(mac, _mac(secret, signed)):
            raise FrameError("unauthenticated", "missing or wrong HMAC")
    else:
        signed = frame
    if len(signed) < HEADER.size or signed[:2] != MAGIC:
        if signed[:2] in (b"\x93\x01", b"\x94\x01"):  # the msgpack array [1, rid, body, mac] of wire version 1
            raise FrameError("version", f"a wire version 1 frame; this side speaks {WIRE_VERSION}")
        raise FrameError("malformed", "not a side-channel frame (no header)")
    _, version, flags, rid = HEADER.unpack_from(signed)
    if version != WIRE_VERSION:
        raise FrameError("version", f"wire version {version}, this side speaks {WIRE_VERSION}", rid)
    body = signed[HEADER.size :]
    if flags & FLAG_MAC and not secret:  # signed by a peer whose secret we do not hold: nothing to check it with
        body = body[:-MAC_BYTES] if len(body) >= MAC_BYTES else b""
    try:
        check_msgpack(body, max_depth=max_depth)
    except UntrustedInputError as exc:
        raise FrameError("malformed", str(exc), rid) from exc
    return rid, body


def _decode_body(decoder: msgspec.msgpack.Decoder[msgspec.Struct], body: bytes) -> msgspec.Struct:
    """The body's message, or :class:`FrameError` (``unknown_kind`` or ``malformed``); total."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        text = str(exc)
        unknown = "Invalid value" in text and "$.type" in text
        raise FrameError("unknown_kind" if unknown else "malformed", text) from exc
    except Exception as exc:  # DecodeError, and anything a decoder could still raise: the input is at fault
        raise FrameError("malformed", f"{type(exc).__name__}: {exc}") from exc


Handler = Callable[[Any, bytes], msgspec.Struct]


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of ``tcp://host:port`` (``tcp://[v6]:port`` too); :class:`SideChannelAddressError` otherwise."""
    rest = address.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536 or rest == address:
        raise SideChannelAddressError(f"side-channel address {address!r} is not tcp://HOST:PORT")
    return host.removeprefix("[").removesuffix("]"), int(port)


def format_address(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def hard_cap(max_bytes: int) -> int:
    """The largest frame length a side accepts off the stream at all (below it, an oversized frame is answered)."""
    return max_bytes * 4 + 4096


@attrs.frozen(kw_only=True)
class ConnectionLimits:
    """What the peers of one :class:`SideChannelServer` may hold (the module constants are the defaults, with why).

    Memory is bounded by ``max_connections`` x (the inbox's hard cap, :func:`hard_cap`, + ``max_unsent_bytes``)."""

    max_connections: int = attrs.field(default=MAX_CONNECTIONS, validator=v.integer(1))
    max_connections_per_address: int = attrs.field(default=MAX_CONNECTIONS_PER_ADDRESS, validator=v.integer(1))
    frame_deadline_s: float = attrs.field(default=FRAME_DEADLINE_S, validator=v.positive)
    max_unsent_bytes: int = attrs.field(default=MAX_UNSENT_BYTES, validator=v.integer(1))


# Why this side closed a connection (counted in SideChannelServer.dropped and told to its refusal listeners):
#   closed_slow        no whole frame that reached a handler within the frame deadline (silent, dribbling, junk)
#   evicted_idle       the longest-silent connection, to admit a newcomer at the connection bound
#   evicted_address    the same address's longest-silent one, to admit a newcomer at the per-address bound
#   closed_unread      replies left unread past max_unsent_bytes
#   closed_oversized   a length past the hard cap: the stream cannot be resynchronised
#   refused_new        a newcomer closed at once: at a bound with nothing to evict (not with eviction in place)
ConnectionDrop = Literal["closed_slow", "evicted_idle", "evicted_address", "closed_unread", "closed_oversized",
                         "refused_new"]
CONNECTION_DROPS: tuple[ConnectionDrop, ...] = get_args(ConnectionDrop)


class _Connection:
    """One accepted peer: what it sent that is not a whole frame yet, the replies it has not taken yet, and when it
    last made progress (its accept, or its last whole frame that reached a handler)."""

    __slots__ = ("address", "closing", "inbox", "outbox", "peer", "progress_at", "sock")

    def __init__(self, sock: socket.socket, peer: bytes, address: str, now: float) -> None:
        self.sock, self.peer, self.address = sock, peer, address
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.closing = False  # close once the outbox is sent (the stream cannot be resynchronised)
        self.progress_at = now


class SideChannelServer:
    """A listening TCP socket served by one thread. ``handlers`` maps a message type to ``fn(message, peer_id) ->
    reply``; ``peer_id`` names the connection (``b"host:port"`` of the peer).

    Handlers run on the server thread: keep them short (enqueue work elsewhere). A handler that raises
    :class:`SideChannelRefused` refuses with its code; any other exception is an ``internal`` refusal. Refused
    messages are counted per code in ``refused`` (``bad_messages`` is their sum) and told to every refusal listener.

    ``limits`` bound what the peers may hold (:class:`ConnectionLimits`); the connections this side closed are
    counted per reason in ``dropped`` (``dropped_connections`` is their sum; ``closed_slow``, ``evicted_idle``,
    ``evicted_address``, ``closed_unread`` name the counts) and told to every refusal listener under the reason.
    ``most_connections`` is the most connections ever open at once.
    """

    def __init__(
        self,
        handlers: dict[type, Handler],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_depth: int = DEFAULT_MAX_DEPTH,
        poll_ms: int = 50,
        name: str = "sidechannel",
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.handlers = {Ping: lambda _m, _p: Ack(), **handlers}
        self._decoder: msgspec.msgpack.Decoder[msgspec.Struct] = msgspec.msgpack.Decoder(_union(self.handlers))
        self.secret = secret
        self.max_bytes = int(max_bytes)
        self.max_depth = int(max_depth)
        self.poll_ms = poll_ms
        self.limits = ConnectionLimits() if limits is None else limits
        self.refused: dict[str, int] = {}
        self.served = 0
        self.dropped: dict[ConnectionDrop, int] = dict.fromkeys(CONNECTION_DROPS, 0)
        self.accepted = 0
        self.most_connections = 0
        self._refusal_listeners: list[Callable[[str], None]] = []
        self._log_refusal = RateLimitedLog(log)
        self._log_drop = RateLimitedLog(log)  # its own budget: a connection flood never hides a refused message
        self._log_error = RateLimitedLog(log, level=logging.ERROR)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, int(port)), family=family, backlog=128)  # SO_REUSEADDR
        self._listener.setblocking(False)
        self.host, self.port = host, int(self._listener.getsockname()[1])
        # open connections, longest without progress first (so, with one deadline for all, in deadline order); and
        # the same per peer address: eviction and expiry take the first, progress moves a connection to the end
        self._connections: OrderedDict[_Connection, None] = OrderedDict()
        self._by_address: dict[str, OrderedDict[_Connection, None]] = {}
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def add_handlers(self, handlers: dict[type, Handler]) -> None:
        """Serve more message types (a layer-wise streamer beside a producer); a type served already is refused."""
        taken = set(handlers) & set(self.handlers)
        if taken:
            raise ValueError(f"already served: {sorted(t.__name__ for t in taken)}")
        merged = {**self.handlers, **handlers}
        self._decoder = msgspec.msgpack.Decoder(_union(merged))  # decoder first: a served type always decodes
        self.handlers = merged

    @property
    def bad_messages(self) -> int:
        """Messages refused so far, whatever the code."""
        return sum(self.refused.values())

    @property
    def dropped_connections(self) -> int:
        """Connections this side closed so far, whatever the reason."""
        return sum(self.dropped.values())

    @property
    def closed_slow(self) -> int:
        """Connections closed at the frame deadline."""
        return self.dropped["closed_slow"]

    @property
    def evicted_idle(self) -> int:
        """Connections closed to admit a newcomer at the connection bound."""
        return self.dropped["evicted_idle"]

    @property
    def evicted_address(self) -> int:
        """Connections closed to admit a newcomer from the same address at the per-address bound."""
        return self.dropped["evicted_address"]

    @property
    def closed_unread(self) -> int:
        """Connections closed with more than ``limits.max_unsent_bytes`` of replies unread."""
        return self.dropped["closed_unread"]

    @property
    def connection_count(self) -> int:
        """Connections open now (read from another thread: a moment's value)."""
        return len(self._connections)

    def add_refusal_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(code)`` runs on the server thread for every refused message (e.g. an OpenTelemetry counter's
        ``add``) and every connection this side closes (``code`` one of :data:`CONNECTION_DROPS`); its exceptions are
        logged and swallowed."""
        self._refusal_listeners.append(listener)

    def _tell_listeners(self, code: str) -> None:
        for listener in self._refusal_listeners:
            try:
                listener(code)
            except Exception:
                self._log_error("side-channel refusal listener failed", exc_info=True)

    def _refuse(self, code: str, message: str, detail: bytes = b"") -> ErrorReply:
        self.refused[code] = self.refused.get(code, 0) + 1
        self._log_refusal("side channel refused a message (%s): %.200s", code, message)
        self._tell_listeners(code)
        return ErrorReply(code, message[:4000], detail)

    def handle_frame(self, payload: bytes, peer: bytes) -> tuple[int, msgspec.Struct]:
        """Authenticate, decode and dispatch one frame. Returns (request id, reply); never raises."""
        rid, reply, _ = self._dispatch(payload, peer)
        return rid, reply

    def _dispatch(self, payload: bytes, peer: bytes) -> tuple[int, msgspec.Struct, bool]:
        """(request id, reply, whether the frame reached a handler: authenticated and decoded); never raises."""
        try:
            rid, body = open_frame(payload, self.secret, max_bytes=self.max_bytes, max_depth=self.max_depth)
            message = _decode_body(self._decoder, body)
        except FrameError as exc:
            return exc.rid, self._refuse(exc.code, exc.message), False
        try:
            reply = self.handlers[type(message)](message, peer)
        except SideChannelRefused as exc:
            return rid, self._refuse(exc.code, exc.message, exc.detail), True
        except Exception as exc:
            self._log_error("side-channel handler for %s failed", type(message).__name__, exc_info=True)
            return rid, self._refuse("internal", f"{type(exc).__name__}: {exc}"), True
        self.served += 1
        return rid, reply, True

    def _reply_frame(self, rid: int, reply: msgspec.Struct) -> bytes:
        try:
            body = _encoder.encode(reply)
        except Exception as exc:  # a handler returned something that does not encode
            self._log_error("side-channel reply of type %s does not encode", type(reply).__name__, exc_info=True)
            body = _encoder.encode(self._refuse("internal", f"reply does not encode: {exc}"))
        return encode_frame(body, rid & 0xFFFF_FFFF_FFFF_FFFF, self.secret)

    # -- the serving thread -----------------------------------------------------------------------------------------
    def _serve(self) -> None:
        poll_s = self.poll_ms / 1000
        while not self._stop.is_set():
            try:
                ready = self._selector.select(self._select_timeout(poll_s))
            except Exception as exc:  # the selector itself failed: keep serving, never spin on the log
                self._log_error("side channel select failed: %s", exc)
                self._stop.wait(poll_s)
                continue
            for key, events in ready:
                conn = key.data
                try:
                    if conn is None:
                        self._accept()
                        continue
                    if conn.sock.fileno() < 0:
                        continue  # closed earlier in this round (evicted to admit a newcomer)
                    if events & selectors.EVENT_READ:
                        self._receive(conn)
                    if events & selectors.EVENT_WRITE and conn.sock.fileno() >= 0:
                        self._flush(conn)
                except Exception as exc:  # nothing a peer sends may end this loop: drop that peer, serve the rest
                    self._log_error("side channel dropped a connection it could not serve", exc_info=True)
                    self._refuse("internal", f"{type(exc).__name__}: {exc}")
                    if conn is not None:
                        self._close(conn)
            try:
                self._expire(time.monotonic())
            except Exception:
                self._log_error("side channel could not close expired connections", exc_info=True)
        for conn in list(self._connections):
            self._close(conn)
        self._selector.close()
        self._listener.close()

    def _select_timeout(self, poll_s: float) -> float:
        """Until the nearest frame deadline (the first connection's), at most ``poll_s`` (the stop flag's rhythm)."""
        first = next(iter(self._connections), None)
        if first is None:
            return poll_s
        return min(poll_s, max(first.progress_at + self.limits.frame_deadline_s - time.monotonic(), 0.0))

    def _expire(self, now: float) -> None:
        """Close the connections past their frame deadline: a prefix of the deadline order, so the first one still
        in time ends the walk (nothing due costs one look)."""
        cutoff = now - self.limits.frame_deadline_s
        while self._connections:
            first = next(iter(self._connections))
            if first.progress_at > cutoff:
                return
            self._drop(first, "closed_slow", f"no whole frame in {self.limits.frame_deadline_s:g}s")

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):  # the rest of a flood waits for the next round, after the other peers
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. out of file descriptors: what is open keeps being served
                self._log_error("side channel accept failed: %s", exc)
                if self._connections:  # give the longest-silent connection's descriptor to the next accept
                    self._drop(next(iter(self._connections)), "evicted_idle", f"accept failed: {exc}")
                else:  # nothing of ours to free: the listener stays readable, so never spin on it
                    self._stop.wait(self.poll_ms / 1000)
                return
            self._admit(sock, str(addr[0]), f"{addr[0]}:{addr[1]}")

    def _admit(self, sock: socket.socket, address: str, peer: str) -> None:
        self.accepted += 1
        self._make_room(address)
        same = self._by_address.get(address)
        if len(self._connections) >= self.limits.max_connections or (
            same is not None and len(same) >= self.limits.max_connections_per_address
        ):  # nothing could be evicted
            self._count_drop("refused_new", peer, "at a connection bound")
            sock.close()
            return
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:  # reset before it was served
            sock.close()
            return
        conn = _Connection(sock, peer.encode(), address, time.monotonic())
        self._connections[conn] = None
        self._by_address.setdefault(address, OrderedDict())[conn] = None
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self.most_connections = max(self.most_connections, len(self._connections))

    def _make_room(self, address: str) -> None:
        """Evict so that a newcomer from ``address`` fits under both bounds: that address's connection longest
        without progress at the per-address bound, then the one longest without progress of all at the connection
        bound. Progress is a whole frame that reached a handler, the one thing a peer without the secret cannot
        fake; a byte sent or a reply pending would be (an attacker's connections would all show one)."""
        same = self._by_address.get(address)
        while same and len(same) >= self.limits.max_connections_per_address:
            self._drop(next(iter(same)), "evicted_address", "to admit a newcomer from the same address")
        while len(self._connections) >= self.limits.max_connections:
            self._drop(next(iter(self._connections)), "evicted_idle", "to admit a newcomer")

    def _progress(self, conn: _Connection) -> None:
        """A whole frame of ``conn`` reached a handler: its deadline starts again, and it goes last in line."""
        conn.progress_at = time.monotonic()
        self._connections.move_to_end(conn)
        self._by_address[conn.address].move_to_end(conn)

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:  # the peer closed; what it sent whole was answered already
            self._close(conn)
            return
        if conn.closing:
            return  # past the hard cap: nothing more is read from this stream
        conn.inbox += data
        cap = hard_cap(self.max_bytes)
        while True:
            try:
                payload = _take_frame(conn.inbox, cap)
            except _OversizedFrame as exc:
                self._count_drop("closed_oversized", conn.peer.decode(), str(exc))
                refusal = self._refuse("oversized", f"{exc}: connection closed")
                conn.outbox += _framed(encode_frame(_encoder.encode(refusal), 0, self.secret))
                conn.inbox.clear()
                conn.closing = True
                break
            if payload is None:
                break
            rid, reply, reached = self._dispatch(payload, conn.peer)
            if reached:
                self._progress(conn)
            conn.outbox += _framed(self._reply_frame(rid, reply))
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        if conn.outbox:
            try:
                sent = conn.sock.send(conn.outbox)  # non-blocking: a peer that does not read never holds the loop
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            del conn.outbox[:sent]
        if len(conn.outbox) > self.limits.max_unsent_bytes:
            self._drop(conn, "closed_unread", f"{len(conn.outbox)} reply bytes unread")
        elif conn.outbox:
            self._selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        elif conn.closing:
            self._close(conn)
        else:
            with contextlib.suppress(KeyError, ValueError):
                if self._selector.get_key(conn.sock).events != selectors.EVENT_READ:
                    self._selector.modify(conn.sock, selectors.EVENT_READ, conn)

    def _count_drop(self, reason: ConnectionDrop, peer: str, why: str) -> None:
        self.dropped[reason] += 1
        self._log_drop("side channel closed a connection from %s (%s): %s", peer, reason, why)
        self._tell_listeners(reason)

    def _drop(self, conn: _Connection, reason: ConnectionDrop, why: str) -> None:
        self._count_drop(reason, conn.peer.decode(), why)
        self._close(conn)

    def _close(self, conn: _Connection) -> None:
        self._connections.pop(conn, None)
        same = self._by_address.get(conn.address)
        if same is not None:
            same.pop(conn, None)
            if not same:
                del self._by_address[conn.address]
        if conn.sock.fileno() < 0:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


def _framed(frame: bytes) -> bytes:
    return LENGTH.pack(len(frame)) + frame


class _OversizedFrame(Exception):
    """A length prefix past the hard cap: the stream cannot be read on."""


def _take_frame(inbox: bytearray, cap: int) -> bytes | None:
    """Take the first whole frame off ``inbox`` (its length prefix removed); None while it is not whole yet."""
    if len(inbox) < LENGTH.size:
        return None
    (size,) = LENGTH.unpack_from(inbox)
    if size > cap:
        raise _OversizedFrame(f"a frame of {size} bytes > hard cap {cap}")
    if len(inbox) < LENGTH.size + size:
        return None
    payload = bytes(inbox[LENGTH.size : LENGTH.size + size])
    del inbox[: LENGTH.size + size]
    return payload


class _ConnectionLost(Exception):
    """The server closed or reset the connection; ``answered`` says whether any reply byte arrived on it first."""

    def __init__(self, why: str, answered: bool) -> None:
        super().__init__(why)
        self.answered = answered


class SideChannelClient:
    """A TCP connection to one server. Thread-safe (one request at a time); every wait bounded by ``timeout_s``.

    A server that is not listening yet is connected to again (with backoff) until the request's bound: one that
    starts within it is answered, as a restarted P is. A connection the server closed since the last request is
    made again once and the request sent again: it cannot have been served there. A timeout closes the connection,
    so a late reply never reaches a later request. Replies are opened like requests (HMAC first under a secret,
    then header and depth): whatever comes back, a request returns a reply or raises a :class:`SideChannelError`,
    never anything else."""

    def __init__(
        self,
        address: str,
        reply_types: Iterable[type],
        *,
        secret: bytes | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_depth: int = DEFAULT_MAX_DEPTH,
    ) -> None:
        self.address = address
        self.host, self.port = parse_address(address)
        self.secret = secret
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self.max_depth = int(max_depth)
        self.bad_replies = 0  # replies dropped because they could not be opened or were not for this request
        self._decoder: msgspec.msgpack.Decoder[msgspec.Struct] = msgspec.msgpack.Decoder(
            _union({ErrorReply, Ack, *reply_types}))
        self._lock = threading.Lock()
        self._rid = 0
        self._sock: socket.socket | None = None
        self._inbox = bytearray()
        self._closed = False

    def request(self, message: msgspec.Struct, timeout_s: float | None = None) -> Any:
        body = _encoder.encode(message)
        with self._lock:
            self._rid += 1
            rid = self._rid
            return self._exchange(encode_frame(body, rid, self.secret), rid, timeout_s)

    def request_raw(self, frame: bytes, timeout_s: float | None = None) -> Any:
        """Send an arbitrary frame (tests: malformed input) and return the decoded reply."""
        with self._lock:
            return self._exchange(frame, None, timeout_s)

    def _exchange(self, frame: bytes, rid: int | None, timeout_s: float | None) -> Any:
        if self._closed:
            raise SideChannelError(f"client of {self.address} is closed")
        if len(frame) > self.max_bytes:
            raise SideChannelError(f"message of {len(frame)} bytes exceeds cap {self.max_bytes}")
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        for attempt in (1, 2):
            if self._closed:  # closed while this request waited: it ends now, not at its timeout
                raise SideChannelError(f"client of {self.address} is closed")
            reused = self._sock is not None
            sock = self._sock if self._sock is not None else self._connect(deadline, wait_s)
            try:
                sock.settimeout(max(deadline - time.monotonic(), 0.001))
                sock.sendall(_framed(frame))
                return self._reply(sock, rid, deadline, wait_s)
            except _ConnectionLost as exc:
                self._drop()
                if attempt == 1 and reused and not exc.answered:  # closed since the last request: never served
                    continue
                raise SideChannelError(f"{self.address} closed the connection: {exc}") from None
            except TimeoutError:
                self._drop()  # a reply that still comes is never read
                raise SideChannelTimeout(f"no reply from {self.address} in {wait_s}s") from None
            except OSError as exc:  # reset while sending
                self._drop()
                if attempt == 1 and reused:
                    continue
                raise SideChannelError(f"{self.address}: {exc}") from None
        raise AssertionError("unreachable")

    def _connect(self, deadline: float, wait_s: float) -> socket.socket:
        backoff = 0.02
        while True:
            if self._closed:
                raise SideChannelError(f"client of {self.address} is closed")
            left = deadline - time.monotonic()
            if left <= 0:
                raise SideChannelTimeout(f"no reply from {self.address} in {wait_s}s (not listening)")
            try:
                sock = socket.create_connection((self.host, self.port), timeout=left)
            except TimeoutError:
                continue  # the loop's bound says so
            except OSError:  # refused (not listening yet), unreachable: again until the bound
                time.sleep(min(backoff, max(deadline - time.monotonic(), 0.0)))
                backoff = min(backoff * 2, 0.5)
                continue
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
            self._inbox.clear()
            return sock

    def _reply(self, sock: socket.socket, rid: int | None, deadline: float, wait_s: float) -> Any:
        answered = False
        while True:
            payload = self._next_frame()
            if payload is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                try:
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    raise
                except OSError as exc:
                    raise _ConnectionLost(str(exc), answered) from None
                if not data:
                    raise _ConnectionLost("end of stream", answered)
                answered = True
                self._inbox += data
                continue
            try:
                reply_rid, body = open_frame(payload, self.secret, max_bytes=hard_cap(self.max_bytes),
                                             max_depth=self.max_depth)
            except FrameError as exc:
                if exc.code == "unauthenticated":
                    raise SideChannelRefused("unauthenticated", f"reply from {self.address} failed HMAC") from exc
                raise SideChannelError(f"malformed reply from {self.address}: {exc}") from exc
            if rid is not None and reply_rid != rid and reply_rid != 0:
                self.bad_replies += 1
                continue  # a reply to another request of this connection
            try:
                reply = _decode_body(self._decoder, body)
            except FrameError as exc:
                raise SideChannelError(f"unexpected reply from {self.address}: {exc.message}") from exc
            if isinstance(reply, ErrorReply):
                raise SideChannelRefused(reply.code, reply.message, reply.detail)
            return reply

    def _next_frame(self) -> bytes | None:
        """The next whole frame received, or None; a length past the hard cap is a malformed reply."""
        try:
            return _take_frame(self._inbox, hard_cap(self.max_bytes))
        except _OversizedFrame as exc:
            self._drop()
            raise SideChannelError(f"malformed reply from {self.address}: {exc}") from None

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._inbox.clear()

    def close(self) -> None:
        """Close now: a request waiting on a reply (another thread's) fails at once rather than at its timeout."""
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the waiting recv; the request sees the close
        with self._lock:
            self._drop()


def encode_envelope(message: msgspec.Struct, *, rid: int = 1, secret: bytes | None = None) -> bytes:
    """``message`` as one complete frame (tests and tools that speak to a server through a raw socket)."""
    return encode_frame(_encoder.encode(message), rid, secret)
