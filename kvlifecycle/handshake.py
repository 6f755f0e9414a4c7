"""Compatibility and agent epochs: what P and D check before any request moves.

- :class:`CompatInfo` is hashed (model id, dtype, layers, KV heads, head size, block size, KV layout, TP size,
  wire version). Equal hashes are accepted at once; otherwise :func:`negotiate` compares field by field: the
  model fields must match exactly, a TP size or block size difference is accepted only when a descriptor mapping
  exists (:mod:`kvlifecycle.layout`), and everything else is refused with one line per differing field.
- Agent epochs: every start of a worker gets a new epoch. A peer seen again on the same host:port with a new epoch
  restarted: its old metadata is void (:class:`EpochTracker` says so; the caller removes and re-adds the NIXL agent
  and tells the ledger).
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from kvlifecycle import layout as L
from kvlifecycle.transport import WIRE_VERSION, BlockView, PeerMetadata
from kvlifecycle.untrusted import check_msgpack

STRICT_FIELDS = ("wire_version", "model_id", "dtype", "num_layers", "num_kv_heads", "head_size", "kv_layout",
                 "kv_replicated")

# Decoding checks these bounds (msgspec constraints), so a peer's zero TP size or negative head count is refused as
# malformed before any arithmetic divides by it. The bounds are far beyond any real model.
_Count = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]
_Name = Annotated[str, msgspec.Meta(max_length=256)]
_Index = Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]
_Counter = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]


class CompatInfo(msgspec.Struct, frozen=True, kw_only=True):
    model_id: _Name
    dtype: _Name
    num_layers: _Count
    num_kv_heads: _Count  # total over all TP ranks
    head_size: _Count
    block_size: _Count  # tokens per block
    kv_layout: Annotated[str, msgspec.Meta(pattern="^(NHD|HND)$")]
    tp_size: _Count = 1
    wire_version: _Counter = WIRE_VERSION
    # every TP rank holds the whole KV (MLA's latent cache) instead of a slice of the heads: nothing to split
    kv_replicated: bool = False

    def compat_hash(self) -> str:
        fields = [getattr(self, f) for f in self.__struct_fields__]
        return hashlib.sha256(msgspec.msgpack.encode([list(self.__struct_fields__), fields])).hexdigest()[:32]


class CompatMismatchError(Exception):
    """Raised at handshake; ``fields`` lists (field, local, remote) for every difference that matters."""

    def __init__(self, message: str, fields: list[tuple[str, object, object]]) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True, slots=True)
class HandshakePlan:
    """How a D rank reads from P: one entry per P rank it reads, the views, and the counts both ledgers need."""

    reads: tuple[L.TPRead, ...]
    consumers_per_p_rank: int  # P's grant(consumers=...)
    parts: int  # D's start_load(parts=...)
    local_split: int = 1  # block size mapping: D sub-blocks per D block
    remote_split: int = 1


def diff_fields(local: CompatInfo, remote: CompatInfo) -> list[tuple[str, object, object]]:
    return [(f, getattr(local, f), getattr(remote, f)) for f in local.__struct_fields__
            if getattr(local, f) != getattr(remote, f)]


def _mismatch(local: CompatInfo, remote: CompatInfo, fields: list[tuple[str, object, object]], why: str) -> str:
    lines = [f"incompatible peer ({why}); local hash {local.compat_hash()}, remote hash {remote.compat_hash()}:"]
    lines += [f"  {name}: local={mine!r} remote={theirs!r}" for name, mine, theirs in fields]
    return "\n".join(lines)


def negotiate(d: CompatInfo, p: CompatInfo, *, d_rank: int = 0) -> HandshakePlan:
    """D's view of a P peer: the read plan, or :class:`CompatMismatchError` with a field-by-field message."""
    fields = diff_fields(d, p)
    strict = [f for f in fields if f[0] in STRICT_FIELDS]
    if strict:
        raise CompatMismatchError(_mismatch(d, p, strict, "fields that must match"), strict)
    if not fields:
        return HandshakePlan((L.TPRead(d_rank, BlockView(), BlockView()),), 1, 1)
    tp_differs = d.tp_size != p.tp_size
    bs_differs = d.block_size != p.block_size
    if tp_differs and bs_differs:
        raise CompatMismatchError(_mismatch(d, p, fields, "TP size and block size both differ: unsupported"), fields)
    if tp_differs and d.kv_replicated:
        # a head split of a replicated cache would hand each D rank parts of several copies; one real sender per
        # D rank and the other P ranks standing by (SGLang's dummy ranks) is not mapped
        raise CompatMismatchError(_mismatch(d, p, fields, "the KV is replicated on every TP rank (MLA): moving it "
                                                          "between different TP sizes is unsupported, run P and D "
                                                          "at one TP size"), fields)
    # bytes per block and rank, in units of one head × one token × head_size (the dtype is the same on both sides)
    try:
        if tp_differs:
            p_heads, d_heads = d.num_kv_heads // p.tp_size, d.num_kv_heads // d.tp_size
            plan = L.tp_plan(p_tp=p.tp_size, d_tp=d.tp_size, d_rank=d_rank,
                             p_block_bytes=p_heads * p.block_size, d_block_bytes=d_heads * d.block_size,
                             num_kv_heads=d.num_kv_heads, kv_layout=d.kv_layout, block_size=d.block_size)
            return HandshakePlan(plan.reads, plan.consumers_per_p_rank, plan.parts)
        views = L.block_size_views(local_block_size=d.block_size, remote_block_size=p.block_size,
                                   kv_layout=d.kv_layout)
        read = L.TPRead(d_rank, views.remote_view, views.local_view)
        return HandshakePlan((read,), 1, 1, views.local_split, views.remote_split)
    except L.UnsupportedMappingError as exc:
        raise CompatMismatchError(_mismatch(d, p, fields, str(exc)), fields) from exc


def scale_view(view: BlockView, unit_bytes: int) -> BlockView:
    """A view computed in (head × token) units, scaled to bytes (``unit_bytes`` = head_size × dtype size,
    times 2 for a fused K+V region where K and V of one block are laid out like two halves)."""
    return BlockView(view.offset * unit_bytes, view.length * unit_bytes, view.split)


# --- handshake messages ------------------------------------------------------------------------------------------


class GetMeta(msgspec.Struct, frozen=True, tag=True):
    """D → P: who I am, what I run; answer with your metadata (for ``tp_rank``)."""

    compat: CompatInfo
    tp_rank: _Index
    agent: _Name
    epoch: _Counter
    meta: PeerMetadata | None = None  # D's own metadata, for push mode (P writes into D)
    # D's same-node fast path (CUDA IPC) next to ``meta``, for push mode: P's path selector picks it for its writes
    # when both sides hold VRAM on one node and its self-test passes. Optional with a default, as
    # ``MetaReply.fast_meta``: an older D's GetMeta still decodes (None: P writes through ``meta``'s transport).
    fast_meta: PeerMetadata | None = None


class MetaReply(msgspec.Struct, frozen=True, tag=True):
    compat: CompatInfo
    tp_rank: _Index
    meta: PeerMetadata
    # P's same-node fast path (CUDA IPC) next to ``meta`` (NIXL): D picks it when both sides hold VRAM on one
    # node and its connect-time self-test passes. Optional with a default: an older peer's reply still decodes
    # (msgspec skips fields it does not know, and fills this one with None).
    fast_meta: PeerMetadata | None = None
    # P's host staging pool (kvlifecycle.staging), a region set laid out like ``meta``'s KV regions: a claim
    # answered from it (``Claimed.host_blocks``) is read from here. None: P stages nothing (or is older)
    host_meta: PeerMetadata | None = None


class MalformedHandshakeError(ValueError):
    """A handshake message that does not decode, or decodes into metadata no transport could use."""


_MAX_REGIONS = 1 << 16


def check_metadata(meta: PeerMetadata, who: str = "peer") -> None:
    """Refuse (:class:`MalformedHandshakeError`) metadata whose layout no transport could register: the checks
    :class:`~kvlifecycle.transport.KVLayout` makes, plus bounds on counts and addresses. Total."""
    wire = meta.layout
    addrs_ok = all(isinstance(a, int) and 0 <= a < 1 << 64 for a in [*wire.base_addrs, meta.probe_addr])
    sizes_ok = all(isinstance(b, int) and 0 < b < 1 << 40 for b in wire.block_bytes)
    if not (0 <= meta.epoch < 1 << 63 and 0 <= meta.probe_bytes < 1 << 40 and addrs_ok and sizes_ok
            and len(wire.base_addrs) <= _MAX_REGIONS and 0 < wire.num_blocks < 1 << 32):
        raise MalformedHandshakeError(f"{who}: metadata out of bounds (epoch, addresses, sizes or counts)")
    try:
        wire.to_layout()
    except Exception as exc:  # ValueError from KVLayout / MemoryKind: the layout cannot exist
        raise MalformedHandshakeError(f"{who}: impossible layout: {exc}") from exc


def check_meta_reply(reply: MetaReply, who: str = "peer") -> MetaReply:
    """``reply`` if every metadata it carries is usable, else :class:`MalformedHandshakeError`."""
    check_metadata(reply.meta, who)
    if reply.fast_meta is not None:
        check_metadata(reply.fast_meta, f"{who} (fast path)")
    if reply.host_meta is not None:
        check_metadata(reply.host_meta, f"{who} (host staging pool)")
    return reply


def check_get_meta(msg: GetMeta) -> GetMeta:
    """``msg`` if every metadata it carries is usable, else :class:`MalformedHandshakeError`."""
    if msg.meta is not None:
        check_metadata(msg.meta, msg.agent or "consumer")
    if msg.fast_meta is not None:
        check_metadata(msg.fast_meta, f"{msg.agent or 'consumer'} (fast path)")
    return msg


_handshake_decoder = msgspec.msgpack.Decoder(GetMeta | MetaReply)
_HANDSHAKE_MAX_BYTES = 1 << 20
_HANDSHAKE_MAX_DEPTH = 8  # MetaReply → PeerMetadata → LayoutWire → a list: 4 levels


def decode_handshake(raw: bytes) -> GetMeta | MetaReply:
    """Total decoder of one handshake message body: a checked :class:`GetMeta` / :class:`MetaReply` or
    :class:`MalformedHandshakeError` — whatever the bytes. (The side channel opens its frames the same way; this is
    the handshake's own entry point for a body received by other means.)"""
    if not isinstance(raw, (bytes, bytearray, memoryview)) or len(raw) > _HANDSHAKE_MAX_BYTES:
        raise MalformedHandshakeError("a handshake message is at most 1 MiB of bytes")
    try:
        raw = bytes(raw)
        check_msgpack(raw, max_depth=_HANDSHAKE_MAX_DEPTH)
        msg: Any = _handshake_decoder.decode(raw)
    except Exception as exc:  # UntrustedInputError, DecodeError, ValidationError: the sender's fault
        raise MalformedHandshakeError(f"not a handshake message: {type(exc).__name__}: {exc}") from exc
    return check_meta_reply(msg) if isinstance(msg, MetaReply) else check_get_meta(msg)


# --- agent epochs ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EpochChange:
    kind: str  # "new" | "same" | "restarted" | "stale"
    peer: str
    epoch: int
    previous: int | None


class EpochTracker:
    """Remembers the agent epoch last seen per peer key (host:port, or agent name)."""

    def __init__(self) -> None:
        self._epochs: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, peer: str, epoch: int) -> EpochChange:
        with self._lock:
            known = self._epochs.get(peer)
            if known is None:
                self._epochs[peer] = epoch
                return EpochChange("new", peer, epoch, None)
            if epoch == known:
                return EpochChange("same", peer, epoch, known)
            if epoch < known:
                return EpochChange("stale", peer, epoch, known)
            self._epochs[peer] = epoch
            return EpochChange("restarted", peer, epoch, known)

    def current(self, peer: str) -> int | None:
        with self._lock:
            return self._epochs.get(peer)
