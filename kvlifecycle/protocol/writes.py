"""P's book of the WRITEs it accepted for pushes. In push mode P reads its own blocks to write them into D's, so
P holds both the transfer's handle and the lease, and three rules follow (the simulation found each broken):

- one WRITE per (transfer, generation, part), ever: a duplicated PushRequest is acknowledged without a second
  write (a second would read the blocks after the first's completion freed them, or land in blocks D recomputed);
- a write never outlives its lease: one not posted yet is not posted once the lease ended or expired, one in
  flight is cancelled (its pending handle released) then;
- a lease with a write in flight is not released: its expiry waits (the sweep keeps it) and a hand-back from D
  (``LoadFailed``: D gave the load up, e.g. its PushRequest's reply was lost) is answered :data:`WRITE_IN_FLIGHT`
  and applied once the write was cancelled and settled. D frees its target blocks only on P's word.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# P's answer to a hand-back of a lease whose write is in flight: P cancels the write, tells D it failed (a
# ``failed`` notification) and releases the lease; D keeps its target blocks LOADING until then.
WRITE_IN_FLIGHT = "write in flight: P cancels it, then releases the lease and notifies the failure"

_Key = tuple[str, int]  # (transfer, generation)


class LeaseView(Protocol):
    generation: int
    expires_at: float


def is_write_in_flight(detail: str) -> bool:
    """Whether P's refusal of a hand-back says a write of the lease is still in flight (D must wait)."""
    return detail.startswith(WRITE_IN_FLIGHT)


@dataclass(slots=True)
class PushWrites:
    accepted: set[tuple[str, int, int]] = field(default_factory=set)  # (transfer, generation, part)
    outstanding: Counter[_Key] = field(default_factory=Counter)  # writes accepted and not settled yet
    deferred: dict[_Key, str] = field(default_factory=dict)  # hand-backs waiting for their writes to settle

    def is_duplicate(self, transfer: str, generation: int, part: int) -> bool:
        return (transfer, generation, part) in self.accepted

    def accept(self, transfer: str, generation: int, part: int) -> None:
        self.accepted.add((transfer, generation, part))
        self.outstanding[(transfer, generation)] += 1

    def in_flight(self, transfer: str, generation: int) -> bool:
        return self.outstanding[(transfer, generation)] > 0

    def held(self) -> set[str]:
        """Transfers whose leases must outlive their expiry until their writes settle (the sweep keeps them)."""
        return {transfer for (transfer, _g), n in self.outstanding.items() if n > 0}

    def hand_back(self, transfer: str, generation: int, reason: str) -> bool:
        """D hands the lease back. True: a write is in flight, the release waits for it (answer
        :data:`WRITE_IN_FLIGHT`); False: release now."""
        if not self.in_flight(transfer, generation):
            return False
        self.deferred.setdefault((transfer, generation), reason)
        return True

    def must_stop(self, transfer: str, generation: int, lease: LeaseView | None, now: float) -> str:
        """Why a write of this lease must not be posted, or must be cancelled if it is in flight ("" : go on)."""
        if (transfer, generation) in self.deferred:
            return f"the consumer handed the lease back ({self.deferred[(transfer, generation)]})"
        if lease is None or lease.generation != generation:
            return "the lease ended"
        if lease.expires_at <= now:
            return "the lease expired"
        return ""

    def settled(self, transfer: str, generation: int) -> str | None:
        """A write finished, failed, was cancelled or never posted. Returns the deferred hand-back's reason once
        the lease's last write settled (release the lease now), else None."""
        key = (transfer, generation)
        self.outstanding[key] -= 1
        if self.outstanding[key] > 0:
            return None
        del self.outstanding[key]
        return self.deferred.pop(key, None)

    def prune(self, is_live: Callable[[str, int], bool]) -> None:
        """Forget the parts of leases that ended with nothing in flight (a push of an ended lease is refused)."""
        self.accepted = {k for k in self.accepted if is_live(k[0], k[1]) or self.in_flight(k[0], k[1])}
