"""D's side-channel messages about a grant it holds but has not claimed yet: fetch it (waiting, bounded, for P to
publish it), keep its lease alive while the engine reserves blocks, hand it back when no load will read it.

Before the claim a lease has no claimant to protect (:mod:`kvlifecycle.control`): these messages carry no claim
token, and P takes a keepalive or a hand-back without one only while nobody has claimed the lease. An engine sends
them through its :class:`~kvlifecycle.handoff.Consumer` from its own thread, over a client per P rank kept apart
from the links' clients: a claim or heartbeat of the Consumer's service thread, which may wait a whole timeout on
a silent peer, never delays a grant fetch, nor the reverse.
"""

from __future__ import annotations

import threading
import time

from kvlifecycle.control import GetGrant, GrantReply, Heartbeat, LoadFailed
from kvlifecycle.sidechannel import Ack, SideChannelClient, SideChannelRefused

REASON_CHARS = 400  # a hand-back's reason is cut to this: P records it in its ledger
FIRST_RETRY_S, LAST_RETRY_S = 0.002, 0.05  # a grant not published yet is asked for again, doubling the delay


class UnclaimedGrants:
    """The pre-claim messages of one D rank, with a side-channel client per P rank (thread-safe)."""

    def __init__(self, *, secret: bytes | None, timeout_s: float) -> None:
        self._secret, self._timeout_s = secret, timeout_s
        self._clients: dict[str, SideChannelClient] = {}
        self._lock = threading.Lock()

    def _client(self, address: str) -> SideChannelClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = SideChannelClient(address, (GrantReply,), secret=self._secret, timeout_s=self._timeout_s)
                self._clients[address] = client
            return client

    def fetch(self, address: str, request: str, *, wait_s: float = 0.0) -> GrantReply:
        """P's published grant of ``request``; ``unknown_request`` is asked again until ``wait_s`` is spent."""
        deadline = time.monotonic() + wait_s
        delay = FIRST_RETRY_S
        while True:
            try:
                grant: GrantReply = self._client(address).request(GetGrant(request))
                return grant
            except SideChannelRefused as exc:
                if exc.code != "unknown_request" or time.monotonic() + delay > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, LAST_RETRY_S)

    def keep_alive(self, address: str, grant: GrantReply, *, timeout_s: float) -> Ack:
        """A keepalive heartbeat (no agent, no token): renews the lease while nobody has claimed it."""
        ack: Ack = self._client(address).request(Heartbeat(grant.transfer, grant.generation), timeout_s=timeout_s)
        return ack

    def hand_back(self, address: str, grant: GrantReply, reason: str, *, consumer: int, timeout_s: float) -> Ack:
        """A token-less ``LoadFailed`` from consumer ``consumer``: P releases its share of the lease now."""
        message = LoadFailed(grant.transfer, grant.generation, reason[:REASON_CHARS], consumer=consumer)
        ack: Ack = self._client(address).request(message, timeout_s=timeout_s)
        return ack

    def close(self) -> None:
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()
