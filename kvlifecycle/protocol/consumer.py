"""D's protocol decisions: what a refused renewal, an answer to a hand-back and a load timeout mean for a load. The
threaded :class:`kvlifecycle.handoff.Consumer` and the simulator's D both ask these functions; what bounds a read
is :class:`~kvlifecycle.protocol.bounds.RenewalClock`."""

from __future__ import annotations

from typing import Literal

from kvlifecycle.protocol.writes import is_write_in_flight

Mode = Literal["pull", "push"]
# give_up: hand the lease back and keep the blocks LOADING until P answers (P's write may be landing);
# fail: fail the load now (nothing of this lease moves any more); drain_then_fail: take P's notifications first (a
# push's completion precedes the release that made the renewal fail), then fail if the load is still open
OnRefusal = Literal["give_up", "fail", "drain_then_fail"]


def on_renewal_refused(mode: Mode | str, detail: str) -> OnRefusal:
    """P refused a renewal of a live load's lease."""
    if is_write_in_flight(detail):  # expired under P's write: P cancels it and tells us
        return "give_up"
    return "drain_then_fail" if mode == "push" else "fail"


def on_push_unanswered() -> OnRefusal:
    """A PushRequest got no answer: P may have accepted it, and its write may be landing."""
    return "give_up"


def on_load_timeout(mode: Mode | str) -> OnRefusal:
    """The load ran past its timeout: D cancels its own reads, but only P can stop its write."""
    return "give_up" if mode == "push" else "fail"


def hand_back_settles(ok: bool, detail: str) -> bool:
    """P answered a hand-back: True when the load may fail now (P released the lease, or it was gone: no write of
    it is in flight), False when P is still cancelling its write (its ``failed`` notification settles the load)."""
    return ok or not is_write_in_flight(detail)
