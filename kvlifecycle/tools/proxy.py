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
import itertools
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("kvlifecycle.proxy")

PD_ROUTES = ("/v1/completions", "/v1/chat/completions")
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "te", "upgrade"}


class ProxyError(Exception):
    """An upstream failure with the HTTP status and message the client should see."""

    def __init__(self, status: int, message: str, kind: str = "upstream_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


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


class PDProxy:
    """The proxy server. ``await start()``, then ``await serve_forever()`` or ``await close()``."""

    def __init__(self, config: ProxyConfig) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("the proxy needs at least one --prefill and one --decode server")
        self.config = config
        self._next_prefill = itertools.cycle(range(len(config.prefill)))
        self._next_decode = itertools.cycle(range(len(config.decode)))
        self._server: asyncio.base_events.Server | None = None

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
                    await self._pd_request(path, request, writer)
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

    async def _pd_request(self, path: str, request: HttpMessage, writer: asyncio.StreamWriter) -> None:
        try:
            body = json.loads(request.body or b"{}")
        except json.JSONDecodeError as exc:
            raise ProxyError(400, f"request body is not JSON: {exc}", "invalid_request_error") from exc
        if not isinstance(body, dict):
            raise ProxyError(400, "request body must be a JSON object", "invalid_request_error")
        request_id = request.header("x-request-id") or f"kvl-{uuid.uuid4().hex}"

        prefill_body = dict(body)
        prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                            "do_remote_prefill": False})
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in prefill_body:
            prefill_body["max_completion_tokens"] = 1
        # Reach a decode server first: with none up, P must not prefill and pin blocks that nobody will read.
        decode = await self._open("decode", self.config.decode, self._next_decode)
        try:
            prefill = await self._post_json("prefill", self.config.prefill, self._next_prefill, path,
                                            prefill_body, request_id)
            params = prefill.get("kv_transfer_params")
            if not isinstance(params, dict):
                raise ProxyError(502, "prefill server answered without kv_transfer_params: is it started with a "
                                      "KV connector (--kv-transfer-config)?")
            decode_body = dict(body)
            decode_body["kv_transfer_params"] = params
        except BaseException:
            decode[2].close()
            raise
        await self._stream_decode(path, decode_body, request_id, writer, decode)

    async def _open(self, side: str, servers: Sequence[Upstream],
                    order: itertools.cycle[int]) -> tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter]:
        """Connect to the next server of one side, skipping those that refuse; ProxyError if none answers."""
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

    async def _post_json(self, side: str, servers: Sequence[Upstream], order: itertools.cycle[int], path: str,
                         body: dict[str, object], request_id: str) -> dict[str, object]:
        upstream, reader, writer = await self._open(side, servers, order)
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
                             decode: tuple[Upstream, asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        upstream, reader, writer = decode
        idle = self.config.decode_idle_timeout_s
        try:
            writer.write(self._request_bytes(upstream, path, body, request_id))
            await writer.drain()
            # Relay D's answer byte for byte (status, headers, chunked framing): it asked for Connection: close,
            # so its answer ends at EOF, and so does ours.
            first = True
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(65536), idle)
                except asyncio.TimeoutError as exc:
                    if first:
                        raise ProxyError(504, f"decode server {upstream} sent nothing for {idle:.0f} s",
                                         "upstream_timeout") from exc
                    log.warning("decode server %s went silent for %.0f s; closing the stream", upstream, idle)
                    return
                if not data:
                    if first:
                        raise ProxyError(502, f"decode server {upstream} closed the connection without answering")
                    return
                first = False
                client.write(data)
                await client.drain()
        except (ConnectionResetError, BrokenPipeError) as exc:
            if first:
                raise ProxyError(502, f"decode server {upstream} dropped the connection: {exc}") from exc
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
