"""How a :class:`~kvlifecycle.handoff.Producer` or :class:`~kvlifecycle.handoff.Consumer` runs: one frozen,
validated options value both sides take."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from kvlifecycle import validators as v
from kvlifecycle.digest import VerifyMode

if TYPE_CHECKING:
    from kvlifecycle.handoff.links import PeerLink
    from kvlifecycle.transport import ProbeResult

__all__ = ["HandoffOptions"]


def _verify_mode(value: object) -> VerifyMode:
    return VerifyMode.parse(value, "verify")


@attrs.frozen(kw_only=True)
class HandoffOptions:
    """How a :class:`Producer` or :class:`Consumer` runs; validated when made (a field of the wrong type or out of
    range is refused with its name)."""

    secret: bytes | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.instance_of(bytes)))  # side-channel HMAC key shared by P and D
    host: str = attrs.field(default="127.0.0.1", validator=v.text)
    port: int = attrs.field(default=0, validator=v.port)
    service_poll_s: float = attrs.field(default=0.0005, validator=v.positive)  # while transfers are in flight
    # nothing in flight: sweep leases and commit the log at this rhythm
    idle_poll_s: float = attrs.field(default=0.005, validator=v.positive)
    request_timeout_s: float = attrs.field(default=5.0, validator=v.positive)
    load_timeout_s: float = attrs.field(default=60.0, validator=v.positive)
    # default: a sixth of the grant's TTL (vLLM's rhythm)
    heartbeat_every_s: float | None = attrs.field(default=None, validator=v.optional(v.positive))
    # head_size × dtype bytes, for heterogeneous TP views (0: views are already in bytes)
    unit_bytes: int = attrs.field(default=0, validator=v.integer(0))
    probe: bool = attrs.field(default=True, validator=v.flag)  # move a small test payload at connect time
    probe_floor_gbps: float = attrs.field(default=0.2, validator=v.number)  # warn below this: never a silent slow path
    # e.g. transports.select / OTel
    on_connect: Callable[[PeerLink, ProbeResult | None], None] | None = attrs.field(default=None, validator=v.callback)
    # a load that never started (claim refused: P's lease was already gone): the engine learns it here — the
    # ledger has no load to fail, the reservation was cancelled (policy "fail") or kept for recompute
    on_abandoned: Callable[[str, str], None] | None = attrs.field(default=None, validator=v.callback)
    # per-block digests (kvlifecycle.digest): P digests the transfers this chooses, D checks every grant that
    # carries digests before its part is done. Off by default: docs/performance.md has its measured cost
    verify: VerifyMode = attrs.field(default=VerifyMode.NONE, converter=_verify_mode)
    # how long D keeps a block whose bytes failed their digest out of any reservation (the default TTL)
    quarantine_s: float = attrs.field(default=30.0, validator=v.number)
