"""The P/D proxy against small in-process HTTP doubles of a prefill and a decode server (fast; the real-vLLM
end-to-end runs are in tests/vllm/)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvlifecycle.tools.proxy import PDProxy, ProxyConfig, ResponseEnd, Upstream


class FakeServer:
    """Answers POSTs: a prefill double returns kv_transfer_params; a decode double streams SSE chunks."""

    def __init__(self, role: str, name: str, linger_s: float = 0.0) -> None:
        self.role, self.name = role, name
        self.bodies: list[dict] = []
        self.port = 0
        # after a whole answer, keep the connection open up to this long (uvicorn's keep-alive close comes later)
        self.linger_s = linger_s
        self.closed_by_peer: list[bool] = []  # per lingering answer: the proxy closed first

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        if self.role in ("prefill", "no-connector"):
            answer: dict = {"choices": [{"text": "x"}]}
            if self.role == "prefill":
                answer["kv_transfer_params"] = {"remote_request_id": f"{self.name}-{len(self.bodies)}",
                                                "do_remote_prefill": True}
            payload = json.dumps(answer).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        elif not body.get("stream"):
            payload = json.dumps({"choices": [{"text": " a b c" + self.name}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                         + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for piece in (" a", " b", " c"):
                event = f"data: {json.dumps({'choices': [{'text': piece + self.name}]})}\n\n".encode()
                writer.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                await writer.drain()
            done = b"data: [DONE]\n\n"
            writer.write(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
        await writer.drain()
        if self.linger_s:
            try:
                self.closed_by_peer.append(await asyncio.wait_for(reader.read(), self.linger_s) == b"")
            except asyncio.TimeoutError:
                self.closed_by_peer.append(False)
        writer.close()


@contextmanager
def running(prefill: list[FakeServer], decode: list[FakeServer], dead_decode: int | None = None,
            dead_prefill: int | None = None, layerwise: bool = False) -> Iterator[int]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    async def main() -> None:
        for server in prefill + decode:
            srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
            server.port = srv.sockets[0].getsockname()[1]
        decode_ports = [s.port for s in decode] + ([dead_decode] if dead_decode else [])
        prefill_ports = ([dead_prefill] if dead_prefill else []) + [s.port for s in prefill]
        config = ProxyConfig(tuple(Upstream("127.0.0.1", p) for p in prefill_ports),
                             tuple(Upstream("127.0.0.1", p) for p in decode_ports), connect_timeout_s=2.0,
                             prefill_timeout_s=10.0, decode_idle_timeout_s=10.0,
                             layerwise=("127.0.0.1:9",) * len(prefill_ports) if layerwise else ())
        proxy = PDProxy(config)
        state["port"] = await proxy.start("127.0.0.1", 0)
        state["proxy"] = proxy
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield state["port"]
    finally:
        asyncio.run_coroutine_threadsafe(state["proxy"].close(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def post(port: int, path: str, body: dict) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def dead_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # nothing listens once the socket is closed


def test_prefill_gets_one_token_and_decode_gets_its_params_then_streams_back() -> None:
    p, d = FakeServer("prefill", "P"), FakeServer("decode", "D")
    with running([p], [d]) as port:
        status, raw = post(port, "/v1/completions",
                           {"model": "m", "prompt": "hi", "max_tokens": 20, "stream": True})
    assert status == 200
    assert p.bodies[0]["max_tokens"] == 1 and p.bodies[0]["stream"] is False
    assert p.bodies[0]["kv_transfer_params"]["do_remote_decode"] is True
    assert d.bodies[0]["kv_transfer_params"] == {"remote_request_id": "P-1", "do_remote_prefill": True}
    assert d.bodies[0]["max_tokens"] == 20 and d.bodies[0]["stream"] is True
    assert b" aD" in raw and b"[DONE]" in raw


def test_round_robin_over_prefill_and_decode_servers() -> None:
    ps = [FakeServer("prefill", f"P{i}") for i in range(2)]
    ds = [FakeServer("decode", f"D{i}") for i in range(2)]
    with running(ps, ds) as port:
        for _ in range(4):
            status, _ = post(port, "/v1/chat/completions",
                             {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
            assert status == 200
    assert [len(s.bodies) for s in ps + ds] == [2, 2, 2, 2]


def test_every_decode_server_reads_from_every_prefill_server() -> None:
    """Two P and two D: round robin on both sides in lockstep would pair P0 with D0 and P1 with D1 forever."""
    ps = [FakeServer("prefill", f"P{i}") for i in range(2)]
    ds = [FakeServer("decode", f"D{i}") for i in range(2)]
    with running(ps, ds) as port:
        for _ in range(8):
            status, _ = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
            assert status == 200
    assert [len(s.bodies) for s in ps + ds] == [4, 4, 4, 4]
    for d in ds:
        sources = {body["kv_transfer_params"]["remote_request_id"].split("-")[0] for body in d.bodies}
        assert sources == {"P0", "P1"}, d.name


def test_a_dead_prefill_server_is_skipped() -> None:
    """A P that refuses connections (killed, restarting) gets no request; the live P takes its turns."""
    p, d = FakeServer("prefill", "P"), FakeServer("decode", "D")
    with running([p], [d], dead_prefill=dead_port()) as port:
        for _ in range(4):
            status, _ = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
            assert status == 200
    assert len(p.bodies) == 4


def test_a_dead_decode_server_is_skipped_and_all_dead_is_a_clear_503_before_any_prefill() -> None:
    p, d = FakeServer("prefill", "P"), FakeServer("decode", "D")
    with running([p], [d], dead_decode=dead_port()) as port:
        for _ in range(3):
            status, _ = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
            assert status == 200  # the dead one is skipped
    prefilled = len(p.bodies)
    with running([p], [], dead_decode=dead_port()) as port:
        status, raw = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
    assert status == 503
    assert len(p.bodies) == prefilled  # P never prefilled (and pinned) for a request no D could take
    error = json.loads(raw)["error"]
    assert "decode" in error["message"] and error["type"] == "upstream_unavailable"


def test_malformed_body_is_a_400_and_prefill_without_params_is_a_502() -> None:
    p, d = FakeServer("prefill", "P"), FakeServer("decode", "D")
    with running([p], [d]) as port:
        import http.client

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("POST", "/v1/completions", body=b"{not json", headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 400 and b"not JSON" in resp.read()
        conn.close()
    plain = FakeServer("no-connector", "plain")  # a server started without --kv-transfer-config
    with running([plain], [d]) as port:
        status, raw = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2})
    assert status == 502 and b"kv_transfer_params" in raw


@pytest.mark.parametrize(("layerwise", "stream"), [(False, True), (False, False), (True, True), (True, False)])
def test_an_answer_that_ended_is_not_cancelled_when_the_client_closes_after_it(
    layerwise: bool, stream: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """D keeps its connection open a moment after a whole answer (SSE or JSON): the proxy ends the relay at the
    answer's end instead of at D's EOF, so the client closing once it read the answer is not a client going away
    (with ``--layerwise`` that cancelled the finished request on D and P and logged it)."""
    p, d = FakeServer("prefill", "P"), FakeServer("decode", "D", linger_s=3.0)
    caplog.set_level(logging.INFO, logger="kvlifecycle.proxy")
    with running([p], [d], layerwise=layerwise) as port:
        for _ in range(2):
            status, raw = post(port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 3,
                                                         "stream": stream})
            assert status == 200 and b" cD" in raw
            assert (b"[DONE]" in raw) is stream
        deadline = time.monotonic() + 10
        while len(d.closed_by_peer) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert d.closed_by_peer == [True, True]  # the proxy hung up on D once the answer was through
    assert not [r.getMessage() for r in caplog.records if "went away" in r.getMessage()]


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5;x=1\r\nhello\r\n1\r\n0\r\n0\r\nT: 1\r\n\r\n",
    b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n0\r\n\r\nab",
    b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n",
])
def test_response_end_is_found_at_the_last_byte_however_the_bytes_arrive(answer: bytes) -> None:
    for cut in range(1, len(answer)):
        end = ResponseEnd()
        assert not end.feed(answer[:cut]), cut
        assert end.feed(answer[cut:]), cut
    bytewise = ResponseEnd()
    assert [bytewise.feed(answer[i:i + 1]) for i in range(len(answer))] == [False] * (len(answer) - 1) + [True]


def test_an_answer_without_framing_ends_only_at_eof() -> None:
    end = ResponseEnd()
    assert not end.feed(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
    assert not end.feed(b"0\r\n\r\n" * 3)


@pytest.mark.parametrize("text", ["127.0.0.1", "host:", ":80", "h:p"])
def test_upstream_parse_refuses_bad_addresses(text: str) -> None:
    with pytest.raises(ValueError):
        Upstream.parse(text)
