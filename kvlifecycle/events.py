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
    """Every event is frozen; a subclass says ``frozen=True`` again so that type checkers, which do not read
    msgspec's inherited configuration, know it too."""

    hlc: int
    at: float


# --- source (prefill) side -------------------------------------------------------------------------------------


class SrcAllocated(Event, tag="sa", frozen=True):
    request: str
    blocks: bytes  # int32 block ids


class SrcShared(Event, tag="ss", frozen=True):
    """The request references blocks another request holds (prefix hit): no epoch bump."""

    request: str
    blocks: bytes


class SrcPrefillDone(Event, tag="sp", frozen=True):
    request: str


class SrcGranted(Event, tag="sg", frozen=True):
    request: str
    transfer: str
    generation: int
    consumers: int
    expires_at: float
    peer: str = ""


class SrcLeaseRenewed(Event, tag="sr", frozen=True):
    transfer: str
    expires_at: float
    peer: str = ""  # the consumer that renewed (claimed) it: a restart of that peer releases the lease
    # False for a keepalive of a lease nobody claimed yet (D waits to start its read): that renewal must not make
    # a cancel wait for a reader that does not exist. Older logs lack the field: every renewal claimed then.
    claims: bool = True


class SrcCancelDeferred(Event, tag="sd", frozen=True):
    """A cancel hit a lease whose consumer already claimed it: the pins stay until that consumer completes,
    fails or the lease expires (releasing under a reader is how wrong tokens happen, vLLM #21570)."""

    transfer: str


class SrcConsumerDone(Event, tag="sc", frozen=True):
    transfer: str
    consumer: int


class SrcLeaseReleased(Event, tag="sl", frozen=True):
    """The one release path: ``reason`` is completed, failed, cancelled, expired or peer_restarted."""

    transfer: str
    reason: str
    detail: str = ""


class SrcFreed(Event, tag="sf", frozen=True):
    request: str
    cached: bool


class SrcAborted(Event, tag="sx", frozen=True):
    request: str


class SrcEvicted(Event, tag="se", frozen=True):
    blocks: bytes


# --- target (decode) side --------------------------------------------------------------------------------------


class TgtReserved(Event, tag="tr", frozen=True):
    request: str
    blocks: bytes


class TgtLoadStarted(Event, tag="tl", frozen=True):
    request: str
    transfer: str
    parts: int
    generation: int = 0  # the source lease generation this load reads under
    peer: str = ""
    peer_epoch: int = 0
    mode: str = "pull"  # pull: D reads P's pinned blocks; push: P writes into D's blocks
    # 0: each part completes as a whole; n >= 1: layer-wise streaming, a part completes (TgtPartDone, recorded by the
    # ledger itself) once each of the n layers of each of the request's blocks landed (TgtLayersLanded)
    layers: int = 0


class TgtLayersLanded(Event, tag="ty", frozen=True):
    """Layers ``[first_layer, first_layer + num_layers)`` of ``blocks`` (D's block ids) landed for ``part`` of a
    streaming load: one event per layer batch, never one per block. A (part, block, layer) lands once.
    ``verified`` (appended): the batch's bytes matched P's digest where they landed (False: not checked); a part
    all of whose batches were verified records its blocks as ``TgtPartDone.verified``."""

    transfer: str
    part: int
    first_layer: int
    num_layers: int
    blocks: bytes
    verified: bool = False


class TgtLoadDeclined(Event, tag="tw", frozen=True):
    """The source declined a streaming load before writing any byte (its prefill had started without D's
    reservation): the blocks go back to RESERVED for the post-prefill path, whatever the failure policy."""

    transfer: str
    reason: str


class TgtPartDone(Event, tag="tp", frozen=True):
    """``part`` of a load landed (the last part makes its blocks READY_FOR_ATTENTION). ``verified``: how many of
    its units (P blocks) D digested where they landed and found equal to P's digests before this completion
    (:mod:`kvlifecycle.digest`); 0 when the part was not checked (verification off, no digests in the grant, a
    block-size split, a stream's layers). Its failure is a ``TgtDigestMismatch`` instead, never this event."""

    transfer: str
    part: int
    verified: int = 0


class TgtLoadFailed(Event, tag="tf", frozen=True):
    transfer: str
    reason: str
    recompute: bool


class TgtDigestMismatch(Event, tag="tv", frozen=True):
    """D's digest of what landed for ``part`` of a load differs from P's (:mod:`kvlifecycle.digest`): the load fails
    under the failure policy (the ``TgtLoadFailed`` that follows), and ``blocks`` (D's ids, ``pieces`` per unit: a
    P block under a block-size split) stay out of any reservation until ``quarantine_until``. ``expected`` and
    ``found`` hold one little-endian u64 digest per unit; ``slice_index`` is the head slice checked (the consumer
    index of a lease several D ranks read), ``source_blocks`` P's ids of the units. A stream's layer batch
    (``num_layers`` > 0, appended) is one unit: its blocks, layers ``[first_layer, first_layer + num_layers)``,
    P's batch digest, and its first position in D's reservation as ``source_blocks`` (P writes by position)."""

    transfer: str
    part: int
    slice_index: int
    blocks: bytes  # int32 D block ids
    source_blocks: bytes  # int32 P block ids, one per unit
    expected: bytes
    found: bytes
    pieces: int = 1
    quarantine_until: float = 0.0
    first_layer: int = 0
    num_layers: int = 0  # 0: a pull's or push's blocks, one unit per P block


class TgtCancelled(Event, tag="tc", frozen=True):
    request: str


class TgtLocalFilled(Event, tag="tq", frozen=True):
    request: str


class TgtFinished(Event, tag="tz", frozen=True):
    request: str


# --- P's host staging pool -------------------------------------------------------------------------------------


class StgStarted(Event, tag="ha", frozen=True):
    """A copy of an unclaimed lease's GPU blocks (``gpu_blocks``, P's block ids at ``gpu_epoch``) into host slots
    ``blocks`` is posted. The staged copy carries the lease on: its token is the lease's (transfer, generation)."""

    request: str
    transfer: str
    generation: int
    blocks: bytes  # int32 host slot ids
    gpu_blocks: bytes  # int32 P block ids the copy reads
    gpu_epoch: int
    consumers: int
    expires_at: float
    ttl_s: float  # the lease's time to live: a claim of the staged copy renews it by this much


class StgCompleted(Event, tag="hc", frozen=True):
    """The device -> host copy completed: every byte of the slots is written (the copy's stream event fired)."""

    transfer: str


class StgAborted(Event, tag="hx", frozen=True):
    """A copy in flight was dropped (failed, a consumer claimed the GPU copy first, P restarted): never served."""

    transfer: str
    reason: str


class StgServed(Event, tag="hs", frozen=True):
    """A consumer claimed the staged copy: its read of the host slots may be in flight from now on."""

    transfer: str
    expires_at: float
    peer: str = ""


class StgRenewed(Event, tag="hr", frozen=True):
    """A consumer renewed the staged copy's lease without starting a read (a keepalive before its read, or its
    claimant's renewal during one): the expiry moves, the readers stay."""

    transfer: str
    expires_at: float
    peer: str = ""


class StgReadEnded(Event, tag="he", frozen=True):
    """A consumer's read of the staged copy ended: ``ok`` it completed (counts as that consumer done), else failed."""

    transfer: str
    consumer: int
    ok: bool
    reason: str = ""


class StgReleased(Event, tag="hl", frozen=True):
    """The staged copy's lease ended (completed, failed, cancelled, expired or peer_restarted): its slots are free."""

    transfer: str
    reason: str
    detail: str = ""


# --- both sides ------------------------------------------------------------------------------------------------


class PeerEpochChanged(Event, tag="pe", frozen=True):
    peer: str
    epoch: int


class TransferObserved(Event, tag="to", frozen=True):
    """Data-plane facts about one transfer (for metrics and timelines; changes no block state)."""

    transfer: str
    t_post_s: float
    t_xfer_s: float
    nbytes: int
    descriptors: int
    backend: str
    ok: bool


class Refused(Event, tag="rf", frozen=True):
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
    TgtLayersLanded,
    TgtLoadDeclined,
    TgtPartDone,
    TgtLoadFailed,
    TgtDigestMismatch,
    TgtCancelled,
    TgtLocalFilled,
    TgtFinished,
    StgStarted,
    StgCompleted,
    StgAborted,
    StgServed,
    StgRenewed,
    StgReadEnded,
    StgReleased,
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


def digest_hex(raw: bytes) -> list[str]:
    """Packed little-endian u64 digests as 16-digit hex strings (how a story and ``explain`` print them)."""
    return [f"{int(v):016x}" for v in np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<u8")]


def to_dict(event: Event) -> dict[str, Any]:
    """A JSON-friendly view (block arrays become lists)."""
    out: dict[str, Any] = {"kind": type(event).__name__}
    for name in event.__struct_fields__:
        value = getattr(event, name)
        out[name] = (unpack_blocks(value).tolist() if name in ("blocks", "gpu_blocks", "source_blocks")
                     else digest_hex(value) if name in ("expected", "found") else value)
    return out
