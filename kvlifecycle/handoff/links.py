"""D's view of one P rank after a handshake (:class:`PeerLink`), the replies D accepts on its side channel, and
the fields P attaches when it refuses a handshake as incompatible."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvlifecycle.control import REPLY_TYPES as _CONTROL_REPLIES
from kvlifecycle.handshake import HandshakePlan, MetaReply
from kvlifecycle.path_selection import PathChoice
from kvlifecycle.sidechannel import SideChannelClient
from kvlifecycle.transport import PreparedPlan, ProbeResult, Transport
from kvlifecycle.untrusted import check_msgpack

__all__ = ["REPLY_TYPES", "PeerLink", "compat_fields"]

REPLY_TYPES = (MetaReply, *_CONTROL_REPLIES)

_Scalar = str | int | float | bool | None
_fields_decoder = msgspec.msgpack.Decoder(list[tuple[str, _Scalar, _Scalar]])


def compat_fields(detail: bytes) -> list[tuple[str, object, object]]:
    """The (field, D's value, P's value) list P attached to its compat refusal; [] if it attached none usable."""
    try:
        check_msgpack(detail, max_depth=3)
        return [(name, mine, theirs) for name, mine, theirs in _fields_decoder.decode(detail)]
    except Exception:  # an older or hostile peer: the message still says what differs
        return []


@dataclass(slots=True)
class PeerLink:
    """D's view of one P rank after a handshake."""

    address: str
    agent: str
    epoch: int
    plan: HandshakePlan
    prepared: PreparedPlan  # the descriptor lists for this P rank's read
    client: SideChannelClient
    probe: ProbeResult | None = None
    data: Transport | None = None  # the transport that moves this link's bytes (None: the Consumer's own)
    data_peer: str = ""  # P's name on ``data`` ("" : ``agent``)
    choice: PathChoice | None = None  # why ``data`` was chosen and what its self-test measured
    host: PreparedPlan | None = None  # reads from P's host staging pool (None: P offered none, or unreachable)
