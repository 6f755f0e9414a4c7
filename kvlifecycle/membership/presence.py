"""A rank's presence in the cluster: P's registration and draining for scale-in; D's registration.

Draining: the key says ``draining`` (D and the proxy route new requests elsewhere), :meth:`ProducerPresence.grant`
refuses new grants, the leases already granted run to their end (completed, failed or expired: each bounded by its
TTL), then the key is deleted and the lease revoked. D sees a departed *draining* member and drops its link with
nothing in flight. A drain is started in the process (:meth:`ProducerPresence.drain`, e.g. at shutdown) or ordered
from outside: ``kvlifecycle drain`` (:mod:`.drain`) marks the rank's key draining, and a P that follows its own key
(:meth:`ProducerPresence.follow_drain_orders`) drains on a thread of its own when it sees the mark.

D registers too (``decode/<instance>/<dp>/<tp>``, no side-channel address: D serves none), so P ranks (and a
proxy) see it: a P following D ranks (:class:`~kvlifecycle.membership.directory.ConsumerDirectory`) releases a lost
D's leases at once. The fence that makes this safe: a D whose own etcd lease is found expired fails every load it
has in flight (their P ranks may already have released the blocks they read) and must come back as a new epoch.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvlifecycle.membership.etcd import EtcdSession, MembershipError
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, Role
from kvlifecycle.membership.registration import Registration
from kvlifecycle.membership.watcher import PeerWatcher

if TYPE_CHECKING:
    from kvlifecycle.control import GrantReply
    from kvlifecycle.handoff import Consumer, Producer

log = logging.getLogger("kvlifecycle.membership")


class DrainingError(MembershipError):
    """This P is draining: it takes no new grant."""


class ProducerPresence:
    """Registers a :class:`Producer` under ``prefill/<instance>/<dp>/<tp>`` and drains it on request."""

    def __init__(self, producer: Producer, session: EtcdSession, instance: str, *, dp: int = 0,
                 api: str = "") -> None:
        self.producer = producer
        key = MemberKey(session.options.cluster, Role.PREFILL, instance, dp, producer.tp_rank)
        member = Member(producer.address, producer.transport.agent, producer.transport.epoch,
                        transport=producer.transport.name, api=api)
        self.registration = Registration(session, key, member)
        self.draining = False
        self.drain_thread: threading.Thread | None = None  # an ordered drain's
        self.drained: bool | None = None  # None until an ordered drain ended; then whether no lease was left
        self._drain_args: dict[str, float] = {}
        self._order_watcher: PeerWatcher | None = None

    def register(self, *, retry_for_s: float = 0.0) -> None:
        self.registration.register(retry_for_s=retry_for_s)

    def grant(self, request: str, **kwargs: Any) -> GrantReply:
        if self.draining:
            raise DrainingError(f"{self.registration.key} is draining: no new grant for {request!r}")
        return self.producer.grant(request, **kwargs)

    def drain(self, *, timeout_s: float = 60.0, poll_s: float = 0.05, quiet_s: float = 0.0) -> bool:
        """Stop taking grants, wait (bounded) for the live leases to end, deregister. Returns True when no lease
        was left (False: ``timeout_s`` passed first; the key is deleted anyway, the leftovers expire).

        ``quiet_s``: the leases must have been none for this long before P leaves. An engine grants a request only
        once its prefill is done, so a request routed here just before the mark holds no lease yet while it
        prefills; the quiet time lets it reach its grant, which then runs to its end like the others."""
        self.draining = True
        try:
            self.registration.set_state(MemberState.DRAINING)
        except MembershipError as exc:  # etcd down: draining goes on locally; the key goes with its lease
            log.warning("could not mark %s draining in etcd: %s", self.registration.key, exc)
        deadline = time.monotonic() + timeout_s
        ledger = self.producer.ledger
        quiet_since = time.monotonic()
        while time.monotonic() < deadline:
            if ledger.leases:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= quiet_s:
                break
            time.sleep(poll_s)
        left = len(ledger.leases)
        self.registration.deregister()
        if self._order_watcher is not None:
            self._order_watcher.close()
        log.info("%s drained: %d lease(s) left", self.registration.key, left)
        return left == 0

    # -- a drain ordered from outside -------------------------------------------------------------------------------
    def follow_drain_orders(self, *, timeout_s: float = 60.0, quiet_s: float = 0.0,
                            retry_for_s: float = 0.0) -> None:
        """Watch this rank's own key (after :meth:`register`): once someone else marks it draining (``kvlifecycle
        drain``), :meth:`drain` runs on a thread of its own with ``timeout_s`` and ``quiet_s``; :attr:`drained`
        says how it ended."""
        self._drain_args = {"timeout_s": timeout_s, "quiet_s": quiet_s}
        self._order_watcher = PeerWatcher(self.registration.session, Role.PREFILL, on_joined=self._maybe_ordered,
                                          on_updated=self._maybe_ordered)
        self._order_watcher.start(retry_for_s=retry_for_s)

    def _maybe_ordered(self, key: MemberKey, member: Member) -> None:
        mine = self.registration.member
        if (key != self.registration.key or (member.agent, member.epoch) != (mine.agent, mine.epoch)
                or member.state is not MemberState.DRAINING or self.draining):
            return
        log.info("%s: a drain was ordered through etcd", key)
        self.draining = True  # no new grant from now on, before the thread runs
        self.drain_thread = threading.Thread(target=self._ordered_drain, name=f"kvl-drain-{key.instance}",
                                             daemon=True)
        self.drain_thread.start()

    def _ordered_drain(self) -> None:
        self.drained = self.drain(**self._drain_args)

    def close(self) -> None:
        if self._order_watcher is not None:
            self._order_watcher.close()
        self.registration.close()


class ConsumerPresence:
    """Registers a :class:`Consumer` under ``decode/<instance>/<dp>/<tp>``; fences it if its lease is lost."""

    def __init__(self, consumer: Consumer, session: EtcdSession, instance: str, *, dp: int = 0,
                 api: str = "") -> None:
        self.consumer = consumer
        key = MemberKey(session.options.cluster, Role.DECODE, instance, dp, consumer.tp_rank)
        member = Member("", consumer.transport.agent, consumer.transport.epoch, transport=consumer.transport.name,
                        api=api)
        self.registration = Registration(session, key, member, on_lease_lost=self._fence)

    def register(self, *, retry_for_s: float = 0.0) -> None:
        self.registration.register(retry_for_s=retry_for_s)

    def _fence(self, _key: MemberKey, _member: Member) -> None:
        """Our lease expired: P ranks may have released what we read. Fail every load; drop every link."""
        for link in list(self.consumer.links.values()):
            self.consumer.invalidate_peer(link.agent, link.epoch, "this D's etcd lease expired")

    def deregister(self) -> None:
        self.registration.deregister()

    def close(self) -> None:
        self.registration.close()
