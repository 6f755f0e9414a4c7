"""The proxy's ``--layerwise`` mode: D reserves first, then P prefills while its layers stream into D.

Per request: a stream key; D gets the original request with ``kv_transfer_params`` naming P's side channel and the
key, and its answer starts streaming back to the client at once (D holds the request until its KV landed); the
prefill goes to P with the same key right after, without waiting for D's reservation to reach P: a reservation
that arrives while P's prefill is under way joins it (the layers computed so far leave at once). Only one that
arrives after P's prefill ended is a fallback (the post-prefill path, counted). Waiting here for the reservation
instead put D's whole path to its reservation (HTTP, tokenizer, scheduler step, side-channel round trip) before
P's first layer, on every request's TTFT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING

from kvlifecycle.tools.proxy_errors import ProxyError

if TYPE_CHECKING:
    from kvlifecycle.tools.proxy import PDProxy

log = logging.getLogger("kvlifecycle.proxy")

STREAM_KEY = "kvlifecycle_stream"  # the vLLM adapter's key (adapters/vllm/scheduler.py)


async def pd_request(proxy: PDProxy, path: str, body: dict[str, object], request_id: str,
                     writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> None:
    """One request, D first. A client that goes away ends both sides' requests at once (D's wait for its KV
    writes nothing to the client, so without watching its socket nothing would notice until D's first token). One
    that closes once it has D's whole answer has not gone away: P's answer may still be on its way."""
    answered = asyncio.Event()
    handoff = asyncio.ensure_future(_handoff(proxy, path, body, request_id, writer, answered))
    gone = asyncio.ensure_future(_until_eof(reader))
    try:
        await asyncio.wait({handoff, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not handoff.done() and not answered.is_set():
            log.info("request %s: the client went away; cancelling it on D and P", request_id)
            handoff.cancel()
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
    with contextlib.suppress(asyncio.CancelledError):
        await handoff  # its error, if any, is the request's


async def _until_eof(reader: asyncio.StreamReader) -> None:
    """Returns when the client closed its side (the request was read: anything after it is dropped)."""
    with contextlib.suppress(ConnectionError):
        while await reader.read(65536):
            pass


async def _handoff(proxy: PDProxy, path: str, body: dict[str, object], request_id: str,
                   writer: asyncio.StreamWriter, answered: asyncio.Event) -> None:
    index = proxy.next_prefill()
    side = proxy.config.layerwise[index]
    host, _, port = side.rpartition(":")
    key = f"stream-{uuid.uuid4().hex}"
    decode_body = dict(body)
    decode_body["kv_transfer_params"] = {"do_remote_prefill": True, "do_remote_decode": False,
                                         "remote_request_id": key, "remote_host": host, "remote_port": int(port),
                                         "tp_size": 1, STREAM_KEY: key}
    prefill_body = dict(body)
    prefill_body.update(stream=False, max_tokens=1, kv_transfer_params={"do_remote_decode": True,
                                                                        "do_remote_prefill": False, STREAM_KEY: key})
    prefill_body.pop("stream_options", None)
    decode = await proxy.open_decode()
    relay = asyncio.ensure_future(proxy.relay_decode(path, decode_body, request_id, writer, decode))

    def on_relayed(done: asyncio.Future[bool]) -> None:
        if not done.cancelled() and done.exception() is None and done.result():
            answered.set()  # the client has D's whole answer

    relay.add_done_callback(on_relayed)
    try:
        await proxy.post_prefill(index, path, prefill_body, request_id)
    except ProxyError as exc:
        if exc.status != 502:  # P answered an error: D's request is cancelled (its stream then settles)
            relay.cancel()
            raise
        # P was lost mid-request: D holds the request and settles it under its own bounds and failure policy (a
        # stream with no layer for its timeout fails; under ``recompute`` D prefills it itself)
        log.warning("request %s: %s; D settles it", request_id, exc.message)
    except BaseException:
        relay.cancel()
        raise
    await relay
