"""The side channel: pyzmq ROUTER (server) / DEALER (client), msgspec messages, never pickle.

A frame (wire version 2, see :data:`kvlifecycle.transport.WIRE_VERSION`) is a fixed binary header (``b"KV"``,
wire version ``u16``, flags ``u8``, request id ``u64``, big-endian), a msgpack body (a tagged msgspec struct from
the set the server was built with) and, under a shared secret, an HMAC-SHA256 trailer over header and body. With a
secret the trailer is checked before a single byte is parsed; the body's size and nesting depth are checked
(:func:`kvlifecycle.untrusted.check_msgpack`) before it is decoded. A message that is oversized, malformed, too
deep, of an unknown kind or unauthenticated is answered with an :class:`ErrorReply` saying so, counted
(``refused``, and each listener added with :meth:`SideChannelServer.add_refusal_listener`), logged at a bounded rate
and dropped; nothing a peer sends can raise out of the serving loop, which keeps serving every other peer. A REQ
socket's empty delimiter frame is kept in the reply. Binds 127.0.0.1 unless told otherwise; every receive is
bounded by a timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Union

import msgspec
import zmq

from kvlifecycle.transport import WIRE_VERSION
from kvlifecycle.untrusted import DEFAULT_MAX_DEPTH, RateLimitedLog, UntrustedInputError, check_msgpack

log = logging.getLogger("kvlifecycle.sidechannel")

DEFAULT_MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 5.0

MAGIC = b"KV"
HEADER = struct.Struct(">2sHBQ")  # magic, wire version, flags, request id
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


class SideChannelServer:
    """A ROUTER socket served by one thread. ``handlers`` maps a message type to ``fn(message, peer_id) -> reply``.

    Handlers run on the server thread: keep them short (enqueue work elsewhere). A handler that raises
    :class:`SideChannelRefused` refuses with its code; any other exception is an ``internal`` refusal. Refused
    messages are counted per code in ``refused`` (``bad_messages`` is their sum) and told to every refusal listener.
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
    ) -> None:
        self.handlers = {Ping: lambda _m, _p: Ack(), **handlers}
        self._decoder: msgspec.msgpack.Decoder[msgspec.Struct] = msgspec.msgpack.Decoder(_union(self.handlers))
        self.secret = secret
        self.max_bytes = int(max_bytes)
        self.max_depth = int(max_depth)
        self.poll_ms = poll_ms
        self.refused: dict[str, int] = {}
        self.served = 0
        self._refusal_listeners: list[Callable[[str], None]] = []
        self._log_refusal = RateLimitedLog(log)
        self._log_error = RateLimitedLog(log, level=logging.ERROR)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # hard guard: zmq drops (only) the offending connection above this; below it we answer with a clear error
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes * 4 + 4096)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, int(port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"tcp://{self.host}:{self.port}"

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

    def add_refusal_listener(self, listener: Callable[[str], None]) -> None:
        """``listener(code)`` runs on the server thread for every refused message (e.g. an OpenTelemetry counter's
        ``add``); its exceptions are logged and swallowed."""
        self._refusal_listeners.append(listener)

    def _refuse(self, code: str, message: str, detail: bytes = b"") -> ErrorReply:
        self.refused[code] = self.refused.get(code, 0) + 1
        self._log_refusal("side channel refused a message (%s): %.200s", code, message)
        for listener in self._refusal_listeners:
            try:
                listener(code)
            except Exception:
                self._log_error("side-channel refusal listener failed", exc_info=True)
        return ErrorReply(code, message[:4000], detail)

    def handle_frame(self, payload: bytes, peer: bytes) -> tuple[int, msgspec.Struct]:
        """Authenticate, decode and dispatch one frame. Returns (request id, reply); never raises."""
        try:
            rid, body = open_frame(payload, self.secret, max_bytes=self.max_bytes, max_depth=self.max_depth)
            message = _decode_body(self._decoder, body)
        except FrameError as exc:
            return exc.rid, self._refuse(exc.code, exc.message)
        try:
            reply = self.handlers[type(message)](message, peer)
        except SideChannelRefused as exc:
            return rid, self._refuse(exc.code, exc.message, exc.detail)
        except Exception as exc:
            self._log_error("side-channel handler for %s failed", type(message).__name__, exc_info=True)
            return rid, self._refuse("internal", f"{type(exc).__name__}: {exc}")
        self.served += 1
        return rid, reply

    def _reply_frame(self, rid: int, reply: msgspec.Struct) -> bytes:
        try:
            body = _encoder.encode(reply)
        except Exception as exc:  # a handler returned something that does not encode
            self._log_error("side-channel reply of type %s does not encode", type(reply).__name__, exc_info=True)
            body = _encoder.encode(self._refuse("internal", f"reply does not encode: {exc}"))
        return encode_frame(body, rid & 0xFFFF_FFFF_FFFF_FFFF, self.secret)

    def _serve_one(self, frames: list[bytes]) -> None:
        """One received message, start to reply. ROUTER frames: [peer, payload] from a DEALER, [peer, b"", payload]
        from a REQ socket (whose delimiter the reply must carry back, or the REQ socket drops it)."""
        if len(frames) == 2:
            route, payload = frames[:1], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            route, payload = frames[:2], frames[2]
        else:
            refusal = self._refuse("malformed", f"{len(frames)} frames: a message is one payload frame")
            if frames:
                self._send(frames[:1], encode_frame(_encoder.encode(refusal), 0, self.secret))
            return
        rid, reply = self.handle_frame(payload, route[0])
        self._send(route, self._reply_frame(rid, reply))

    def _send(self, route: list[bytes], out: bytes) -> None:
        try:
            self._sock.send_multipart([*route, out], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._log_refusal("side channel reply dropped: %s", exc)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if not poller.poll(self.poll_ms):
                    continue
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except Exception as exc:  # the socket itself failed: keep serving, never spin on the log
                self._log_error("side channel recv failed: %s", exc)
                self._stop.wait(self.poll_ms / 1000)
                continue
            try:
                self._serve_one(frames)
            except Exception as exc:  # nothing a peer sends may end this loop: count, log (bounded) and go on
                self._log_error("side channel dropped a message it could not serve", exc_info=True)
                self._refuse("internal", f"{type(exc).__name__}: {exc}")
        self._sock.close(0)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


class SideChannelClient:
    """A DEALER socket to one server. Thread-safe (one request at a time); every wait bounded by ``timeout_s``.

    Replies are opened like requests (HMAC first under a secret, then header and depth): whatever comes back, a
    request returns a reply or raises a :class:`SideChannelError`, never anything else."""

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
        self.secret = secret
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self.max_depth = int(max_depth)
        self.bad_replies = 0  # replies dropped because they could not be opened or were not for this request
        self._decoder: msgspec.msgpack.Decoder[msgspec.Struct] = msgspec.msgpack.Decoder(
            _union({ErrorReply, Ack, *reply_types}))
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._lock = threading.Lock()
        self._rid = 0
        self._sock: zmq.Socket[bytes] | None = None
        self._open()

    def _open(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes * 4 + 4096)
        self._sock.connect(self.address)

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
        if self._sock is None:
            raise SideChannelError(f"client of {self.address} is closed")
        if len(frame) > self.max_bytes:
            raise SideChannelError(f"message of {len(frame)} bytes exceeds cap {self.max_bytes}")
        self._sock.send(frame)
        wait_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms, zmq.POLLIN):
                self._open()  # drop whatever reply may still arrive late
                raise SideChannelTimeout(f"no reply from {self.address} in {wait_s}s")
            parts = self._sock.recv_multipart()
            try:
                reply_rid, body = open_frame(parts[-1] if len(parts) == 1 else b"", self.secret,
                                             max_bytes=self.max_bytes * 4 + 4096, max_depth=self.max_depth)
            except FrameError as exc:
                if exc.code == "unauthenticated":
                    raise SideChannelRefused("unauthenticated", f"reply from {self.address} failed HMAC") from exc
                raise SideChannelError(f"malformed reply from {self.address}: {exc}") from exc
            if rid is not None and reply_rid != rid and reply_rid != 0:
                self.bad_replies += 1
                continue  # a late reply to an earlier, timed-out request
            try:
                reply = _decode_body(self._decoder, body)
            except FrameError as exc:
                raise SideChannelError(f"unexpected reply from {self.address}: {exc.message}") from exc
            if isinstance(reply, ErrorReply):
                raise SideChannelRefused(reply.code, reply.message, reply.detail)
            return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None


def encode_envelope(message: msgspec.Struct, *, rid: int = 1, secret: bytes | None = None) -> bytes:
    """``message`` as one complete frame (tests and tools that speak to a server through a raw socket)."""
    return encode_frame(_encoder.encode(message), rid, secret)
