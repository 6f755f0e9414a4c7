"""A P rank's handshake over real NIXL on DRAM, with the P side's data plane busy or idle, as a P TP 2 rank's is on
a loaded machine: P (a real Producer and its zmq side channel over a NIXL transport) and D (a Consumer over another
NIXL transport) in one process; every wait bounded, no assertion on a duration.

- The side channel answers a handshake while P's NIXL service thread is held (on DRAM ``transfer()`` holds it for
  the whole copy; a NIXL call may wait on a peer): P's metadata is taken once at registration.
- D's connect-time probe completes against a P whose data plane sleeps between polls: the first READ from a new
  peer completes only once that peer's agent has progressed UCX's wire-up, so the handshake wakes P's data plane and
  has it poll tightly meanwhile.
- Where the time of a slow handshake went: a call that waited behind the service thread says it was queued, and
  D's handshake names its slow step.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("nixl")

from kvlifecycle.transports.nixl import SLOW_CALL_S, NixlTransport

from kvlifecycle.handoff import REPLY_TYPES, Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo, GetMeta, MetaReply
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.sidechannel import SideChannelClient
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, BLOCK_BYTES = 8, 4096
COMPAT = CompatInfo(model_id="m", dtype="float32", num_layers=1, num_kv_heads=2, head_size=16, block_size=16,
                    kv_layout="HND")
HANDSHAKE_TIMEOUT_S = 3.0  # far below the NIXL thread's hold below and the transport's 30 s call bound


def registered(name: str, **kwargs: float) -> tuple[NixlTransport, np.ndarray]:
    buffer = np.zeros(BLOCKS * BLOCK_BYTES, dtype=np.uint8)
    transport = NixlTransport(f"{name}-{time.monotonic_ns()}", **kwargs)  # type: ignore[arg-type]
    transport.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (buffer.ctypes.data,), (BLOCK_BYTES,)))
    return transport, buffer


@pytest.fixture
def held_nixl_thread() -> Iterator[tuple[Producer, NixlTransport, threading.Event]]:
    """A Producer whose NIXL service thread is held by a command until the event is set (or 20 s pass)."""
    transport, _buffer = registered("p-held")
    producer = Producer(SourceLedger(BLOCKS, worker="p"), transport, COMPAT)
    release, holding = threading.Event(), threading.Event()

    def hold() -> None:
        holding.set()
        release.wait(20.0)

    transport._submit(hold)  # as a long transfer() on the service thread would
    assert holding.wait(10.0)
    try:
        yield producer, transport, release
    finally:
        release.set()
        producer.close()
        transport.close()


def test_a_handshake_is_answered_while_the_nixl_thread_is_held(
        held_nixl_thread: tuple[Producer, NixlTransport, threading.Event]) -> None:
    producer, transport, release = held_nixl_thread
    client = SideChannelClient(producer.address, REPLY_TYPES, timeout_s=HANDSHAKE_TIMEOUT_S)
    try:
        reply = client.request(GetMeta(COMPAT, 0, "d-agent", 1, None))
        still_held = not release.is_set()
    finally:
        client.close()
    assert isinstance(reply, MetaReply)
    assert still_held  # answered while the data plane was busy, not after it let go
    assert reply.meta.agent == transport.agent and reply.meta.blob


def test_the_connect_probe_completes_against_a_producer_that_polls_rarely() -> None:
    """P's data plane would sleep 60 s between polls: only the handshake's wake-up lets the probe's first READ (the
    wire-up) complete within the probe's own bound."""
    p_transport, p_buffer = registered("p-idle", idle_poll_s=60.0)
    d_transport, _d_buffer = registered("d")
    p_buffer[:] = 7
    producer = Producer(SourceLedger(BLOCKS, worker="p"), p_transport, COMPAT)
    consumer = Consumer(TargetLedger(BLOCKS, worker="d"), d_transport, COMPAT,
                        options=HandoffOptions(request_timeout_s=HANDSHAKE_TIMEOUT_S))
    try:
        time.sleep(0.1)  # P's service thread is in its long idle wait now
        link = consumer.connect(producer.address, push=False)
        assert link.probe is not None, "the probe's first READ never completed: P's agent did not progress"
        assert link.probe.bytes > 0
    finally:
        p_transport.idle_poll_s = 0.005  # a service thread in a 60 s wait would hold its close that long
        p_transport.expect_activity(0.0)
        consumer.close()
        producer.close()
        d_transport.close()
        p_transport.close()


def _hold_service_thread(transport: NixlTransport, seconds: float) -> threading.Event:
    """Occupy ``transport``'s service thread for ``seconds`` (as a long DRAM ``transfer()`` would); set once held."""
    holding = threading.Event()

    def hold() -> None:
        holding.set()
        time.sleep(seconds)

    transport._submit(hold)
    assert holding.wait(10.0)
    return holding


def test_a_call_held_behind_the_service_thread_is_logged_with_where_its_time_went(
        caplog: pytest.LogCaptureFixture) -> None:
    """A call that waited on a busy service thread says so (queued, not NIXL itself): the first question when a
    handshake step is slow."""
    transport, _buffer = registered("slow-call")
    try:
        _hold_service_thread(transport, SLOW_CALL_S + 0.3)
        with caplog.at_level(logging.WARNING, logger="kvlifecycle.transports.nixl"):
            transport.remove_peer("nobody")  # a no-op command, queued behind the hold
        slow = [r.getMessage() for r in caplog.records if "NIXL remove_peer took" in r.getMessage()]
        assert len(slow) == 1, caplog.text
        queued = float(slow[0].split("(queued ")[1].split(" s")[0])
        assert queued >= SLOW_CALL_S, slow[0]  # the time went into the queue, not into NIXL
    finally:
        transport.close()


def test_a_slow_handshake_names_its_slow_step(caplog: pytest.LogCaptureFixture) -> None:
    """D's handshake logs each step's time; a handshake past a sixth of the side-channel bound is a WARNING that
    names the step that took it (here add_peer, queued behind D's busy data plane)."""
    p_transport, _p_buffer = registered("p-fast")
    d_transport, _d_buffer = registered("d-busy")
    producer = Producer(SourceLedger(BLOCKS, worker="p"), p_transport, COMPAT)
    consumer = Consumer(TargetLedger(BLOCKS, worker="d"), d_transport, COMPAT,
                        options=HandoffOptions(request_timeout_s=HANDSHAKE_TIMEOUT_S, probe=False))
    try:
        _hold_service_thread(d_transport, HANDSHAKE_TIMEOUT_S / 6 + 0.3)
        with caplog.at_level(logging.INFO, logger="kvlifecycle.handoff"):
            consumer.connect(producer.address, push=False)
        [record] = [r for r in caplog.records if r.getMessage().startswith("handshake with")]
        assert record.levelno == logging.WARNING, record.getMessage()
        steps = dict(part.rsplit(" ", 2)[:2] for part in record.getMessage().split(": ", 1)[1].split(", "))
        assert list(steps) == ["get_meta", "add_peer", "prepare", "select", "probe"], steps
        assert max(steps, key=lambda step: float(steps[step])) == "add_peer", record.getMessage()
    finally:
        consumer.close()
        producer.close()
        d_transport.close()
        p_transport.close()
