"""The control messages the simulated workers exchange, one dataclass each (the side channel's request/reply
pairs, and the grant a proxy carries from P to D). They mirror the Producer/Consumer messages field for field."""

from __future__ import annotations

from dataclasses import dataclass

from kvlifecycle.transport import Notification, PeerMetadata


@dataclass(frozen=True, slots=True)
class GrantInfo:
    """A published grant of one P rank (``GrantReply``)."""

    request: str
    transfer: str
    generation: int
    worker: str
    block_ids: tuple[int, ...]
    consumers: int
    ttl_s: float
    agent: str
    agent_epoch: int
    epoch: int  # allocation epoch of the granted blocks
    rank: int
    ranks: int
    stream: bool = False  # what a layer-wise stream writes (no lease: P's blocks are held by its request)


@dataclass(frozen=True, slots=True)
class GrantArrived:
    """P -> D through the proxy: what vLLM carries in ``kv_transfer_params``."""

    grant: GrantInfo
    mode: str  # pull | push


@dataclass(frozen=True, slots=True)
class Call:
    """A side-channel request; the reply names ``call``."""

    call: int
    body: object


@dataclass(frozen=True, slots=True)
class Reply:
    call: int
    ok: bool
    detail: str = ""
    meta: PeerMetadata | None = None


@dataclass(frozen=True, slots=True)
class GetMeta:
    agent: str
    epoch: int
    meta: PeerMetadata | None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    transfer: str
    generation: int
    agent: str
    hlc: int


@dataclass(frozen=True, slots=True)
class LoadFailed:
    transfer: str
    generation: int
    reason: str
    hlc: int


@dataclass(frozen=True, slots=True)
class PushRequest:
    transfer: str
    generation: int
    agent: str
    epoch: int
    blocks: tuple[int, ...]
    target_request: str
    part: int


@dataclass(frozen=True, slots=True)
class NoteMsg:
    """A transport notification on the wire (it rides the same simulated network)."""

    note: Notification
