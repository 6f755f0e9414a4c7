"""The side channel: pyzmq ROUTER (server) / DEALER (client), msgspec messages, never pickle.

Every frame is one msgpack :class:`Envelope` (wire version, request id, body, optional HMAC-SHA256 of the body
under a shared secret). The body is a tagged msgspec struct from the set the server was built with. A message that
is oversized, malformed, of an unknown kind or unauthenticated is answered with an :class:`ErrorReply` saying so,
counted, and dropped — the server keeps serving every other peer. Binds 127.0.0.1 unless told otherwise; every
receive is bounded by a timeout.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Union

import msgspec
import zmq

from kvlifecycle.transport import WIRE_VERSION

log = logging.getLogger("kvlifecycle.sidechannel")

DEFAULT_MAX_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 5.0


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    rid: int
    body: bytes
    mac: bytes = b""


class ErrorReply(msgspec.Struct, frozen=True, tag=True):
    code: str  # oversized | malformed | unknown_kind | unauthenticated | version | refused | internal
    message: str


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

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _mac(secret: bytes | None, body: bytes) -> bytes:
    return b"" if not secret else hmac.new(secret, body, hashlib.sha256).digest()


def _union(types: Iterable[type]) -> Any:
    types = tuple(types)
    return types[0] if len(types) == 1 else Union[types]  # noqa: UP007 - a runtime union of struct types


_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_encoder = msgspec.msgpack.Encoder()

Handler = Callable[[Any, bytes], msgspec.Struct]


class SideChannelServer:
    """A ROUTER socket served by one thread. ``handlers`` maps a message type to ``fn(message, peer_id) -> reply``.

    Handlers run on the server thread: keep them short (enqueue work elsewhere).
    """

    def __init__(
        self,
        handlers: dict[type, Handler],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        secret: bytes | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        poll_ms: int = 50,
        name: str = "sidechannel",
    ) -> None:
        self.handlers = {Ping: lambda _m, _p: Ack(), **handlers}
        self._decoder = msgspec.msgpack.Decoder(_union(self.handlers))
        self.secret = secret
        self.max_bytes = int(max_bytes)
        self.poll_ms = poll_ms
        self.refused: dict[str, int] = {}
        self.served = 0
        self._ctx = zmq.Context.instance()
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

    def _refuse(self, code: str, message: str) -> ErrorReply:
        self.refused[code] = self.refused.get(code, 0) + 1
        log.warning("side channel refused a message (%s): %s", code, message)
        return ErrorReply(code, message)

    def handle_frame(self, payload: bytes, peer: bytes) -> tuple[int, msgspec.Struct]:
        """Decode, authenticate and dispatch one frame. Returns (request id, reply)."""
        if len(payload) > self.max_bytes:
            return 0, self._refuse("oversized", f"{len(payload)} bytes > cap {self.max_bytes}")
        try:
            env = _envelope_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return 0, self._refuse("malformed", f"not a side-channel envelope: {exc}")
        if env.version != WIRE_VERSION:
            return env.rid, self._refuse("version", f"wire version {env.version}, this side speaks {WIRE_VERSION}")
        if self.secret and not hmac.compare_digest(env.mac, _mac(self.secret, env.body)):
            return env.rid, self._refuse("unauthenticated", "missing or wrong HMAC")
        try:
            message = self._decoder.decode(env.body)
        except msgspec.ValidationError as exc:
            unknown = "Invalid value" in str(exc) and "$.type" in str(exc)
            return env.rid, self._refuse("unknown_kind" if unknown else "malformed", str(exc))
        except msgspec.DecodeError as exc:
            return env.rid, self._refuse("malformed", str(exc))
        try:
            reply = self.handlers[type(message)](message, peer)
        except SideChannelRefused as exc:
            return env.rid, self._refuse(exc.code, exc.message)
        except Exception as exc:
            log.exception("side-channel handler for %s failed", type(message).__name__)
            return env.rid, self._refuse("internal", f"{type(exc).__name__}: {exc}")
        self.served += 1
        return env.rid, reply

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self.poll_ms):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            except zmq.ZMQError as exc:
                log.warning("side channel recv failed: %s", exc)
                continue
            if len(frames) != 2:
                # a REQ-style client sends an empty delimiter; anything else is malformed
                frames = [frames[0], frames[-1]] if len(frames) > 2 and frames[-2] == b"" else frames
                if len(frames) != 2:
                    self._refuse("malformed", f"{len(frames)} frames")
                    continue
            peer, payload = frames
            rid, reply = self.handle_frame(payload, peer)
            body = _encoder.encode(reply)
            out = _encoder.encode(Envelope(WIRE_VERSION, rid, body, _mac(self.secret, body)))
            try:
                self._sock.send_multipart([peer, out], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("side channel reply dropped: %s", exc)
        self._sock.close(0)

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


class SideChannelClient:
    """A DEALER socket to one server. Thread-safe (one request at a time); every wait bounded by ``timeout_s``."""

    def __init__(
        self,
        address: str,
        reply_types: Iterable[type],
        *,
        secret: bytes | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        self.address = address
        self.secret = secret
        self.timeout_s = float(timeout_s)
        self.max_bytes = int(max_bytes)
        self._decoder = msgspec.msgpack.Decoder(_union({ErrorReply, Ack, *reply_types}))
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._rid = 0
        self._sock: zmq.Socket | None = None
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
            frame = _encoder.encode(Envelope(WIRE_VERSION, rid, body, _mac(self.secret, body)))
            return self._exchange(frame, rid, timeout_s)

    def request_raw(self, frame: bytes, timeout_s: float | None = None) -> Any:
        """Send an arbitrary frame (tests: malformed input) and return the decoded reply."""
        with self._lock:
            return self._exchange(frame, None, timeout_s)

    def _exchange(self, frame: bytes, rid: int | None, timeout_s: float | None) -> Any:
        assert self._sock is not None
        if len(frame) > self.max_bytes:
            raise SideChannelError(f"message of {len(frame)} bytes exceeds cap {self.max_bytes}")
        self._sock.send(frame)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self._sock.poll(left_ms, zmq.POLLIN):
                self._open()  # drop whatever reply may still arrive late
                raise SideChannelTimeout(f"no reply from {self.address} in {timeout_s or self.timeout_s}s")
            raw = self._sock.recv()
            try:
                env = _envelope_decoder.decode(raw)
            except msgspec.DecodeError as exc:
                raise SideChannelError(f"malformed reply from {self.address}: {exc}") from exc
            if rid is not None and env.rid != rid and env.rid != 0:
                continue  # a late reply to an earlier, timed-out request
            if self.secret and not hmac.compare_digest(env.mac, _mac(self.secret, env.body)):
                raise SideChannelRefused("unauthenticated", f"reply from {self.address} failed HMAC")
            try:
                reply = self._decoder.decode(env.body)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise SideChannelError(f"unexpected reply from {self.address}: {exc}") from exc
            if isinstance(reply, ErrorReply):
                raise SideChannelRefused(reply.code, reply.message)
            return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None


def encode_envelope(message: msgspec.Struct, *, rid: int = 1, secret: bytes | None = None) -> bytes:
    body = _encoder.encode(message)
    return _encoder.encode(Envelope(WIRE_VERSION, rid, body, _mac(secret, body)))
