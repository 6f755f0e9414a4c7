"""A read never outlives its lease. D holds the read's handle and P holds the lease: P expires a lease whose
renewals stopped reaching it (the reader may be dead), so D must have given its read up by then. P's expiry is at
least TTL after it processed D's last renewal, which came after D sent it; so a read is trusted until
``send time of the last renewal P acknowledged + TTL x READ_DEADLINE_FRACTION``, in D's clock. Past that D cancels
the read (releases its pending handle) and fails the load: its bytes may come from blocks P already reused.

A stream's writes never outlive D's wait for them. A stream is the other way round: P posts the writes and D holds
the blocks, so D may free them only once no write of P can land. D's stream request carries a write window as a
duration (no shared clock); P's deadline is its receipt of the request + the window. P posts no layer after it and
cancels (releases) the writes still in flight at it, which then move no byte after ``STREAM_SETTLE_S``. D starts
its stream timeout once P's answer came (after P's receipt) or the request failed, and fails the stream (frees or
recomputes its blocks) no earlier than ``stream_timeout_s`` later: :func:`check_stream_window` refuses a timeout
that does not exceed the window + the settle bound by ``STREAM_MARGIN_FRACTION`` of itself (the clocks' rate
difference, and a request that reaches P after D stopped waiting for its answer).

A push's writes never outlive a lost peer's lease. When D's control plane declares a P lost (its etcd lease lapsed)
while P writes into D's blocks, P may in fact be alive and partitioned from etcd only: its write runs until P expires
the lease and cancels it. D cannot ask; it bounds the lease's end from what it sent. P's expiry is TTL after the
last claim, renewal or push request it accepted, so D needs a bound on when such a message can still arrive. Every
one after the claim carries ``since_claim``, the seconds D's clock ran from sending the claim to building it; P
refuses one whose transit, measured against the claim's (``now - claimed_at - since_claim``, P's clock), exceeds
``RENEWAL_TRANSIT_FRACTION`` of the TTL (:func:`renewal_too_late`). An accepted one thus reached P no later than
``built + claim round trip + TTL x RENEWAL_TRANSIT_FRACTION`` in D's clock, and :class:`WriteBound` keeps the blocks
LOADING until the latest such instant + the TTL over ``READ_DEADLINE_FRACTION`` (the drift margin) + the settle
bound of P's cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# The 10 % left of the TTL covers the hosts' clock drift (ppm) and the time between D's send and P's stamp.
READ_DEADLINE_FRACTION = 0.9

# A write P cancelled (its pending handle released) moves no byte after this long: NIXL cancels a released request
# at once; a device copy already running (CUDA IPC) ends within milliseconds.
STREAM_SETTLE_S = 0.05
# The share of D's stream timeout kept beyond P's window + the settle bound: the hosts' clock rate difference (ppm)
# and the delay of a stream request that reaches P after D stopped waiting for its answer.
STREAM_MARGIN_FRACTION = 0.1
# P refuses a renewal or push request that reached it later than this share of the lease's TTL after it would have,
# had it travelled as fast as the claim did (a message held back in the network keeps no lease alive).
RENEWAL_TRANSIT_FRACTION = 0.5
# P's refusal of such a message: D takes it as "not renewed" (its bounds do not move), not as a lost lease.
RENEWAL_TOO_LATE = "renewal too late: held back in the network past its transit bound"
# The write window D asks for when none is configured: this share of its stream timeout.
STREAM_WINDOW_FRACTION = 0.8


@dataclass(slots=True)
class RenewalClock:
    """For one load: per part, the send time of the last claim or renewal P acknowledged, and the lease's TTL."""

    renewed: dict[int, tuple[float, float]] = field(default_factory=dict)  # part -> (sent at, ttl)

    def acknowledged(self, part: int, sent_at: float, ttl_s: float) -> None:
        """P answered yes to a claim or renewal of ``part`` that D sent at ``sent_at``."""
        previous = self.renewed.get(part)
        if previous is None or sent_at > previous[0]:
            self.renewed[part] = (sent_at, ttl_s)

    def deadline(self) -> float:
        """Until when every part's lease is certainly live at P (inf: nothing claimed yet)."""
        if not self.renewed:
            return float("inf")
        return min(sent + ttl * READ_DEADLINE_FRACTION for sent, ttl in self.renewed.values())

    def outlived(self, now: float) -> bool:
        return now >= self.deadline()


def renewal_too_late(now: float, claimed_at: float, since_claim: float, ttl_s: float) -> bool:
    """P's check of a renewal or push request that carries ``since_claim`` (D's seconds from sending the claim to
    building it; negative: a D that sends none, unchecked): it arrived later than the bound lets D count on."""
    if not math.isfinite(since_claim):  # hostile, or broken: no bound can be taken from it
        return True
    return since_claim >= 0 and now - claimed_at - since_claim > ttl_s * RENEWAL_TRANSIT_FRACTION


@dataclass(slots=True)
class WriteBound:
    """For one push load, in D's clock: per part, its claim's send and answer times and the lease's TTL, and when D
    built the last renewal or push request it sent. :meth:`deadline` is the instant after which no write of P can
    land in the load's blocks, whether P is alive or not."""

    claims: dict[int, tuple[float, float, float]] = field(default_factory=dict)  # part -> (sent, answered, ttl)
    built: dict[int, float] = field(default_factory=dict)  # part -> the last renewal or push request built

    def claimed(self, part: int, sent_at: float, answered_at: float, ttl_s: float) -> None:
        self.claims[part] = (sent_at, answered_at, ttl_s)

    def since_claim(self, part: int, now: float) -> float:
        """What a message about ``part`` built ``now`` carries (-1 before the claim was answered)."""
        claim = self.claims.get(part)
        if claim is None:
            return -1.0
        self.built[part] = max(self.built.get(part, now), now)
        return max(0.0, now - claim[0])

    def deadline(self) -> float:
        """The latest instant a write of P may land (-inf: nothing claimed, so no write was asked for)."""
        end = -math.inf
        for part, (sent, answered, ttl) in self.claims.items():
            received = answered  # P accepted the claim before answering it
            if part in self.built:
                received = max(received, self.built[part] + (answered - sent) + ttl * RENEWAL_TRANSIT_FRACTION)
            end = max(end, received + ttl / READ_DEADLINE_FRACTION + STREAM_SETTLE_S)
        return end


def default_write_window(stream_timeout_s: float) -> float:
    """The write window D asks of P when its options name none."""
    return stream_timeout_s * STREAM_WINDOW_FRACTION


def min_stream_timeout(write_window_s: float) -> float:
    """The bound D's stream timeout must exceed for a window: P's window + the settle bound, over the margin."""
    return (write_window_s + STREAM_SETTLE_S) / (1.0 - STREAM_MARGIN_FRACTION)


def check_stream_window(*, write_window_s: float, stream_timeout_s: float, reservation_ttl_s: float) -> None:
    """``ValueError`` for a stream configuration under which D could free blocks a write of P may still land in
    (a timeout too short for the window), or P drop a reservation D still waits on (a TTL shorter than the window)."""
    if not (math.isfinite(write_window_s) and write_window_s > 0):
        raise ValueError(f"write_window_s must be a positive finite duration, got {write_window_s!r}")
    floor = min_stream_timeout(write_window_s)
    if not stream_timeout_s > floor:
        raise ValueError(
            f"stream_timeout_s={stream_timeout_s:g} must exceed {floor:.3f} s for write_window_s={write_window_s:g}: "
            f"(window + {STREAM_SETTLE_S:g} s settle) / {1 - STREAM_MARGIN_FRACTION:g}; else D may free blocks "
            f"under a write of P (shorten write_window_s or lengthen stream_timeout_s)")
    if reservation_ttl_s < write_window_s:
        raise ValueError(f"reservation_ttl_s={reservation_ttl_s:g} is shorter than write_window_s={write_window_s:g}: "
                         f"P would drop a reservation D still waits on")


@dataclass(slots=True)
class WriteWindow:
    """P's side of a stream's window, in P's clock: no layer posted at or after ``deadline``, and the writes still
    in flight then cancelled."""

    deadline: float

    @classmethod
    def received(cls, now: float, write_window_s: float) -> WriteWindow:
        """The window of a stream request P received at ``now``."""
        return cls(now + write_window_s)

    def closed(self, now: float) -> bool:
        return now >= self.deadline

    def left(self, now: float) -> float:
        """Seconds still open (0 once closed)."""
        return max(0.0, self.deadline - now)
