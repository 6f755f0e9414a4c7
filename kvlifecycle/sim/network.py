"""The simulated network: every message between workers (side-channel requests and replies, the grants a proxy
carries, transport notifications) waits in one list of in-flight deliveries, and the scheduler decides what happens
to each: deliver it (any of them: reordering), drop it, duplicate it, or hold it back (a slow link). A partition
between two nodes drops what is sent across it until it heals (packet simulator of TigerBeetle's VOPR). The last
few deliveries the world keeps (:meth:`Network.remember`, and the last few lease renewals apart) may arrive again
much later (a retransmit whose first copy got through: :meth:`Network.echoes`, :meth:`Network.renewal_echoes`).

The list is ordered by send time and a sequence number, so a run that picks by index is reproducible.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ECHOES = 8  # delivered messages kept for a late re-delivery


@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    src: str
    dst: str
    sent_at: float
    payload: Any


class Network:
    def __init__(self) -> None:
        self.in_flight: list[Message] = []
        self.partitions: set[frozenset[str]] = set()
        self._seq = 0
        self._delivered: deque[Message] = deque(maxlen=ECHOES)  # what may arrive again, late
        self._renewals: deque[Message] = deque(maxlen=ECHOES)  # lease renewals delivered, kept apart (frequent)
        self.sent = self.dropped = self.duplicated = self.delivered = 0

    def send(self, src: str, dst: str, payload: Any, now: float) -> None:
        self._seq += 1
        self.sent += 1
        if frozenset((src, dst)) in self.partitions:
            self.dropped += 1
            return
        self.in_flight.append(Message(self._seq, src, dst, now, payload))

    def take(self, index: int) -> Message | None:
        """Remove and return the message at ``index`` (modulo the number in flight), for delivery."""
        if not self.in_flight:
            return None
        msg = self.in_flight.pop(index % len(self.in_flight))
        self.delivered += 1
        return msg

    def drop(self, index: int) -> Message | None:
        if not self.in_flight:
            return None
        self.dropped += 1
        return self.in_flight.pop(index % len(self.in_flight))

    def duplicate(self, index: int) -> Message | None:
        if not self.in_flight:
            return None
        msg = self.in_flight[index % len(self.in_flight)]
        self._seq += 1
        self.duplicated += 1
        self.in_flight.append(Message(self._seq, msg.src, msg.dst, msg.sent_at, msg.payload))
        return msg

    def remember(self, msg: Message) -> None:
        """``msg`` was delivered; a late copy of it may arrive again (one of the last :data:`ECHOES` kept)."""
        self._delivered.append(msg)

    def remember_renewal(self, msg: Message) -> None:
        """``msg``, a claimant's lease renewal, was delivered; a late copy of it may arrive again."""
        self._renewals.append(msg)

    def renewal_echoes(self) -> list[Message]:
        return list(self._renewals)

    def echoes(self) -> list[Message]:
        """The delivered messages a late copy of which may still arrive, oldest first."""
        return list(self._delivered)

    def partition(self, a: str, b: str) -> None:
        self.partitions.add(frozenset((a, b)))
        # what is on the wire between them is lost too
        lost = [m for m in self.in_flight if frozenset((m.src, m.dst)) == frozenset((a, b))]
        self.dropped += len(lost)
        self.in_flight = [m for m in self.in_flight if m not in lost]

    def cut(self, a: str, b: str) -> bool:
        """Whether a partition separates ``a`` and ``b`` now."""
        return frozenset((a, b)) in self.partitions

    def heal(self) -> None:
        self.partitions.clear()

    def forget_node(self, node: str, keep: Callable[[Any], bool] = lambda _payload: False) -> None:
        """A crashed node: what was addressed to it is lost (its sockets are gone), except what ``keep`` says
        still reaches the node's next incarnation (transport notifications go to the agent's name)."""
        self.in_flight = [m for m in self.in_flight if m.dst != node or keep(m.payload)]
        # no late copy comes through a connection that died with either end
        self._delivered = deque((m for m in self._delivered if node not in (m.src, m.dst) or keep(m.payload)),
                                maxlen=ECHOES)
        self._renewals = deque((m for m in self._renewals if node not in (m.src, m.dst)), maxlen=ECHOES)
