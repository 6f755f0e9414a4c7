"""D's launch of a load and its service duties, as decisions: the order of the launch (every lease claimed, in part
order, before the load starts in D's ledger, so that D never loads a transfer P already released), what a claim's
answer means, which leases an abandoned launch hands back, what a service step owes a live load (cancel a read
that outlived its lease, settle a pending failure, or poll) and when a heartbeat is due. The threaded
:class:`kvlifecycle.handoff.Consumer` (blocking side-channel calls, a service thread) and the simulator's D
(messages and scheduler steps) both run their loads through this class; they add only the plumbing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvlifecycle.protocol.load import LoadProgress

NOT_RESERVED = "request no longer reserved"
CLAIM_PAST_BOUND = "claim answered past its read bound"


@dataclass(frozen=True, slots=True)
class LaunchStep:
    """What the launch does next: claim ``part``, start the load (``start_load``, then the posts), or abandon it
    (``reason``: the reservation goes back per policy, the leases claimed so far are handed back)."""

    action: Literal["claim", "start", "abandon"]
    part: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Duty:
    """What a service step owes a live load before anything else: ``cancel_reads`` (a read may outlive its lease:
    cancel it and fail the load, not waiting for siblings), ``fail`` (a part failed or a peer restarted: settle it,
    waiting for sibling reads while ``wait_siblings``), ``poll`` (poll its handles, then :meth:`after_poll`) or
    ``idle`` (not launched yet)."""

    action: Literal["idle", "cancel_reads", "fail", "poll"]
    reason: str = ""
    wait_siblings: bool = True


@dataclass(slots=True, kw_only=True)
class LoadLaunch(LoadProgress):
    """A load at D from its launch to its end: its progress (:class:`LoadProgress`) and the decisions above."""

    started: float = 0.0  # when the engine asked for it (the load timeout counts from here)
    last_beat: float = 0.0  # when its leases were last renewed (or handed back again)

    # -- the launch ------------------------------------------------------------------------------------------------
    def begin(self, *, reserved: bool) -> LaunchStep:
        """The launch starts: claim the first lease, unless the reservation is gone."""
        return LaunchStep("claim", 0) if reserved else LaunchStep("abandon", reason=NOT_RESERVED)

    def claim_answered(self, part: int, *, ok: bool, detail: str, sent_at: float, ttl_s: float,
                       reserved: bool, now: float) -> LaunchStep:
        """P answered the claim of ``part`` sent at ``sent_at``, and the answer reached D at ``now``: the next
        claim, the start once every lease is claimed (and the reservation still stands), or the abandon of a
        refused claim or of one answered past the read bound of a lease claimed so far (a read posted now could
        outlive that lease: P counts its TTL from when the claim reached it, D can only count from the send)."""
        if not ok:
            return LaunchStep("abandon", reason=f"lease refused: {detail}")
        every_lease = self.claim_acknowledged(part, sent_at, ttl_s, now)
        if self.renewals.outlived(now):
            return LaunchStep("abandon", reason=f"{CLAIM_PAST_BOUND} ({now - sent_at:.3f} s after it was sent)")
        if not every_lease:
            return LaunchStep("claim", self.claimed)
        return LaunchStep("start") if reserved else LaunchStep("abandon", reason=NOT_RESERVED)

    @staticmethod
    def claim_unanswered(error: str) -> LaunchStep:
        """A claim got no answer: the load never starts (P's lease, if it claimed, ends at its expiry)."""
        return LaunchStep("abandon", reason=f"claim failed: {error}")

    def hand_back_parts(self, *, every_lease: bool = False) -> range:
        """The parts whose leases an abandoned launch hands back: those claimed so far, or every one (the grant
        is of no use to D: P may release it now)."""
        return range(self.size if every_lease else self.claimed)

    # -- the service step ------------------------------------------------------------------------------------------
    def duty(self, now: float, *, reading: bool, timeout_s: float) -> Duty:
        """What this step owes the load first. ``reading``: a read of it is posted (a handle is held)."""
        if not self.live:
            return Duty("idle")
        if reading and self.renewals.outlived(now):  # P may expire the lease and reuse the blocks under the read
            why = self.pending_failure() or "read outlived its lease"  # also while a failure waits on it
            return Duty("cancel_reads", f"{why}: read cancelled at its lease's bound", wait_siblings=False)
        why = self.pending_failure()
        if why:
            return Duty("fail", why, wait_siblings=now - self.started <= timeout_s)
        return Duty("poll")

    def after_poll(self, now: float, timeout_s: float) -> Literal["timeout", "heartbeat"]:
        """Its handles polled and the load still open: it timed out, or its leases are to be kept alive."""
        return "timeout" if self.times_out(now - self.started, timeout_s) else "heartbeat"

    def beat(self, now: float, every_s: float) -> Literal["wait", "hand_back", "renew"]:
        """Whether a heartbeat is due now: ``renew`` every lease, or (the push was handed back) ``hand_back``
        again, asking P whether it released."""
        if now - self.last_beat < every_s:
            return "wait"
        self.last_beat = now
        return "hand_back" if self.given_up else "renew"


def beat_every(ttl_s: float, configured_s: float | None = None) -> float:
    """The heartbeat period: the configured one, else six beats per lease TTL (five may be lost before expiry)."""
    return configured_s or ttl_s / 6
