"""A rank's presence in the cluster: P's registration and draining for scale-in; D's registration.

Draining: the key says ``draining`` (D and the proxy route new requests elsewhere), :meth:`ProducerPresence.grant`
refuses new grants, the leases already granted run to their end (completed, failed or expired: each bounded by its
TTL), then the key is deleted and the lease revoked. D sees a departed *draining* member and drops its link with
nothing in flight.

D registers too (``decode/<instance>/<dp>/<tp>``, no side-channel address: D serves none), so P ranks (and a
proxy) see it: a P following D ranks (:class:`~kvlifecycle.membership.directory.ConsumerDirectory`) releases a lost
D's leases at once. The fence that makes this safe: a D whose own etcd lease is found expired fails every load it
has in flight (their P ranks may already have released the blocks they read) and must come back as a new epoch.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvlifecycle.membership.etcd import EtcdSession, MembershipError
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, Role
from kvlifecycle.membership.registration import Registration

if TYPE_CHECKING:
    from kvlifecycle.handoff import Consumer, GrantReply, Producer

log = logging.getLogger("kvlifecycle.membership")


class DrainingError(MembershipError):
    """This P is draining: it takes no new grant."""


class ProducerPresence:
    """Registers a :class:`Producer` under ``prefill/<instance>/<dp>/<tp>`` and drains it on request."""

    def __init__(self, producer: Producer, session: EtcdSession, instance: str, *, dp: int = 0) -> None:
        self.producer = producer
        key = MemberKey(session.options.cluster, Role.PREFILL, instance, dp, producer.tp_rank)
        member = Member(producer.address, producer.transport.agent, producer.transport.epoch,
                        transport=producer.transport.name)
        self.registration = Registration(session, key, member)
        self.draining = False

    def register(self, *, retry_for_s: float = 0.0) -> None:
        self.registration.register(retry_for_s=retry_for_s)

    def grant(self, request: str, **kwargs: Any) -> GrantReply:
        if self.draining:
            raise DrainingError(f"{self.registration.key} is draining: no new grant for {request!r}")
        return self.producer.grant(request, **kwargs)

    def drain(self, *, timeout_s: float = 60.0, poll_s: float = 0.05) -> bool:
        """Stop taking grants, wait (bounded) for the live leases to end, deregister. Returns True when no lease
        was left (False: ``timeout_s`` passed first; the key is deleted anyway, the leftovers expire)."""
        self.draining = True
        try:
            self.registration.set_state(MemberState.DRAINING)
        except MembershipError as exc:  # etcd down: draining goes on locally; the key goes with its lease
            log.warning("could not mark %s draining in etcd: %s", self.registration.key, exc)
        deadline = time.monotonic() + timeout_s
        ledger = self.producer.ledger
        while ledger.leases and time.monotonic() < deadline:
            time.sleep(poll_s)
        left = len(ledger.leases)
        self.registration.deregister()
        log.info("%s drained: %d lease(s) left", self.registration.key, left)
        return left == 0

    def close(self) -> None:
        self.registration.close()


class ConsumerPresence:
    """Registers a :class:`Consumer` under ``decode/<instance>/<dp>/<tp>``; fences it if its lease is lost."""

    def __init__(self, consumer: Consumer, session: EtcdSession, instance: str, *, dp: int = 0) -> None:
        self.consumer = consumer
        key = MemberKey(session.options.cluster, Role.DECODE, instance, dp, consumer.tp_rank)
        member = Member("", consumer.transport.agent, consumer.transport.epoch, transport=consumer.transport.name)
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
