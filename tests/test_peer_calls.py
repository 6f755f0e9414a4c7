"""PeerCalls, the Consumer's off-loop side-channel calls, with stand-in requests (fast tests beside the real silent
peer of tests/test_handoff_silent_peer.py): one peer's blocked call delays no other peer's, a keyed call is not
queued twice, a full queue and a gone peer fail calls unsent, a call past its time is not sent, and every outcome
comes back through ``post`` (the loop's job queue), never on the caller's thread. Every wait is bounded."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest
from waiting import until

from kvlifecycle.handoff.peer_calls import PeerCalls
from kvlifecycle.sidechannel import SideChannelError, SideChannelTimeout


class Loop:
    """The service loop's job queue; ``run`` takes the next outcome (bounded)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.outcomes: list[tuple[str, object]] = []

    def run(self, n: int = 1, timeout_s: float = 10.0) -> list[tuple[str, object]]:
        for _ in range(n):
            self.jobs.get(timeout=timeout_s)()
        return self.outcomes

    def reply(self, tag: str) -> Callable[[object, float], None]:
        return lambda reply, _sent: self.outcomes.append((tag, reply))

    def error(self, tag: str) -> Callable[[Exception], None]:
        return lambda exc: self.outcomes.append((tag, exc))


@pytest.fixture
def loop():
    loop = Loop()
    calls = PeerCalls(loop.jobs.put)
    gate = threading.Event()
    yield loop, calls, gate
    gate.set()
    calls.close()


def test_a_blocked_peer_delays_no_other_peer(loop) -> None:
    loop, calls, gate = loop
    calls.submit("silent", lambda: gate.wait(10) and "late", on_reply=loop.reply("silent"),
                 on_error=loop.error("silent"))
    calls.submit("healthy", lambda: "ok", on_reply=loop.reply("healthy"), on_error=loop.error("healthy"))
    assert loop.run() == [("healthy", "ok")]  # while the silent one is still waiting
    gate.set()
    assert loop.run() == [("healthy", "ok"), ("silent", "late")]


def test_outcomes_run_on_the_loop_not_the_worker(loop) -> None:
    loop, calls, _ = loop
    threads: list[str] = []
    calls.submit("p", lambda: 1, on_reply=lambda *_: threads.append(threading.current_thread().name),
                 on_error=loop.error("p"))
    loop.run()
    assert threads == [threading.current_thread().name]


def test_a_keyed_call_is_not_queued_twice(loop) -> None:
    loop, calls, gate = loop
    sent: list[int] = []

    def beat(n: int) -> Callable[[], int]:
        return lambda: (gate.wait(10), sent.append(n))[0] and n

    assert calls.submit("p", beat(1), on_reply=loop.reply("beat"), on_error=loop.error("beat"), key=("beat", 0))
    assert not calls.submit("p", beat(2), on_reply=loop.reply("beat"), on_error=loop.error("beat"), key=("beat", 0))
    assert calls.submit("p", beat(3), on_reply=loop.reply("other"), on_error=loop.error("other"), key=("beat", 1))
    gate.set()
    assert loop.run(2) == [("beat", 1), ("other", 3)]
    assert sent == [1, 3]
    assert calls.submit("p", beat(4), on_reply=loop.reply("beat"), on_error=loop.error("beat"), key=("beat", 0))
    assert loop.run()[-1] == ("beat", 4)  # answered: the key is free again


def test_a_full_queue_fails_a_call_unsent() -> None:
    loop = Loop()
    calls = PeerCalls(loop.jobs.put, max_queued=1)
    gate = threading.Event()
    try:
        calls.submit("p", lambda: gate.wait(10), on_reply=loop.reply("first"), on_error=loop.error("first"))
        assert until(lambda: not calls._workers["p"].calls)  # the first is in flight
        calls.submit("p", lambda: 2, on_reply=loop.reply("queued"), on_error=loop.error("queued"))
        calls.submit("p", lambda: 3, on_reply=loop.reply("over"), on_error=loop.error("over"))
        tag, exc = loop.run()[0]
        assert tag == "over" and isinstance(exc, SideChannelError) and "too many" in str(exc)
    finally:
        gate.set()
        calls.close()


def test_dropping_a_gone_peer_fails_its_queued_calls_unsent(loop) -> None:
    loop, calls, gate = loop
    sent: list[str] = []
    calls.submit("p", lambda: gate.wait(10), on_reply=loop.reply("in flight"), on_error=loop.error("in flight"))
    assert until(lambda: not calls._workers["p"].calls)
    calls.submit("p", lambda: sent.append("x"), on_reply=loop.reply("queued"), on_error=loop.error("queued"))
    assert calls.drop_queued("p", "peer lost") == 1
    tag, exc = loop.run()[0]
    assert tag == "queued" and "peer lost" in str(exc)
    gate.set()
    assert loop.run()[-1] == ("in flight", True)
    assert sent == []


def test_a_call_past_its_time_is_not_sent(loop) -> None:
    loop, calls, gate = loop
    sent: list[str] = []
    calls.submit("p", lambda: gate.wait(10), on_reply=loop.reply("slow"), on_error=loop.error("slow"))
    calls.submit("p", lambda: sent.append("claim"), on_reply=loop.reply("claim"), on_error=loop.error("claim"),
                 expires_s=0.0)
    gate.set()
    outcomes = loop.run(2)
    assert outcomes[0] == ("slow", True)
    assert outcomes[1][0] == "claim" and isinstance(outcomes[1][1], SideChannelTimeout)
    assert sent == []


def test_a_request_error_comes_back_as_the_error(loop) -> None:
    loop, calls, _ = loop

    def refused() -> None:
        raise SideChannelError("no")

    calls.submit("p", refused, on_reply=loop.reply("r"), on_error=loop.error("r"))
    tag, exc = loop.run()[0]
    assert tag == "r" and isinstance(exc, SideChannelError)


def test_a_closed_pool_refuses_calls() -> None:
    loop = Loop()
    calls = PeerCalls(loop.jobs.put)
    calls.close()
    calls.submit("p", lambda: 1, on_reply=loop.reply("r"), on_error=loop.error("r"))
    tag, exc = loop.run()[0]
    assert tag == "r" and "closed" in str(exc)


def test_an_idle_worker_exits_and_the_next_call_makes_another() -> None:
    loop = Loop()
    calls = PeerCalls(loop.jobs.put, idle_exit_s=0.01)
    try:
        calls.submit("p", lambda: 1, on_reply=loop.reply("a"), on_error=loop.error("a"))
        loop.run()
        assert until(lambda: "p" not in calls._workers)
        calls.submit("p", lambda: 2, on_reply=loop.reply("b"), on_error=loop.error("b"))
        assert loop.run()[-1] == ("b", 2)
    finally:
        calls.close()

