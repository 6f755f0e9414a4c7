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
