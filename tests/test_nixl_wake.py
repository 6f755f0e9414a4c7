"""NixlTransport.expect_activity from a caller that polls often (an engine's receiver poll): its service-thread wakes
are coalesced, one queued at a time, and a wake still comes after the queued one ran. Real NIXL agent (UCX)."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.nixl import NixlTransport

pytestmark = pytest.mark.nixl


def test_many_expect_activity_calls_queue_one_wake_and_a_later_call_queues_again() -> None:
    transport = NixlTransport("wake-test", probe_bytes=0)
    held, release = threading.Event(), threading.Event()
    try:
        def hold() -> None:  # keeps the service thread busy while the calls below queue
            held.set()
            release.wait(10)

        transport._submit(hold)
        assert held.wait(10)
        for _ in range(100):
            transport.expect_activity(0.25)
        assert transport._commands.qsize() == 1  # one wake, not a hundred
        release.set()
        ran = threading.Event()
        transport._submit(ran.set)  # behind the wake: once it ran, the wake ran too
        assert ran.wait(10)
        assert not transport._wake_queued
        transport.expect_activity(0.25)  # the next poll's call wakes the thread again
        ran2 = threading.Event()
        transport._submit(ran2.set)
        assert ran2.wait(10)
        assert not transport._wake_queued
    finally:
        release.set()
        transport.close()
