"""P's protocol decisions over its ledger: what a renewal, a hand-back, a push request, a polled write and a
consumer's notification do, and what a service step sweeps. The threaded :class:`kvlifecycle.handoff.Producer`
and the simulator's P both call this one class; they differ only in plumbing (sockets and a service thread, or
messages and scheduler steps). Not thread-safe: the Producer serialises its calls under its lock."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvlifecycle.ledger import SourceLedger
from kvlifecycle.protocol.writes import WRITE_IN_FLIGHT, PushWrites
from kvlifecycle.transport import XferStatus

LEASE_GONE = "lease is gone (released, expired or stale)"


@dataclass(frozen=True, slots=True)
class Answer:
    """P's answer to a side-channel request (``ok``, and why not)."""

    ok: bool
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PushAdmission:
    """The decision on a PushRequest: ``write`` says whether a WRITE from ``source`` is to be queued now."""

    answer: Answer
    write: bool = False
    source: np.ndarray | None = None  # the lease's blocks (the write's source) when ``write``


class ProducerProtocol:
    """P's side of the handoff, as decisions: every method takes the message (and reads the ledger's clock)."""

    def __init__(self, ledger: SourceLedger) -> None:
        self.ledger = ledger
        self.writes = PushWrites()

    def lease_is_live(self, transfer: str, generation: int) -> bool:
        lease = self.ledger.leases.get(transfer)
        return lease is not None and lease.generation == generation

    # -- side-channel requests -------------------------------------------------------------------------------------
    def renew(self, transfer: str, generation: int, agent: str, claim: bool = True) -> Answer:
        """A claim or renewal (``claim=False``: a keepalive, which renews without claiming). A lease that expired
        under its write is not renewed, nor released here, under the write: the next service step cancels the
        write and the sweep then releases it."""
        lease = self.ledger.leases.get(transfer)
        if (lease is not None and self.writes.in_flight(transfer, generation)
                and lease.expires_at <= self.ledger.clock.now()):
            return Answer(False, WRITE_IN_FLIGHT)
        ok = self.ledger.heartbeat(transfer, generation, peer=agent, claim=claim)
        return Answer(ok, "" if ok else LEASE_GONE)

    def hand_back(self, transfer: str, generation: int, reason: str) -> Answer:
        """D gave its load up (``LoadFailed``): released now, or once the lease's write in flight was cancelled."""
        if self.writes.hand_back(transfer, generation, reason):
            return Answer(False, WRITE_IN_FLIGHT)
        return Answer(self.ledger.fail(transfer, generation, f"consumer: {reason}"))

    def admit_push(self, transfer: str, generation: int, part: int, *, unavailable: str | None) -> PushAdmission:
        """A PushRequest. ``unavailable``: why P cannot write to this D (no push plan), None when it can. The
        caller maps the blocks, then calls :meth:`accept_write` once the write is queued."""
        lease = self.ledger.leases.get(transfer)
        if lease is None:
            return PushAdmission(Answer(False, "no live lease"))
        if unavailable is not None:
            return PushAdmission(Answer(False, f"push unavailable: {unavailable}"))
        if self.writes.is_duplicate(transfer, generation, part):
            # one WRITE per part, ever: a second would read the blocks after the first's completion freed them, or
            # land in blocks D recomputed
            return PushAdmission(Answer(True, "duplicate: this part's write was already accepted"))
        if not self.ledger.heartbeat(transfer, generation):  # renew before the write
            return PushAdmission(Answer(False, LEASE_GONE))
        return PushAdmission(Answer(True), write=True, source=lease.blocks)

    def accept_write(self, transfer: str, generation: int, part: int) -> None:
        self.writes.accept(transfer, generation, part)

    # -- the service step -------------------------------------------------------------------------------------------
    def stop_write(self, transfer: str, generation: int) -> str:
        """Why a write of this lease must not be posted now, or must be cancelled if in flight ("" : go on)."""
        return self.writes.must_stop(transfer, generation, self.ledger.leases.get(transfer), self.ledger.clock.now())

    def write_settled(self, transfer: str, generation: int, part: int, status: XferStatus | None) -> None:
        """A write ended: DONE completes its part (the last part releases the lease), anything else (failed,
        cancelled, never posted: ``None``) leaves the release to D's answer to the failure. A hand-back that waited
        for the lease's last write releases it now."""
        if status is XferStatus.DONE:
            self.ledger.consumer_done(transfer, generation, part)
        handed_back = self.writes.settled(transfer, generation)
        if handed_back is not None and self.lease_is_live(transfer, generation):
            self.ledger.fail(transfer, generation, f"consumer: {handed_back}")

    def on_notification(self, kind: str, transfer: str, generation: int, part: int, reason: str) -> None:
        """A consumer's notification (pull): its read completed (``done``) or failed."""
        if kind == "done":
            self.ledger.consumer_done(transfer, generation, part)
        elif kind == "failed":
            self.ledger.fail(transfer, generation, f"consumer: {reason}")

    def sweep(self) -> list[str]:
        """Expired leases are released, except those whose write is in flight (released once it settled)."""
        expired = self.ledger.sweep(keep=self.writes.held())
        if self.writes.accepted:  # a push of a lease that ended is refused anyway: forget it
            self.writes.prune(self.lease_is_live)
        return expired
