"""Fuzz the notification path: ``decode_notification`` and the receiving end of the loopback and NIXL transports.
Any bytes in give a typed notification or one counted drop, never an exception out of the transport; a
legitimate notification right after is delivered intact."""

from __future__ import annotations

import time

import msgspec
import pytest
from fuzz_msgpack import FUZZ, hostile, tagged
from hypothesis import given
from hypothesis import strategies as st

from kvlifecycle.transport import (
    NOTIFICATION_MAX_BYTES,
    MalformedNotificationError,
    Notification,
    decode_notification,
    encode_notification,
)

LEGIT = Notification("req", "p.0001.7", 7, 3, "done", 1, b"\x01" * 16, 12345)
VALID = [encode_notification(LEGIT), encode_notification(Notification("r", "t", 0, kind="failed", payload=b"why"))]
FIELDS = ["request", "transfer", "generation", "epoch", "kind", "part", "payload", "hlc"]

as_arrays = st.lists(st.none() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20) | st.binary(max_size=20),
                     max_size=10).map(msgspec.msgpack.encode)
notification_bytes = st.one_of(as_arrays, hostile(VALID, tagged(["done", "failed"], FIELDS)),
                               st.binary(min_size=NOTIFICATION_MAX_BYTES - 2, max_size=NOTIFICATION_MAX_BYTES + 2))


@FUZZ
@given(raw=notification_bytes)
def test_decode_notification_is_total(raw: bytes) -> None:
    try:
        note = decode_notification(raw)
    except MalformedNotificationError:
        return
    assert isinstance(note, Notification)
    assert all(0 <= v < 2**63 for v in (note.generation, note.epoch, note.part, note.hlc))
    assert decode_notification(encode_notification(note)) == note  # what was accepted survives its own round trip


def test_decode_notification_refuses_deep_values_undecoded() -> None:
    """A ninth, unknown element is skipped by msgspec recursively (a RecursionError where the interpreter's stack
    limit is low enough, as on Python 3.11 here), unless refused before: it is refused, undecoded."""
    hidden = b"\x99" + encode_notification(Notification("r", "t", 1))[1:] + b"\x91" * 3000 + b"\xc0"
    with pytest.raises(MalformedNotificationError, match="deeper"):
        decode_notification(hidden)


def receiving_end(transport, sender: str) -> None:
    """Feed one transport's receiving end hostile bytes; each counts once, as a note or as a drop."""

    @FUZZ
    @given(raw=notification_bytes)
    def one(raw: bytes) -> None:
        before = transport.malformed_notifications
        transport.receive_raw(sender, raw)
        got = transport.notifications()
        assert len(got) + (transport.malformed_notifications - before) == 1
        transport.receive_raw(sender, encode_notification(LEGIT))  # and the next legitimate one arrives intact
        assert transport.notifications() == [(sender, LEGIT)]

    one()
    assert transport.malformed_notifications > 0


def test_loopback_receiving_end() -> None:
    pytest.importorskip("torch")
    from kvlifecycle.transports.loopback import LoopbackTransport

    t = LoopbackTransport(f"fuzz-loopback-{time.monotonic_ns()}")
    try:
        receiving_end(t, "peer")
    finally:
        t.close()


def test_loopback_oversized_notification_is_refused_before_the_copy() -> None:
    torch = pytest.importorskip("torch")
    from kvlifecycle.transports.loopback import LoopbackTransport

    from kvlifecycle.transport import KVLayout, MemoryKind

    kv = [torch.zeros((2, 8), dtype=torch.uint8), torch.ones((2, 8), dtype=torch.uint8)]
    a, b = LoopbackTransport(f"a-{time.monotonic_ns()}"), LoopbackTransport(f"b-{time.monotonic_ns()}")
    try:
        for t, mem in ((a, kv[0]), (b, kv[1])):
            t.register(KVLayout(MemoryKind.DRAM, 0, 2, (mem.data_ptr(),), (8,)))
        plan = a.prepare(a.add_peer(b.local_metadata()))
        with pytest.raises(ValueError, match="cap"):
            a.post("READ", plan, [0], [0], notification=Notification("r", "t", 1, payload=b"x" * 5000))
        assert int(kv[0].sum()) == 0 and b.notifications() == []
    finally:
        a.close()
        b.close()


def nixl_pair():
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")
    import numpy as np
    from kvlifecycle.transports.nixl import NixlTransport

    from kvlifecycle.transport import KVLayout, MemoryKind

    bufs = [np.zeros(4 * 64, dtype=np.uint8) for _ in range(2)]
    suffix = time.monotonic_ns()
    a, b = NixlTransport(f"fuzz-a-{suffix}"), NixlTransport(f"fuzz-b-{suffix}")
    for t, buf in ((a, bufs[0]), (b, bufs[1])):
        t.register(KVLayout(MemoryKind.DRAM, 0, 4, (buf.ctypes.data,), (64,)))
    return a, b, bufs


def test_nixl_receiving_end() -> None:
    a, b, _bufs = nixl_pair()
    try:
        receiving_end(b, a.agent)
    finally:
        a.close()
        b.close()


def test_nixl_junk_over_the_real_wire_is_dropped_and_the_next_note_arrives() -> None:
    """Junk sent through NIXL's own notification path reaches the service thread, which counts and drops it."""
    a, b, _bufs = nixl_pair()
    try:
        peer = a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        hidden = b"\x99" + encode_notification(LEGIT)[1:] + b"\x91" * 3000 + b"\xc0"  # RecursionError in msgspec
        junk = [hidden, b"\xc1\xc1", b"", msgspec.msgpack.encode([1, 2, 3])]
        for raw in junk:
            a._call(lambda raw=raw: a._nixl.send_notif(peer, raw), "send junk")
        a.send_notification(peer, LEGIT)
        got: list = []
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            got = b.notifications()
            time.sleep(0.01)
        assert got == [(a.agent, LEGIT)]
        assert b.malformed_notifications == len(junk)
    finally:
        a.close()
        b.close()


def test_cuda_ipc_notification_channel_drops_junk_and_delivers_the_next_note() -> None:
    """The CUDA IPC transport's notification channel is plain ZMQ (no GPU needed): hostile headers and bodies,
    frames of the wrong count, a deep value hidden in an unknown element, each counted once and dropped; a
    message from an older epoch of a known peer is stale; the legitimate note after them arrives intact."""
    from kvlifecycle.transports.cuda_ipc.notify import NotifyChannel

    receiver = NotifyChannel("rx", 1, "127.0.0.1")
    sender = NotifyChannel("tx", 5, "127.0.0.1")
    dealer = sender.connect(receiver.endpoint)
    try:
        header = msgspec.msgpack.encode(("tx", 5))
        hidden = b"\x99" + encode_notification(LEGIT)[1:] + b"\x91" * 3000 + b"\xc0"
        junk = [[header, hidden], [b"\x91" * 5000 + b"\xc0", encode_notification(LEGIT)], [header],
                [header, b"\xc1"], [msgspec.msgpack.encode(("tx", "5")), encode_notification(LEGIT)],
                [header, encode_notification(LEGIT), b"extra"]]
        for frames in junk:
            dealer.send_multipart(frames)
        dealer.send_multipart([msgspec.msgpack.encode(("tx", 4)), encode_notification(LEGIT)])  # an old epoch
        sender.send(dealer, "rx", LEGIT)
        got: list = []
        malformed = stale = 0
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            out, bad, old = receiver.receive({"tx": 5})
            got, malformed, stale = got + out, malformed + bad, stale + old
            time.sleep(0.01)
        assert got == [("tx", LEGIT)]
        assert (malformed, stale) == (len(junk), 1)
    finally:
        dealer.close(0)
        receiver.close()
        sender.close()
