"""A decode server's 5xx (vLLM's generic answer to a failed KV load) reaches the client through the proxy with
what the proxy knows: the decode and prefill servers, the request id, and where the cause is logged. A fast double
of the servers; the real vLLM run is tests/vllm/test_vllm_pd.py (a failed load through the proxy)."""

from __future__ import annotations

import asyncio
import json

from test_proxy import FakeServer, post, running

VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError", "param": None,
                        "code": 500}}


class FailingDecode(FakeServer):
    """Answers every POST as vLLM does a request whose KV load failed under kv_load_failure_policy fail."""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        self.bodies.append(json.loads(await reader.readexactly(length)))
        payload = json.dumps(VLLM_ERROR).encode()
        writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        writer.close()


def test_a_failed_decode_names_both_servers_the_request_and_where_its_cause_is() -> None:
    p, d = FakeServer("prefill", "P"), FailingDecode("decode", "D")
    with running([p], [d]) as port:
        status, raw = post(port, "/v1/completions", {"prompt": "x", "max_tokens": 4})
    assert status == 500
    error = json.loads(raw)["error"]
    assert error["type"] == "kv_load_failed" and error["code"] == 500
    message = error["message"]
    assert f"decode server 127.0.0.1:{d.port} answered 500" in message
    assert f"prefill server 127.0.0.1:{p.port} granted its KV (as P-1)" in message
    request_id = message.split("for request ", 1)[1].split()[0]
    assert request_id.startswith("kvl-") and f"KV load of ...{request_id}..." in message
    assert "Internal server error" in message and "docs/troubleshooting.md" in message
    assert d.bodies[0]["kv_transfer_params"]["remote_request_id"] == "P-1"
