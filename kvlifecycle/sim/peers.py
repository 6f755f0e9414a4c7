"""The side channel in the simulation: the real :class:`~kvlifecycle.handoff.Producer` serves its handlers on a
:class:`SimServer`, and the real :class:`~kvlifecycle.handoff.Consumer` reaches P through :class:`SimClient` (a
blocking call of the engine's thread: ``connect``, a stream request) and :class:`SimPeerCalls` (its off-loop calls:
claims, renewals, hand-backs, push requests), injected through their constructors' seams.

An off-loop call travels as messages through the simulated :class:`~kvlifecycle.sim.network.Network`: the request
to P, P's handler run when the scheduler delivers it, the answer back to D, each of which the scheduler may delay,
drop, duplicate or reorder (a duplicated request is handled twice by P). As the threaded ``PeerCalls``: one call in
flight per P (its worker blocks on it), the rest queued behind it; a call under a key already queued or in flight
is not queued again; a call not sent before its ``expires_s`` fails unsent; a call whose answer did not come by its
request timeout fails with :class:`~kvlifecycle.sidechannel.SideChannelTimeout` (an answer after it is dropped, as
the client closes the connection at its timeout). Every outcome is posted to the Consumer's job queue, so it runs
on D's loop at its next turn, as in production.

A blocking call is made at once (the caller's thread waits; nothing else moves meanwhile) unless the link is
partitioned or the step loses it (``loss``).
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvlifecycle.handoff.peer_calls import MAX_QUEUED, PeerCalls, Post
from kvlifecycle.sidechannel import (
    Handler,
    SideChannelClient,
    SideChannelError,
    SideChannelRefused,
    SideChannelServer,
    SideChannelTimeout,
)
from kvlifecycle.sim.network import Network
from kvlifecycle.sim.streams import Loss


class SimServer(SideChannelServer):
    """A P's side channel: its handlers, run when a request reaches P (no socket, no thread)."""

    def __init__(self, address: str, handlers: dict[type, Handler]) -> None:  # no super(): no socket
        self._address = address
        self.handlers = dict(handlers)
        self.served = 0

    @property
    def address(self) -> str:
        return self._address

    def add_handlers(self, handlers: dict[type, Handler]) -> None:
        self.handlers.update(handlers)

    def handle(self, message: msgspec.Struct) -> msgspec.Struct | SideChannelRefused:
        """P's answer to ``message``: its handler's reply, or the refusal it raised (what D's client raises)."""
        self.served += 1
        try:
            return self.handlers[type(message)](message, b"")
        except SideChannelRefused as exc:
            return exc

    def close(self, timeout_s: float = 5.0) -> None:
        pass


@dataclass(frozen=True, slots=True)
class PeerRequest:
    """D -> P: an off-loop call's request."""

    calls: SimPeerCalls
    call: int
    message: msgspec.Struct


@dataclass(frozen=True, slots=True)
class PeerReply:
    """P -> D: its answer (a reply, or the refusal D's client raises)."""

    calls: SimPeerCalls
    call: int
    outcome: msgspec.Struct | SideChannelRefused


class SideChannels:
    """The servers of the simulated cluster by address (a P's node name), and how its clients reach them."""

    def __init__(self, network: Network, now: Callable[[], float], *, reachable: Callable[[str, str], bool],
                 loss: Callable[[], Loss]) -> None:
        self.network, self.now = network, now
        self.servers: dict[str, SimServer] = {}
        self._reachable, self._loss = reachable, loss
        self.capturing = False  # SimPeerCalls is taking an off-loop call's message: clients hand it over

    def server_for(self, node: str) -> Callable[[dict[type, Handler]], SideChannelServer]:
        """The Producer's ``side_channel`` seam for P ``node`` (a restarted P replaces its old server)."""
        def make(handlers: dict[type, Handler]) -> SideChannelServer:
            server = self.servers[node] = SimServer(node, handlers)
            return server
        return make

    def client_for(self, node: str, timeout_s: float) -> Callable[[str], SideChannelClient]:
        """The Consumer's ``side_channel`` seam for D ``node``."""
        return lambda address: SimClient(self, node, address, timeout_s)

    def call(self, src: str, address: str, message: msgspec.Struct) -> Any:
        """A blocking call from ``src``, answered at once (or raising: cut, lost, refused)."""
        loss = self._loss()
        server = self.servers.get(address)
        if server is None or not self._reachable(src, address) or loss == "request":
            raise SideChannelTimeout(f"no answer from {address} (partitioned or lost)")
        outcome = server.handle(message)
        if loss == "reply":
            raise SideChannelTimeout(f"no answer from {address} (reply lost)")
        if isinstance(outcome, SideChannelRefused):
            raise outcome
        return outcome


class _Capture(Exception):  # control flow, not an error: an off-loop call's message and timeout
    def __init__(self, message: msgspec.Struct, timeout_s: float) -> None:
        super().__init__()
        self.message, self.timeout_s = message, timeout_s


class SimClient(SideChannelClient):
    """D's client of one P address. Called by :class:`SimPeerCalls` while it captures, it hands over the message
    and its timeout instead of calling (the call then travels through the network); otherwise it blocks."""

    def __init__(self, channels: SideChannels, src: str, address: str, timeout_s: float) -> None:  # no socket
        self.channels, self.src, self.address, self.timeout_s = channels, src, address, timeout_s
        self.bad_replies = 0

    def request(self, message: msgspec.Struct, timeout_s: float | None = None) -> Any:
        if self.channels.capturing:
            raise _Capture(message, self.timeout_s if timeout_s is None else timeout_s)
        return self.channels.call(self.src, self.address, message)

    def close(self) -> None:
        pass


@dataclass(slots=True)
class _Call:
    send: Callable[[], Any]
    on_reply: Callable[[Any, float], None]
    on_error: Callable[[Exception], None]
    key: Hashable | None
    expires: float
    sent: float = 0.0
    deadline: float = 0.0


@dataclass(slots=True)
class _Peer:
    queued: collections.deque[tuple[int, _Call]] = field(default_factory=collections.deque)
    keys: set[Hashable] = field(default_factory=set)
    in_flight: tuple[int, _Call] | None = None


class SimPeerCalls(PeerCalls):
    """The Consumer's off-loop calls over the simulated network (the ``peer_calls`` seam)."""

    def __init__(self, post: Post, *, node: str, channels: SideChannels,
                 now: Callable[[], float]) -> None:  # no super(): no threads
        self._post, self.node, self.channels, self._now = post, node, channels, now
        self._peers: dict[str, _Peer] = {}
        self._ids = itertools.count(1)
        self._closed = False

    def submit(self, peer: str, send: Callable[[], Any], *, on_reply: Callable[[Any, float], None],
               on_error: Callable[[Exception], None], key: Hashable | None = None,
               expires_s: float | None = None) -> bool:
        state = self._peers.setdefault(peer, _Peer())
        if key is not None and key in state.keys:
            return False
        refused = "closed" if self._closed else "too many calls waiting" if len(state.queued) >= MAX_QUEUED else ""
        if refused:
            self._post(functools.partial(on_error, SideChannelError(f"call to {peer} not sent: {refused}")))
            return True
        expires = self._now() + expires_s if expires_s is not None else float("inf")
        state.queued.append((next(self._ids), _Call(send, on_reply, on_error, key, expires)))
        if key is not None:
            state.keys.add(key)
        self._next(peer, state)
        return True

    def drop_queued(self, peer: str, why: str) -> int:
        state = self._peers.get(peer)
        if state is None:
            return 0
        dropped = [call for _, call in state.queued]
        state.queued.clear()
        for call in dropped:
            state.keys.discard(call.key)
            self._post(functools.partial(call.on_error, SideChannelError(f"call to {peer} not sent: {why}")))
        return len(dropped)

    def close(self, timeout_s: float = 1.0) -> None:
        self._closed = True
        self._peers.clear()

    def busy(self) -> bool:
        return any(state.queued or state.in_flight for state in self._peers.values())

    def _next(self, peer: str, state: _Peer) -> None:
        """The peer's worker takes its next call, if idle: a call past its ``expires`` fails unsent; a call whose
        ``send`` is not a request (a client's close) is done at once; a request leaves through the network."""
        while state.in_flight is None and state.queued:
            call_id, call = state.queued.popleft()
            now = self._now()
            if now >= call.expires:
                state.keys.discard(call.key)
                late = SideChannelTimeout(f"call to {peer} not sent: its time passed behind earlier calls to it")
                self._post(functools.partial(call.on_error, late))
                continue
            message = None
            self.channels.capturing = True
            try:
                result = call.send()
            except _Capture as capture:
                message, call.deadline = capture.message, now + capture.timeout_s
            except Exception as exc:
                state.keys.discard(call.key)
                self._post(functools.partial(call.on_error, exc))
                continue
            finally:
                self.channels.capturing = False
            if message is None:  # not a request (closing the client): done now
                state.keys.discard(call.key)
                self._post(functools.partial(call.on_reply, result, now))
                continue
            call.sent = now
            state.in_flight = (call_id, call)
            self.channels.network.send(self.node, peer, PeerRequest(self, call_id, message), self.channels.now())

    def arrived(self, call_id: int, outcome: msgspec.Struct | SideChannelRefused, peer: str) -> None:
        """P's answer reached D: handed to the loop unless the call already timed out (or it is a duplicate)."""
        state = self._peers.get(peer)
        if self._closed or state is None or state.in_flight is None or state.in_flight[0] != call_id:
            return
        call = state.in_flight[1]
        if self._now() >= call.deadline:  # the client gave up at its deadline: a late answer is dropped
            self._time_out(peer, state)
            return
        state.in_flight = None
        state.keys.discard(call.key)
        if isinstance(outcome, SideChannelRefused):
            self._post(functools.partial(call.on_error, outcome))
        else:
            self._post(functools.partial(call.on_reply, outcome, call.sent))
        self._next(peer, state)

    def expire(self) -> None:
        """The workers whose request timed out give it up (the next call to that peer leaves)."""
        now = self._now()
        for peer, state in list(self._peers.items()):
            if state.in_flight is not None and now >= state.in_flight[1].deadline:
                self._time_out(peer, state)

    def next_deadline(self) -> float:
        """The earliest request timeout in flight (inf: none), in this node's clock."""
        return min((state.in_flight[1].deadline for state in self._peers.values() if state.in_flight is not None),
                   default=float("inf"))

    def _time_out(self, peer: str, state: _Peer) -> None:
        assert state.in_flight is not None
        call = state.in_flight[1]
        state.in_flight = None
        state.keys.discard(call.key)
        self._post(functools.partial(call.on_error, SideChannelTimeout(f"no answer from {peer} in time")))
        self._next(peer, state)


def serve(request: PeerRequest, server: SimServer | None) -> PeerReply | None:
    """P's side channel handles a delivered request; None: nobody listens at that address any more."""
    if server is None:
        return None
    return PeerReply(request.calls, request.call, server.handle(request.message))


__all__ = ["PeerReply", "PeerRequest", "SideChannels", "SimClient", "SimPeerCalls", "SimServer", "serve"]
