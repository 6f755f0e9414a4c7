"""Side-channel calls made off a service loop: submitted now, their reply or failure handed back later as a job.

A service loop that checks read bounds must never wait on a peer: a blocking request to a silent P holds its thread
for the request's whole timeout, longer than the margin a lease leaves a read (``READ_DEADLINE_FRACTION``), and
every other load's bound and an ``invalidate_peer`` wait behind it. So the loop submits each call here and goes
on; one worker thread per peer address makes the blocking request, and the outcome comes back through ``post``
(the loop's job queue), so every state change stays on the loop's thread (TigerBeetle's replicas submit I/O and
handle its completion on a later tick). A worker per peer: one silent peer delays only its own calls, never
another peer's. Each worker's queue is bounded, and a call already queued or in flight under the same ``key`` (a
part's heartbeat) is not queued twice. A worker exits once idle, and is made again by the next call.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from kvlifecycle.sidechannel import SideChannelError, SideChannelTimeout

log = logging.getLogger("kvlifecycle.peer_calls")

MAX_QUEUED = 256  # calls waiting for one peer's worker; past it a call fails at once (the peer is not answering)
IDLE_EXIT_S = 30.0  # a worker with nothing to do for this long exits (a lease renewed every TTL/6 keeps its own)

Post = Callable[[Callable[[], None]], None]


@dataclass(slots=True)
class _Call:
    send: Callable[[], Any]  # the blocking request
    on_reply: Callable[[Any, float], None]  # (reply, when the request was sent) on the loop's thread
    on_error: Callable[[Exception], None]
    key: Hashable | None
    expires: float  # not sent after this instant: failed unsent (its purpose has lapsed behind earlier calls)


class _Worker:
    def __init__(self) -> None:
        self.calls: collections.deque[_Call] = collections.deque()
        self.keys: set[Hashable] = set()  # of the calls queued or in flight
        self.thread: threading.Thread | None = None


class PeerCalls:
    """Blocking side-channel calls, run one peer at a time on that peer's worker; outcomes go to ``post``."""

    def __init__(self, post: Post, *, name: str = "peer-calls", max_queued: int = MAX_QUEUED,
                 idle_exit_s: float = IDLE_EXIT_S) -> None:
        self._post, self._name = post, name
        self._max_queued, self._idle_exit_s = max_queued, idle_exit_s
        self._workers: dict[str, _Worker] = {}
        self._cond = threading.Condition()
        self._closed = False

    def submit(self, peer: str, send: Callable[[], Any], *, on_reply: Callable[[Any, float], None],
               on_error: Callable[[Exception], None], key: Hashable | None = None,
               expires_s: float | None = None) -> bool:
        """Run ``send()`` on ``peer``'s worker; then ``on_reply(reply, sent_at)`` (``sent_at``: monotonic time the
        request left, for a lease's bound) or ``on_error(exc)`` is posted. False: not queued (a call under ``key``
        is already queued or in flight: its outcome stands for this one). A full queue, or a closed one, posts
        ``on_error`` at once. ``expires_s``: a call not sent within this long fails unsent (SideChannelTimeout)."""
        expires = time.monotonic() + expires_s if expires_s is not None else float("inf")
        with self._cond:
            worker = self._workers.get(peer)
            if worker is None:
                worker = self._workers[peer] = _Worker()
            if key is not None and key in worker.keys:
                return False
            refused = ("closed" if self._closed else
                       "too many calls waiting" if len(worker.calls) >= self._max_queued else "")
            if not refused:
                worker.calls.append(_Call(send, on_reply, on_error, key, expires))
                if key is not None:
                    worker.keys.add(key)
                if worker.thread is None:
                    worker.thread = threading.Thread(target=self._run, args=(peer, worker),
                                                     name=f"{self._name}-{peer}", daemon=True)
                    worker.thread.start()
                self._cond.notify_all()
                return True
        self._post(functools.partial(on_error, SideChannelError(f"call to {peer} not sent: {refused}")))
        return True

    def drop_queued(self, peer: str, why: str) -> int:
        """Fail every call still queued for ``peer`` (not the one in flight) unsent: the peer is gone. Returns how
        many."""
        with self._cond:
            worker = self._workers.get(peer)
            if worker is None:
                return 0
            dropped = list(worker.calls)
            worker.calls.clear()
            for call in dropped:
                worker.keys.discard(call.key)
        for call in dropped:
            self._post(functools.partial(call.on_error, SideChannelError(f"call to {peer} not sent: {why}")))
        return len(dropped)

    def close(self, timeout_s: float = 1.0) -> None:
        """Refuse new calls, drop the queued ones (their outcomes are not posted), and wait (bounded) for the
        workers: one in a request ends at its request's timeout."""
        with self._cond:
            self._closed = True
            threads = [w.thread for w in self._workers.values() if w.thread is not None]
            for worker in self._workers.values():
                worker.calls.clear()
                worker.keys.clear()
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(deadline - time.monotonic(), 0.0))

    def _run(self, peer: str, worker: _Worker) -> None:
        while True:
            with self._cond:
                idle_until = time.monotonic() + self._idle_exit_s
                while not worker.calls and not self._closed:
                    left = idle_until - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if not worker.calls:  # idle (or closed): this worker ends; the next call makes another
                    worker.thread = None
                    if self._workers.get(peer) is worker:
                        del self._workers[peer]
                    return
                call = worker.calls.popleft()
            self._perform(peer, call)
            with self._cond:
                worker.keys.discard(call.key)

    def _perform(self, peer: str, call: _Call) -> None:
        sent = time.monotonic()
        if sent >= call.expires:
            late = SideChannelTimeout(f"call to {peer} not sent: its time passed behind earlier calls to it")
            self._post(functools.partial(call.on_error, late))
            return
        try:
            reply = call.send()
        except Exception as exc:  # a SideChannelError, or a bug: either way the loop decides, on its thread
            if not isinstance(exc, SideChannelError):
                log.exception("call to %s raised", peer)
            self._post(functools.partial(call.on_error, exc))
            return
        self._post(functools.partial(call.on_reply, reply, sent))
