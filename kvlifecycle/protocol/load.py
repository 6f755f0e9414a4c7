"""One load's progress at D, and what its events decide: a part's completion counted once (the last one settles
the load), a failure settled at once or, while sibling parts' reads are still in flight (several P ranks), held as
``failing`` until they settled (vLLM #56104: the first error freed the blocks while sibling reads were landing).
The threaded :class:`kvlifecycle.handoff.Consumer`'s loads and the simulator's are this class; they add only their
plumbing (links, handles, calls)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlifecycle.protocol.bounds import RenewalClock, WriteBound

PEER_RESTARTED = "peer restarted (new agent epoch)"


@dataclass(slots=True, kw_only=True)
class LoadProgress:
    size: int = 1  # the load's parts (one per P rank it reads, or one push)
    done: set[int] = field(default_factory=set)
    claimed: int = 0  # leases claimed so far (claims go in part order)
    live: bool = False  # claimed and started in the ledger
    failed: bool = False  # settled as failed, or doomed (a peer restarted): failed at the next step
    failing: str = ""  # a part failed; the load fails once its sibling parts' reads settled (why)
    renewals: RenewalClock = field(default_factory=RenewalClock)  # bounds the reads: none outlives its lease
    given_up: str = ""  # push: why D handed the lease back; the load settles on P's word (its write may be landing)
    writes: WriteBound = field(default_factory=WriteBound)  # push: until when P's write may land, should P go unheard
    writes_until: float = -math.inf  # push of a P declared lost: the blocks stay LOADING (failing) until then

    def claim_acknowledged(self, part: int, sent_at: float, ttl_s: float, answered_at: float) -> bool:
        """P answered yes (at ``answered_at``) to the claim of ``part`` that D sent at ``sent_at`` (claims go in part
        order): True once every lease is claimed (only then may the load start in the ledger)."""
        self.renewals.acknowledged(part, sent_at, ttl_s)
        self.writes.claimed(part, sent_at, answered_at, ttl_s)
        self.claimed += 1
        return self.claimed == self.size

    def times_out(self, elapsed_s: float, timeout_s: float) -> bool:
        """The load ran past its timeout and is not already waiting for P's word (a push handed back)."""
        return elapsed_s > timeout_s and not self.given_up

    def part_done(self, part: int) -> bool:
        """A part completed: True the first time (the ledger counts it), False for a repeat."""
        if part in self.done:
            return False
        self.done.add(part)
        return True

    @property
    def complete(self) -> bool:
        return len(self.done) == self.size

    def failure(self, reason: str, *, reads_in_flight: int, wait_siblings: bool) -> str | None:
        """A part failed (or the load must). The reason to fail the whole load with now, or None while sibling
        reads are in flight and may still land (the load is ``failing``: its blocks stay LOADING)."""
        if wait_siblings and reads_in_flight:
            self.failing = self.failing or reason
            return None
        return self.failing or reason

    def pending_failure(self) -> str:
        """Why the service step must (try to) fail this load now ("" : it need not)."""
        if self.failing:
            return self.failing
        return PEER_RESTARTED if self.failed else ""
