"""P's presence in the cluster: its registration, and draining for scale-in.

Draining: the key says ``draining`` (D and the proxy route new requests elsewhere), :meth:`ProducerPresence.grant`
refuses new grants, the leases already granted run to their end (completed, failed or expired: each bounded by its
TTL), then the key is deleted and the lease revoked. D sees a departed *draining* member and drops its link with
nothing in flight.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvlifecycle.membership.etcd import EtcdSession, MembershipError
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, Role
from kvlifecycle.membership.registration import Registration

if TYPE_CHECKING:
    from kvlifecycle.handoff import GrantReply, Producer

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
