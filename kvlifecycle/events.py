"""Versioned, compact events: one per command (a request's blocks travel as one int32 array, not one event each).

Every event carries ``hlc`` (hybrid logical clock stamp, for merging P and D logs) and ``at`` (the ledger's
injectable clock, in seconds, which lease expiry is computed on). Events are msgspec structs encoded as msgpack
arrays with a short tag; the schema version is written in each segment header and bumped on any incompatible
change (fields are only ever appended, with defaults, within a version).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

SCHEMA_VERSION = 1  # what it covers, its history and when to bump it: docs/wire.md

BLOCK_DTYPE = np.dtype("<i4")


def pack_blocks(block_ids: np.ndarray) -> bytes:
    return np.ascontiguousarray(block_ids, dtype=BLOCK_DTYPE).tobytes()


def unpack_blocks(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=BLOCK_DTYPE)


class Event(msgspec.Struct, frozen=True, array_like=True, tag_field="k"):
    hlc: int
    at: float


# --- source (prefill) side -------------------------------------------------------------------------------------


class SrcAllocated(Event, tag="sa"):
    request: str
    blocks: bytes  # int32 block ids


class SrcShared(Event, tag="ss"):
    """The request references blocks another request holds (prefix hit): no epoch bump."""

    request: str
    blocks: bytes


class SrcPrefillDone(Event, tag="sp"):
    request: str


class SrcGranted(Event, tag="sg"):
    request: str
    transfer: str
    generation: int
    consumers: int
    expires_at: float
    peer: str = ""


class SrcLeaseRenewed(Event, tag="sr"):
    transfer: str
    expires_at: float
    peer: str = ""  # the consumer that renewed (claimed) it: a restart of that peer releases the lease


class SrcCancelDeferred(Event, tag="sd"):
    """A cancel hit a lease whose consumer already claimed it: the pins stay until that consumer completes,
    fails or the lease expires (releasing under a reader is how wrong tokens happen, vLLM #21570)."""

    transfer: str


class SrcConsumerDone(Event, tag="sc"):
    transfer: str
    consumer: int


class SrcLeaseReleased(Event, tag="sl"):
    """The one release path: ``reason`` is completed, failed, cancelled, expired or peer_restarted."""

    transfer: str
    reason: str
    detail: str = ""


class SrcFreed(Event, tag="sf"):
    request: str
    cached: bool


class SrcAborted(Event, tag="sx"):
    request: str


class SrcEvicted(Event, tag="se"):
    blocks: bytes


# --- target (decode) side --------------------------------------------------------------------------------------


class TgtReserved(Event, tag="tr"):
    request: str
    blocks: bytes


class TgtLoadStarted(Event, tag="tl"):
    request: str
    transfer: str
    parts: int
    generation: int = 0  # the source lease generation this load reads under
    peer: str = ""
    peer_epoch: int = 0
    mode: str = "pull"  # pull: D reads P's pinned blocks; push: P writes into D's blocks


class TgtPartDone(Event, tag="tp"):
    transfer: str
    part: int


class TgtLoadFailed(Event, tag="tf"):
    transfer: str
    reason: str
    recompute: bool


class TgtCancelled(Event, tag="tc"):
    request: str


class TgtLocalFilled(Event, tag="tq"):
    request: str


class TgtFinished(Event, tag="tz"):
    request: str


# --- both sides ------------------------------------------------------------------------------------------------


class PeerEpochChanged(Event, tag="pe"):
    peer: str
    epoch: int


class TransferObserved(Event, tag="to"):
    """Data-plane facts about one transfer (for metrics and timelines; changes no block state)."""

    transfer: str
    t_post_s: float
    t_xfer_s: float
    nbytes: int
    descriptors: int
    backend: str
    ok: bool


class Refused(Event, tag="rf"):
    """A command that was refused: it changed nothing, and this records why."""

    command: str
    reason: str
    request: str = ""
    transfer: str = ""


AnyEvent = Union[  # noqa: UP007 - msgspec needs a real Union object here
    SrcAllocated,
    SrcShared,
    SrcPrefillDone,
    SrcGranted,
    SrcLeaseRenewed,
    SrcCancelDeferred,
    SrcConsumerDone,
    SrcLeaseReleased,
    SrcFreed,
    SrcAborted,
    SrcEvicted,
    TgtReserved,
    TgtLoadStarted,
    TgtPartDone,
    TgtLoadFailed,
    TgtCancelled,
    TgtLocalFilled,
    TgtFinished,
    PeerEpochChanged,
    TransferObserved,
    Refused,
]


def _encode_extra(value: Any) -> Any:
    """Values msgpack has no type for. A numpy scalar (a block id or a count taken from an array) is written as the
    Python number it holds; anything else is refused with a ``TypeError`` naming its type."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"an event cannot hold a value of type {type(value).__name__}: {value!r}")


ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
DECODER = msgspec.msgpack.Decoder(AnyEvent)


def encode(event: Event) -> bytes:
    return ENCODER.encode(event)


def decode(payload: bytes) -> Event:
    return DECODER.decode(payload)


def to_dict(event: Event) -> dict:
    """A JSON-friendly view (block arrays become lists)."""
    out: dict = {"kind": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        out[name] = unpack_blocks(value).tolist() if name == "blocks" else value
    return out
