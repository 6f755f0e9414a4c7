"""An OpenAI-compatible prefill/decode proxy (stdlib asyncio only; no engine, no HTTP library).

Each completion request goes to a prefill server (P) with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; P answers with the ``kv_transfer_params`` that name its KV
blocks (and, with kvlifecycle, the lease). The proxy forwards those to a decode server (D) together with the
original request and streams D's answer back unchanged (SSE or JSON). P and D are picked round-robin; a server
that refuses the connection is skipped for the next one; if none answers the client gets a 502/503 JSON error that
names the side and the addresses tried.

Only HTTP/1.1 with ``Content-Length`` or chunked bodies is spoken, which is what OpenAI clients and vLLM's
uvicorn servers use. Every upstream wait is bounded (connect and read timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from kvlifecycle.tools.proxy_errors import ProxyError

__all__ = ["PDProxy", "ProxyConfig", "ProxyError", "Upstream", "serve"]

log = logging.getLogger("kvlifecycle.proxy")

PD_ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> Upstream:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    prefill: tuple[Upstream, ...]
    decode: tuple[Upstream, ...]
    connect_timeout_s: float = 10.0
    # Prefill of one prompt; generous because CPU prefill of long prompts is slow, but bounded.
    prefill_timeout_s: float = 600.0
    # Longest silence while streaming the decode answer.
    decode_idle_timeout_s: float = 600.0
    # Layer-wise streaming: each prefill server's side channel (HOST:PORT, in --prefill order); empty: off
    layerwise: tuple[str, ...] = ()


@dataclass(slots=True)
class HttpMessage:
    start_line: str
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        lname = name.lower()
        for key, value in self.headers:
            if key.lower() == lname:
                return value
        return None


async def _read_head(reader: asyncio.StreamReader) -> HttpMessage | None:
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None  # the peer closed an idle connection
        raise ProxyError(400, "truncated HTTP head") from exc
    except asyncio.LimitOverrunError as exc:
        raise ProxyError(431, "HTTP head too large") from exc
    lines = raw.decode("latin-1").split("\r\n")
    message = HttpMessage(lines[0])
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise ProxyError(400, f"malformed header line {line!r}")
        message.headers.append((name.strip(), value.strip()))
    return message


async def _read_body(reader: asyncio.StreamReader, message: HttpMessage, to_eof: bool) -> bytes:
    length = message.header("content-length")
    if length is not None:
        if not length.isdigit() or int(length) > MAX_BODY_BYTES:
            raise ProxyError(400, f"bad Content-Length {length!r}")
        return await reader.readexactly(int(length))
    if (message.header("transfer-encoding") or "").lower() == "chunked":
        chunks = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # trailers are not used by OpenAI servers
                return bytes(chunks)
            chunks += await reader.readexactly(size)
            await reader.readexactly(2)
            if len(chunks) > MAX_BODY_BYTES:
                raise ProxyError(413, "body too large")
    return await reader.read(MAX_BODY_BYTES) if to_eof else b""


class ResponseEnd:
    """Follows the framing of an HTTP/1.1 response relayed byte for byte, to tell when its last byte went by.

    D's connection may stay open a moment after its answer is complete; a relay that waits for D's EOF instead
    sees the client, which has its whole answer, close first, and takes that for a client going away (under
    ``--layerwise`` it then cancelled the finished request on D and P). Framing: ``Content-Length``, chunked (with
    trailers), no body (1xx interim answers are skipped, 204 and 304 end at their head), else the answer ends at
    EOF (never here)."""

    _HEAD, _LENGTH, _SIZE, _CHUNK, _TRAILER, _EOF, _DONE = range(7)

    def __init__(self) -> None:
        self._state = self._HEAD
        self._pending = bytearray()  # the part of a head, chunk-size or trailer line read so far
        self._left = 0  # bytes of the body (or of the chunk and its CRLF) still to come

    @property
    def complete(self) -> bool:
        return self._state == self._DONE

    @property
    def whole_at_eof(self) -> bool:
        """Whether the answer is whole if the connection ends here (complete, or framed by EOF alone)."""
        return self._state in (self._DONE, self._EOF)

    def feed(self, data: bytes) -> bool:
        """Take the next bytes of the answer; True once it is complete (what follows is not looked at)."""
        if self._state in (self._EOF, self._DONE):
            return self.complete
        self._pending += data
        while self._state not in (self._EOF, self._DONE):
            if self._state in (self._LENGTH, self._CHUNK):
                take = min(self._left, len(self._pending))
                del self._pending[:take]
                self._left -= take
                if self._left:
                    return False
                self._state = self._DONE if self._state == self._LENGTH else self._SIZE
                continue
            marker = b"\r\n\r\n" if self._state == self._HEAD else b"\r\n"
            end = self._pending.find(marker)
            if end < 0:
                if len(self._pending) > MAX_HEADER_BYTES:
                    self._state = self._EOF  # not a framing this follows: the answer ends at EOF
                return False
            line = bytes(self._pending[:end])
            del self._pending[:end + len(marker)]
            if self._state == self._HEAD:
                self._state, self._left = self._framing(line.decode("latin-1"))
            elif self._state == self._SIZE:
                try:
                    size = int(line.split(b";")[0].strip(), 16)
                except ValueError:
                    self._state = self._EOF
                    continue
                self._state, self._left = (self._CHUNK, size + 2) if size else (self._TRAILER, 0)
            elif not line:  # the empty line after the trailers
                self._state = self._DONE
        self._pending.clear()
        return self.complete

    @classmethod
    def _framing(cls, head: str) -> tuple[int, int]:
        lines = head.split("\r\n")
        try:
            status = int(lines[0].split(" ", 2)[1])
        except (IndexError, ValueError):
            return cls._EOF, 0
        if 100 <= status < 200:
            return cls._HEAD, 0  # an interim answer: the real head follows
        if status in (204, 304):
            return cls._DONE, 0
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return cls._SIZE, 0
        length = headers.get("content-length", "")
        if length.isdigit():
            return (cls._LENGTH, int(length)) if int(length) else (cls._DONE, 0)
        return cls._EOF, 0


def _json_response(status: int, payload: dict[str, object]) -> bytes:
    body = json.dumps(payload).encode()
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large",
              431: "Request Header Fields Too Large", 502: "Bad Gateway", 503: "Service Unavailable",
              504: "Gateway Timeout"}.get(status, "Error")
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def _error(status: int, message: str, kind: str) -> bytes:
    return _json_response(status, {"error": {"message": message, "type": kind, "code": status}})


def _prefill_order(prefill: int, decode: int) -> Iterator[int]:
    """Round robin over the prefill servers, shifted by one after every ``lcm(prefill, decode)`` requests: two
    cycles in lockstep would pair prefill server i with decode server i forever (equal counts), so no decode
    server would ever read from another prefill server."""
    prefill, decode = max(prefill, 1), max(decode, 1)  # none yet (discovery): the index is never used
    period = math.lcm(prefill, decode)
    for n in itertools.count():
        yield (n + n // period) % prefill


class PDProxy:
    """The proxy server. ``await start()``, then ``await serve_forever()`` or ``await close()``."""

    def __init__(self, config: ProxyConfig, *, discovered: bool = False) -> None:
        if not discovered and (not config.prefill or not config.decode):
            raise ValueError("the proxy needs at least one --prefill and one --decode server")
        self.config = config
        self._next_prefill = _prefill_order(len(config.prefill), len(config.decode))
        self._next_decode = itertools.cycle(range(max(len(config.decode), 1)))
        self._server: asyncio.base_events.Server | None = None

    def set_upstreams(self, prefill: tuple[Upstream, ...], decode: tuple[Upstream, ...]) -> None:
        """Route over these servers from now on (discovery calls it on the event loop; requests under way keep
        the server they picked)."""
        if (prefill, decode) == (self.config.prefill, self.config.decode):
            return
        self.config = dataclasses.replace(self.config, prefill=prefill, decode=decode)
        self._next_prefill = _prefill_order(len(prefill), len(decode))
        self._next_decode = itertools.cycle(range(max(len(decode), 1)))

    # -- what the layer-wise mode (kvlifecycle.tools.proxy_layerwise) builds its requests from -----------------------
    def next_prefill(self) -> int:
        """The index of the prefill server the next request goes to (round-robin, spread over the decode servers)."""
        return next(self._next_prefill)

    async def open_decode(self) -> tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the next decode server that answers; :class:`ProxyError` if none does."""
        return await self._open("decode", self.config.decode, self._next_decode)

    async def post_prefill(self, index: int, path: str, body: dict[str, object],
                           request_id: str) -> dict[str, object]:
        """``body`` posted to prefill server ``index`` (no other: its side channel is the one D was told), its JSON
        answer returned; :class:`ProxyError` for any failure."""
        return await self._post_json("prefill", (self.config.prefill[index],), itertools.cycle([0]), path, body,
                                     request_id)

    async def relay_decode(self, path: str, body: dict[str, object], request_id: str, client: asyncio.StreamWriter,
                           decode: tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter]) -> bool:
        """Send ``body`` over ``decode`` and relay D's answer to ``client``; True once it went through whole."""
        return await self._stream_decode(path, body, request_id, client, decode)

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEADER_BYTES)
        return self._server.sockets[0].getsockname()[1]

    async def serve_forever(self) -> None:
        assert self._server is not None
        async with self._server:
            await self._server.serve_forever()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    # -- one client connection ---------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await _read_head(reader)
            if request is None:
                return
            request.body = await _read_body(reader, request, to_eof=False)
            method, _, rest = request.start_line.partition(" ")
            path = rest.split(" ", 1)[0].split("?", 1)[0]
            if path in PD_ROUTES:
                if method != "POST":
                    writer.write(_error(405, f"{path} takes POST", "invalid_request_error"))
                else:
                    await self._pd_request(path, request, writer, reader)
            elif path == "/health" or path == "/v1/health":
                writer.write(await self._health())
            elif method == "GET" and path.startswith("/v1/"):
                await self._forward_get(path, writer)
            else:
                writer.write(_error(404, f"no route {method} {path}", "invalid_request_error"))
        except ProxyError as exc:
            log.warning("request failed: %s", exc.message)
            with contextlib.suppress(ConnectionError):
                writer.write(_error(exc.status, exc.message, exc.kind))
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                await writer.drain()
                writer.close()
                await writer.wait_closed()

    async def _pd_request(self, path: str, request: HttpMessage, writer: asyncio.StreamWriter,
                          reader: asyncio.StreamReader) -> None:
        try:
            body = json.loads(request.body or b"{}")
        except json.JSONDecodeError as exc:
            raise ProxyError(400, f"request body is not JSON: {exc}", "invalid_request_error") from exc
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", "invalid_request_error")
        request_id = request.header("x-request-id") or f"kvl-{uuid.uuid4().hex}"
        if self.config.layerwise:  # D reserves first, then P streams its layers (kvlifecycle.tools.proxy_layerwise)
            from kvlifecycle.tools.proxy_layerwise import pd_request

            await pd_request(self, path, body, request_id, writer, reader)
            return

        prefill_body = dict(body)
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                            "do_remote_prefill": False})
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        # Reach a decode server first: with none up, P must not prefill and pin blocks that nobody will read.
        decode = await self._open("decode", self.config.decode, self._next_decode)
        try:
            served_by: list[Upstream] = []
            prefill = await self._post_json("prefill", self.config.prefill, self._next_prefill, path,
                                            prefill_body, request_id, served_by)
            params = prefill.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise ProxyError(502, "prefill server answered without kv_transfer_params: is it started with a "
                                      "KV connector (--kv-transfer-config)?")
            decode_body = dict(body)
            decode_body["kv_transfer_params"] = params
        except BaseException:
            decode[2].close()
            raise
        await self._stream_decode(path, decode_body, request_id, writer, decode,
                                  granted_by=f"prefill server {served_by[0]}")

    async def _decode_failed(self, upstream: Upstream, reader: asyncio.StreamReader, data: bytes, request_id: str,
                             body: dict[str, object], granted_by: str) -> ProxyError:
        """D answered a 5xx: its error, and where the handoff's cause is (D's log line carries the request id)."""
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError, OSError):
            while len(data) < 8192:  # D was asked to close after its answer: read to its end, bounded
                more = await asyncio.wait_for(reader.read(8192), self.config.decode_idle_timeout_s)
                if not more:
                    break
                data += more
        code = data[9:12]
        status = int(code) if code.isdigit() else 502
        answer = data.partition(b"\r\n\r\n")[2][:2000].decode(errors="replace").strip()
        with contextlib.suppress(ValueError, LookupError, TypeError):
            answer = str(json.loads(answer)["error"]["message"])  # vLLM's error object: its message alone
        params = body.get("kv_transfer_params")
        remote = params.get("remote_request_id") if isinstance(params, dict) else None
        return ProxyError(status, f"decode server {upstream} answered {status} for request {request_id} after "
                                  f"{granted_by} granted its KV{f' (as {remote})' if remote else ''}: "
                                  f"{answer or '(no body)'}. A failed KV load is the usual cause; vLLM passes no "
                                  f"connector reason to the client: the decode server's log line 'KV load of "
                                  f"...{request_id}... failed' or '... not started' names it (docs/troubleshooting.md)",
                          "kv_load_failed")

    async def _open(self, side: str, servers: Sequence[Upstream],
                    order: Iterator[int]) -> tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the next server of one side, skipping those that refuse; ProxyError if none answers."""
        if not servers:
            raise ProxyError(503, f"no {side} server registered", "upstream_unavailable")
        first = next(order)
        tried: list[str] = []
        for offset in range(len(servers)):
            upstream = servers[(first + offset) % len(servers)]
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(upstream.host, upstream.port, limit=MAX_HEADER_BYTES),
                    self.config.connect_timeout_s,
                )
            except (OSError, asyncio.TimeoutError) as exc:
                tried.append(f"{upstream} ({exc.__class__.__name__}: {exc})")
                continue
            return upstream, reader, writer
        raise ProxyError(503, f"no {side} server reachable; tried {', '.join(tried)}", "upstream_unavailable")

    @staticmethod
    def _request_bytes(upstream: Upstream, path: str, body: dict[str, object], request_id: str) -> bytes:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {upstream}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nX-Request-Id: {request_id}\r\nConnection: close\r\n\r\n"
        )
        return head.encode() + payload

    async def _post_json(self, side: str, servers: Sequence[Upstream], order: Iterator[int], path: str,
                         body: dict[str, object], request_id: str,
                         served_by: list[Upstream] | None = None) -> dict[str, object]:
        upstream, reader, writer = await self._open(side, servers, order)
        if served_by is not None:
            served_by.append(upstream)
        try:
            writer.write(self._request_bytes(upstream, path, body, request_id))
            await writer.drain()

            async def answer() -> tuple[HttpMessage, bytes]:
                head = await _read_head(reader)
                if head is None:
                    raise ProxyError(502, f"{side} server {upstream} closed the connection without answering")
                return head, await _read_body(reader, head, to_eof=True)

            head, payload = await asyncio.wait_for(answer(), self.config.prefill_timeout_s)
        except asyncio.TimeoutError as exc:
            raise ProxyError(504, f"{side} server {upstream} did not answer within "
                                  f"{self.config.prefill_timeout_s:.0f} s", "upstream_timeout") from exc
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise ProxyError(502, f"{side} server {upstream} dropped the connection: {exc}") from exc
        finally:
            writer.close()
        status = int(head.start_line.split(" ", 2)[1])
        if status != 200:
            raise ProxyError(status if 400 <= status < 600 else 502,
                             f"{side} server {upstream} answered {status}: {payload[:500].decode(errors='replace')}")
        try:
            return json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ProxyError(502, f"{side} server {upstream} answered non-JSON: {exc}") from exc

    async def _stream_decode(self, path: str, body: dict[str, object], request_id: str,
                             client: asyncio.StreamWriter,
                             decode: tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter],
                             granted_by: str = "prefill server") -> bool:
        """Relay D's answer to the client; True once it went through whole. A server error from D before any byte
        went out is answered with what the proxy knows of the handoff (vLLM passes no connector reason on)."""
        upstream, reader, writer = decode
        idle = self.config.decode_idle_timeout_s
        try:
            writer.write(self._request_bytes(upstream, path, body, request_id))
            await writer.drain()
            # Relay D's answer byte for byte (status, headers, chunked framing) up to its last byte (ResponseEnd),
            # or D's EOF (it was asked for Connection: close) if its framing does not say.
            first = True
            end = ResponseEnd()
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(65536), idle)
                except asyncio.TimeoutError as exc:
                    if first:
                        raise ProxyError(504, f"decode server {upstream} sent nothing for {idle:.0f} s",
                                         "upstream_timeout") from exc
                    log.warning("decode server %s went silent for %.0f s; closing the stream", upstream, idle)
                    return False
                if not data:
                    if first:
                        raise ProxyError(502, f"decode server {upstream} closed the connection without answering")
                    return end.whole_at_eof
                if first and data[:10] in (b"HTTP/1.1 5", b"HTTP/1.0 5"):
                    raise await self._decode_failed(upstream, reader, data, request_id, body, granted_by)
                first = False
                client.write(data)
                await client.drain()
                if end.feed(data):
                    return True
        except (ConnectionResetError, BrokenPipeError) as exc:
            if first:
                raise ProxyError(502, f"decode server {upstream} dropped the connection: {exc}") from exc
            return False
        finally:
            writer.close()

    async def _health(self) -> bytes:
        async def probe(upstream: Upstream) -> bool:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(upstream.host, upstream.port),
                                                   self.config.connect_timeout_s)
            except (OSError, asyncio.TimeoutError):
                return False
            writer.close()
            return True

        prefill = await asyncio.gather(*(probe(u) for u in self.config.prefill))
        decode = await asyncio.gather(*(probe(u) for u in self.config.decode))
        status = 200 if any(prefill) and any(decode) else 503
        return _json_response(status, {
            "prefill": {str(u): ok for u, ok in zip(self.config.prefill, prefill, strict=True)},
            "decode": {str(u): ok for u, ok in zip(self.config.decode, decode, strict=True)},
        })

    async def _forward_get(self, path: str, client: asyncio.StreamWriter) -> None:
        upstream, reader, writer = await self._open("decode", self.config.decode, self._next_decode)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {upstream}\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()

            async def relay() -> None:
                while data := await reader.read(65536):
                    client.write(data)

            await asyncio.wait_for(relay(), self.config.connect_timeout_s * 3)
        except asyncio.TimeoutError as exc:
            raise ProxyError(504, f"decode server {upstream} did not answer GET {path}", "upstream_timeout") from exc
        finally:
            writer.close()


async def serve(config: ProxyConfig, host: str, port: int, ready: asyncio.Event | None = None) -> None:
    proxy = PDProxy(config)
    bound = await proxy.start(host, port)
    log.info("kvlifecycle proxy on %s:%d; prefill %s; decode %s", host, bound,
             ", ".join(map(str, config.prefill)), ", ".join(map(str, config.decode)))
    if ready is not None:
        ready.set()
    await proxy.serve_forever()
