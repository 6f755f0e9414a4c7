"""Engine processes of the layer-wise fault tests: kvlifecycle from this checkout (as ``worktree_site``), and P's
streamer changed from outside the library, without a test hook in it:

- ``KVL_TEST_STREAM_FAIL_LAYER=k``: the post of layer ``k`` of every stream fails (a transport failure at layer k).
- ``KVL_TEST_STREAM_GATE_LAYER=k``: the first post of layer ``k`` of P's first stream waits (at most ``GATE_S``) until a
  cancel of that stream reached P (D's ``StreamCancel`` or P's own abort): the stream is mid-way, deterministically,
  while the test disconnects the client or kills P.
- ``KVL_TEST_STREAM_TRACE=path``: one line per fact, in order: ``gate T``, ``cancel T``, ``post T layer``,
  ``release KEY writes_in_flight``.
- ``KVL_TEST_CORRUPT_LANDED=n``: D's Consumer flips one byte of the first block that landed for each of its first
  ``n`` parts with digests to check, just before the check (bytes changed after they landed, as a bad lane would).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

_WORKTREE_SITE = Path(__file__).resolve().parents[2] / "sglang" / "worktree_site" / "sitecustomize.py"
exec(compile(_WORKTREE_SITE.read_text(), str(_WORKTREE_SITE), "exec"))  # this checkout's own file

GATE_S = 120.0
_FAIL = os.environ.get("KVL_TEST_STREAM_FAIL_LAYER")
_GATE = os.environ.get("KVL_TEST_STREAM_GATE_LAYER")
_TRACE = os.environ.get("KVL_TEST_STREAM_TRACE")

if _FAIL is not None or _GATE is not None or _TRACE is not None:
    from kvlifecycle.streaming import producer as _producer

    _lock = threading.Lock()
    _cancelled: set[str] = set()  # stream transfers whose cancel reached P
    _gated: set[str] = set()

    def _trace(line: str) -> None:
        if _TRACE:
            with _lock, open(_TRACE, "a") as out:
                out.write(line + "\n")

    _post_layer = _producer.StreamProducer._post_layer
    _on_stream_cancel = _producer.StreamProducer._on_stream_cancel
    _cancel = _producer.StreamProducer.cancel
    _release = _producer.StreamProducer.release

    def post_layer(self, stream, layer, src, *rest):  # type: ignore[no-untyped-def]  # rest: the layer's readiness
        transfer = stream.ask.transfer
        if _FAIL is not None and layer == int(_FAIL):
            self._halt(stream, f"post of layer {layer} failed: injected by the test")
            return None
        if _GATE is not None and layer == int(_GATE) and not _gated:  # the process's first stream only
            _gated.add(transfer)
            _trace(f"gate {transfer}")
            deadline = time.monotonic() + GATE_S
            while transfer not in _cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
        before = self.counts["layers_posted"]
        out = _post_layer(self, stream, layer, src, *rest)
        if self.counts["layers_posted"] > before:
            _trace(f"post {transfer} {layer}")
        return out

    def on_stream_cancel(self, msg, peer):  # type: ignore[no-untyped-def]
        _trace(f"cancel {msg.transfer}")
        ack = _on_stream_cancel(self, msg, peer)
        _cancelled.add(msg.transfer)
        return ack

    def streams_of(self, request):  # type: ignore[no-untyped-def]
        with self._lock:
            return self._of(request)  # one stream per D rank

    def cancel(self, request, reason="aborted on P"):  # type: ignore[no-untyped-def]
        streams = streams_of(self, request)
        for stream in streams:
            _trace(f"cancel {stream.ask.transfer}")
        _cancel(self, request, reason)
        for stream in streams:
            _cancelled.add(stream.ask.transfer)

    def release(self, request, then):  # type: ignore[no-untyped-def]
        streams = streams_of(self, request)

        def traced() -> None:  # the writes still in flight when P's blocks go back (0: none)
            _trace(f"release {request} {sum(len(stream.writes) for stream in streams)}")
            then()

        _release(self, request, traced)

    _producer.StreamProducer._post_layer = post_layer
    _producer.StreamProducer._on_stream_cancel = on_stream_cancel
    _producer.StreamProducer.cancel = cancel
    _producer.StreamProducer.release = release


_CORRUPT = os.environ.get("KVL_TEST_CORRUPT_LANDED")

if _CORRUPT is not None:
    import numpy as _np

    from kvlifecycle.handoff import consumer as _consumer

    _corrupt_left = [int(_CORRUPT)]
    _verified = _consumer.Consumer._verified

    def verified(self, load, part, read=None):  # type: ignore[no-untyped-def]
        _, grant, _ = load.parts[part]
        mapped = load.mapped.get(part)
        if _corrupt_left[0] > 0 and mapped is not None and grant.digests is not None and self.digester is not None:
            _corrupt_left[0] -= 1
            block = int(_np.asarray(mapped[0]).reshape(-1)[0])
            self.digester._groups[0][0][block, 0] ^= 0x10  # D's own KV cache, where the bytes landed
        return _verified(self, load, part, read)

    _consumer.Consumer._verified = verified
