"""The data-plane contract: a :class:`Transport` protocol and the frozen value types it speaks.

Core-side and typing-only: no torch, no nixl. Implementations live in :mod:`kvlifecycle.transports`.

Life of a transport::

    t.register(layout)                        # once, at start-up: never on the request path
    meta = t.local_metadata()                 # travels to the peer over the side channel
    peer = t.add_peer(remote_meta)            # a peer with a new epoch replaces the old one (in-flight fail)
    plan = t.prepare(peer)                    # descriptor lists, once per (peer, layout view)
    h = t.post("READ", plan, local_ids, remote_ids, notification=...)   # returns at once
    t.poll(h) -> XferStatus                   # never blocks
    t.stats(h); t.release(h)                  # a released handle raises HandleReleasedError when used
    t.notifications()                         # drained (peer, Notification) pairs
    t.remove_peer(peer); t.close()            # nothing left registered

A transport that orders its copies on the device (:class:`DeviceOrderedPost`, the CUDA IPC transport) also takes
``t.post_after(event, "WRITE", plan, ...)``: the copy is enqueued behind ``event`` and the call returns at once, so
no thread waits for the work that writes the blocks.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import attrs
import msgspec
import numpy as np

from kvlifecycle import validators as v
from kvlifecycle.untrusted import check_msgpack

# The P/D wire's version: side-channel frames, their control messages and the notifications' meaning; a strict
# field of the compatibility hash. What each version changed and when to bump it: docs/wire.md.
WIRE_VERSION = 3


class MemoryKind(str, enum.Enum):
    DRAM = "DRAM"
    VRAM = "VRAM"


class XferOp(str, enum.Enum):
    READ = "READ"  # pull: the local side receives the remote's bytes
    WRITE = "WRITE"  # push: the local side sends its bytes to the remote


class XferStatus(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class Locality(str, enum.Enum):
    SAME_PROCESS = "same_process"
    SAME_NODE = "same_node"
    REMOTE = "remote"


@attrs.frozen
class BlockView:
    """Which bytes of each block a descriptor covers.

    ``offset``/``length`` select a slice of every block (heterogeneous TP: a rank's heads, HND layout);
    ``split`` cuts that slice into equal sub-blocks (P block size ≠ D block size, NHD layout). ``length=0`` means
    the whole block from ``offset``. Validated when made: a negative offset or a zero split is refused.
    """

    offset: int = attrs.field(default=0, converter=v.plain_int, validator=v.integer(0))
    length: int = attrs.field(default=0, converter=v.plain_int, validator=v.integer(0))
    split: int = attrs.field(default=1, converter=v.plain_int, validator=v.integer(1))


WHOLE_BLOCK = BlockView()


def _optional_kind(value: Any) -> MemoryKind | None:
    return None if value is None else MemoryKind(value)


@attrs.frozen
class RegionGroup:
    """``regions`` consecutive regions of a :class:`KVLayout` that hold ``num_blocks`` blocks each (SGLang: the KV
    pages, and the aux rows, whose count follows the running requests instead).

    ``kind``: the group's own memory kind, where it differs from the layout's (SGLang on a GPU: KV pages in VRAM,
    aux rows in host memory); None: the layout's. A layout whose groups name a kind is posted one group at a time
    by transports that keep one memory kind per descriptor list (NIXL)."""

    regions: int = attrs.field(converter=v.plain_int, validator=v.integer(1))
    num_blocks: int = attrs.field(converter=v.plain_int, validator=v.integer(1))
    kind: MemoryKind | None = attrs.field(default=None, converter=_optional_kind)


def _region_groups(values: Any) -> Any:
    """Converter: ``(regions, num_blocks)`` pairs or ``(regions, num_blocks, kind)`` triples (the wire's form)
    become :class:`RegionGroup` values."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return values
    return tuple(g if isinstance(g, RegionGroup) else RegionGroup(*g) for g in values)


@attrs.frozen
class KVLayout:
    """Where a worker's KV cache lives: ``len(base_addrs)`` regions (layer × K/V, or fused KV per layer), each
    ``num_blocks`` blocks of ``block_bytes[r]`` bytes laid out back to back from ``base_addrs[r]``.

    ``groups`` (optional) splits the regions into consecutive :class:`RegionGroup` s with block counts of their
    own. The block ids then form one space, group after group: group ``g``'s blocks are ids
    ``[sum(n_0..n_{g-1}), +n_g)`` and address only its regions, and ``num_blocks`` is the sum. So one ledger
    request, one lease and one post span every group (SGLang's pages and its aux row: ``pages + [n_0 + row]``).

    Validated when made, naming the field: ``KVLayout(MemoryKind.DRAM, 0, -4, ...)`` is a ``ValueError`` about
    ``num_blocks``; a float address a ``TypeError`` about ``base_addrs``.

    ``owner`` (optional, not compared, not sent) is what owns the memory: a layout built over buffers of its own
    (:class:`~kvlifecycle.transports.host_pool.HostPool`) names them, so that a transport holding the layout it
    registered keeps them alive; addresses alone would let the buffers go back to the allocator under the agent."""

    kind: MemoryKind = attrs.field(converter=MemoryKind)
    device_id: int = attrs.field(converter=v.plain_int, validator=v.integer(0))
    num_blocks: int = attrs.field(converter=v.plain_int, validator=v.integer(1))
    base_addrs: tuple[int, ...] = attrs.field(converter=v.plain_ints, validator=v.integers(0))
    block_bytes: tuple[int, ...] = attrs.field(converter=v.plain_ints, validator=v.integers(1))
    groups: tuple[RegionGroup, ...] = attrs.field(default=(), converter=_region_groups)
    owner: object = attrs.field(default=None, eq=False, repr=False, kw_only=True)

    @block_bytes.validator
    def _one_per_region(self, attribute: attrs.Attribute[tuple[int, ...]], value: tuple[int, ...]) -> None:
        if len(value) != len(self.base_addrs):
            raise ValueError(f"base_addrs and block_bytes need one entry per region, got {len(self.base_addrs)} "
                             f"and {len(value)}")

    @groups.validator
    def _groups_cover_the_layout(self, attribute: attrs.Attribute[tuple[RegionGroup, ...]],
                                 value: tuple[RegionGroup, ...]) -> None:
        if not isinstance(value, tuple) or not all(isinstance(g, RegionGroup) for g in value):
            raise TypeError(f"groups must be RegionGroup values, got {value!r}")
        if value and sum(g.regions for g in value) != len(self.base_addrs):
            raise ValueError(f"groups must cover the {len(self.base_addrs)} regions, got "
                             f"{sum(g.regions for g in value)}")
        if value and sum(g.num_blocks for g in value) != self.num_blocks:
            raise ValueError(f"groups' blocks must add up to num_blocks={self.num_blocks}, got "
                             f"{sum(g.num_blocks for g in value)}")

    @property
    def num_regions(self) -> int:
        return len(self.base_addrs)

    @property
    def region_groups(self) -> tuple[RegionGroup, ...]:
        """The groups; a layout made without any is one group of every region."""
        return self.groups or (RegionGroup(self.num_regions, self.num_blocks),)

    @property
    def region_blocks(self) -> tuple[int, ...]:
        """Blocks per region: its group's count."""
        return tuple(g.num_blocks for g in self.region_groups for _ in range(g.regions))

    @property
    def region_bytes(self) -> tuple[int, ...]:
        return tuple(b * n for b, n in zip(self.block_bytes, self.region_blocks, strict=True))

    @property
    def bytes_per_block_all_regions(self) -> int:
        return sum(self.block_bytes)

    @property
    def group_kinds(self) -> tuple[MemoryKind, ...]:
        """Each group's memory kind: its own, else the layout's."""
        return tuple(g.kind or self.kind for g in self.region_groups)

    @property
    def kinds_per_group(self) -> bool:
        """Whether any group names its own memory kind (then a NIXL post moves one group per transfer)."""
        return any(g.kind is not None for g in self.groups)

    def group_device(self, group: int) -> int:
        """The device id of ``group``'s descriptors: the layout's GPU for VRAM, 0 for host memory."""
        return self.device_id if self.group_kinds[group] is MemoryKind.VRAM else 0


class LayoutWire(msgspec.Struct, frozen=True):
    """:class:`KVLayout` on the wire."""

    kind: str
    device_id: int
    num_blocks: int
    base_addrs: list[int]
    block_bytes: list[int]
    # (regions, num_blocks) per region group; empty: one group. Defaulted, so an older peer's layout still decodes.
    groups: list[tuple[int, int]] = msgspec.field(default_factory=list)
    # each group's own memory kind ("" for the layout's), one per group, or empty: every group of the layout's kind.
    # Defaulted and sent only where a group names one, so layouts of one kind encode as before.
    group_kinds: list[str] = msgspec.field(default_factory=list)

    @classmethod
    def of(cls, layout: KVLayout) -> LayoutWire:
        kinds = [g.kind.value if g.kind is not None else "" for g in layout.groups] if layout.kinds_per_group else []
        return cls(layout.kind.value, layout.device_id, layout.num_blocks, list(layout.base_addrs),
                   list(layout.block_bytes), [(g.regions, g.num_blocks) for g in layout.groups], kinds)

    def to_layout(self) -> KVLayout:
        if self.group_kinds and len(self.group_kinds) != len(self.groups):
            raise ValueError(f"group_kinds names {len(self.group_kinds)} kinds for {len(self.groups)} groups")
        kinds = self.group_kinds or [""] * len(self.groups)
        return KVLayout(MemoryKind(self.kind), self.device_id, self.num_blocks, tuple(self.base_addrs),
                        tuple(self.block_bytes),
                        tuple(RegionGroup(r, n, k or None) for (r, n), k in zip(self.groups, kinds, strict=True)))


class PeerMetadata(msgspec.Struct, frozen=True):
    """What a peer needs to reach this transport: agent name, agent epoch, the transport's opaque blob, layout."""

    agent: str
    epoch: int
    transport: str
    blob: bytes
    layout: LayoutWire
    probe_addr: int = 0  # a small scratch region for the connect-time bandwidth probe (0: none)
    probe_bytes: int = 0


class Notification(msgspec.Struct, frozen=True, array_like=True):
    """A small message from one transport to its peer, after a transfer or on its own.

    ``kind``: ``done`` (a consumer finished), ``failed`` (the sender gave up), or anything the caller defines.
    ``part``: which consumer / P rank / layer group this is about.
    """

    request: str
    transfer: str
    generation: int
    epoch: int = 0
    kind: str = "done"
    part: int = 0
    payload: bytes = b""
    hlc: int = 0  # the sender's hybrid logical clock: the receiver observes it, so merged logs stay causal


_notif_encoder = msgspec.msgpack.Encoder()
_notif_decoder = msgspec.msgpack.Decoder(Notification)
NOTIFICATION_MAX_BYTES = 4096
_NOTIFICATION_MAX_DEPTH = 2  # a flat array of scalars; anything deeper is not a notification


def encode_notification(note: Notification) -> bytes:
    raw = _notif_encoder.encode(note)
    if len(raw) > NOTIFICATION_MAX_BYTES:
        raise ValueError(f"notification is {len(raw)} bytes, cap is {NOTIFICATION_MAX_BYTES}")
    return raw


def decode_notification(raw: bytes) -> Notification:
    """Total: any input either decodes to a :class:`Notification` or raises :class:`MalformedNotificationError`
    (oversized, not bytes, nested too deep, not msgpack, wrong shape, counters out of range). The caller counts and
    drops it; nothing else can come out of here into a transport's service thread."""
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise MalformedNotificationError(f"a notification is bytes, not {type(raw).__name__}")
    if len(raw) > NOTIFICATION_MAX_BYTES:
        raise MalformedNotificationError(f"notification of {len(raw)} bytes exceeds {NOTIFICATION_MAX_BYTES}")
    try:
        raw = bytes(raw)
        check_msgpack(raw, max_depth=_NOTIFICATION_MAX_DEPTH)
        note = _notif_decoder.decode(raw)
    except Exception as exc:  # UntrustedInputError, DecodeError, ValidationError: all the sender's fault
        raise MalformedNotificationError(f"not a kvlifecycle notification: {type(exc).__name__}: {exc}") from exc
    if not all(0 <= value < 1 << 63 for value in (note.generation, note.epoch, note.part, note.hlc)):
        raise MalformedNotificationError(f"a counter out of [0, 2**63) in a notification about {note.transfer!r}")
    return note


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """An opaque reference to one posted transfer. Identity is ``id`` within one transport."""

    id: int
    op: XferOp
    peer: str
    peer_epoch: int
    transfer: str = ""


@dataclass(frozen=True, slots=True)
class XferStats:
    """Data-plane facts about a finished transfer. Times are seconds; ``None`` fields were not available."""

    t_post_s: float
    t_xfer_s: float
    bytes: int
    desc_count: int
    backend: str
    from_telemetry: bool = False


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """A connect-time test transfer: bytes moved from the peer's scratch region, how long, which backend."""

    peer: str
    bytes: int
    seconds: float
    backend: str

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass(frozen=True, slots=True)
class PreparedPlan:
    """Descriptor lists prepared once for (peer, local view, remote view). ``post`` indexes into them."""

    key: int
    peer: str
    peer_epoch: int
    local_view: BlockView
    remote_view: BlockView
    local_blocks: int  # blocks addressable in the local view (num_blocks × split)
    remote_blocks: int
    num_regions: int
    # the layouts' region groups (KVLayout.region_groups; empty: not told): with several, a post's block ids
    # address their own group's regions
    local_groups: tuple[RegionGroup, ...] = ()
    remote_groups: tuple[RegionGroup, ...] = ()


# --- errors ----------------------------------------------------------------------------------------------------


class TransportError(Exception):
    """Base class of every data-plane error."""


class HandleReleasedError(TransportError):
    """A handle was used after :meth:`Transport.release`."""


class PeerEpochError(TransportError):
    """The peer restarted (new agent epoch): metadata, plans and in-flight transfers of the old epoch are void."""


class UnknownPeerError(TransportError):
    pass


class RemoteMismatchError(TransportError):
    """The remote layout or block ids cannot be matched with the local ones (shape, bounds, region count)."""


class RegistrationError(TransportError):
    pass


class BackendUnavailableError(TransportError):
    """The requested backend / plugin did not load."""


class MalformedNotificationError(TransportError):
    pass


class TransferFailedError(TransportError):
    pass


# --- the protocol ----------------------------------------------------------------------------------------------


@runtime_checkable
class Transport(Protocol):
    name: str  # "nixl", "loopback", ...
    agent: str  # this endpoint's agent name
    epoch: int  # this endpoint's agent epoch (new on every start)

    def register(self, layout: KVLayout) -> None:
        """Register the KV regions once. A second call raises :class:`RegistrationError`."""

    def local_metadata(self) -> PeerMetadata: ...

    def add_peer(self, meta: PeerMetadata) -> str:
        """Load a peer's metadata; returns the peer name. A known peer with a different epoch is removed first
        (its plans dropped, its in-flight transfers failed with :class:`PeerEpochError`)."""

    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        """Prepare both descriptor lists for a peer (cached per (peer, epoch, views))."""

    def post(
        self,
        op: XferOp | str,
        plan: PreparedPlan,
        local_blocks: np.ndarray | Sequence[int],
        remote_blocks: np.ndarray | Sequence[int],
        *,
        regions: np.ndarray | Sequence[int] | None = None,
        notification: Notification | None = None,
        transfer: str = "",
    ) -> TransferHandle:
        """Post a READ/WRITE of the listed blocks (all regions, or ``regions``); returns at once.

        ``notification`` reaches the peer after the bytes landed, never before: once a ``poll`` has seen the
        transfer DONE, at the latest shortly after (a transport may defer the send past the DONE it reports, so
        the caller's next step is not delayed by it; the CUDA IPC transport sends it on its next call or 0.5 ms
        later). A handle released before it completed may never send it."""

    def poll(self, handle: TransferHandle) -> XferStatus:
        """Never blocks."""

    def error(self, handle: TransferHandle) -> TransportError | None: ...

    def stats(self, handle: TransferHandle) -> XferStats | None: ...

    def release(self, handle: TransferHandle) -> None: ...

    def send_notification(self, peer: str, note: Notification) -> None: ...

    def notifications(self) -> list[tuple[str, Notification]]:
        """Drain received notifications (malformed ones are counted in ``malformed_notifications``, dropped)."""

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        """READ the peer's scratch region into ours (never KV blocks) and time it."""

    def remove_peer(self, peer: str) -> None: ...

    def registered_regions(self) -> int:
        """How many regions are registered now (0 after :meth:`close`)."""

    def close(self) -> None: ...


@runtime_checkable
class DeviceOrderedPost(Protocol):
    """An optional capability of a :class:`Transport`: a post ordered after work on the device, the host never
    waiting for it. A transport that reads the memory straight (NIXL) or moves host memory has no such order, and
    its caller waits for the blocks to be written before it posts.

    .. versionadded:: 0.1.0"""

    def post_after(
        self,
        after: object,
        op: XferOp | str,
        plan: PreparedPlan,
        local_blocks: np.ndarray | Sequence[int],
        remote_blocks: np.ndarray | Sequence[int],
        *,
        regions: np.ndarray | Sequence[int] | None = None,
        notification: Notification | None = None,
        transfer: str = "",
    ) -> TransferHandle:
        """As :meth:`Transport.post`, the copy starting only once ``after`` completed on the device instead of
        after the posting thread's current stream. ``after`` is opaque here: its type is the transport's (the CUDA
        IPC transport takes a recorded CUDA event); one it cannot order after raises :class:`TransportError`,
        nothing posted. Returns at once, whether or not ``after`` completed."""


def orders_on_device(transport: object) -> bool:
    """Whether ``transport`` can order a post after device work (:class:`DeviceOrderedPost`)."""
    return isinstance(transport, DeviceOrderedPost)


@runtime_checkable
class LandedDigests(Protocol):
    """An optional capability of a :class:`Transport` whose copy is its own (CUDA IPC: a kernel it launches): the
    per-block digests of what a READ wrote, computed by the copy itself as it moved the words, so that D checks
    what landed without a second pass over its blocks. A transport that only starts the copy (NIXL) or moves host
    memory lacks it, and D reads its blocks back (:class:`kvlifecycle.digest.BlockDigester`)."""

    def landed_digests(self, handle: TransferHandle) -> np.ndarray | None:
        """For a DONE handle still held: the :mod:`kvlifecycle.digest` contract's digest of every whole block
        the transfer wrote (all regions, region after region), one u64 per block in the post's ``local_blocks``
        order; None where the copy computed none (not asked to, not a whole-block READ, not DONE)."""


def landed_digests(transport: object, handle: TransferHandle) -> np.ndarray | None:
    """What ``transport``'s copy digested for ``handle`` (:class:`LandedDigests`), None where it offers none."""
    return transport.landed_digests(handle) if isinstance(transport, LandedDigests) else None


def cancels_in_flight(transport: object) -> bool:
    """Whether releasing a PENDING handle of ``transport`` stops its transfer (no byte moves after the release,
    as NIXL cancels a released request). A transport whose copy, once launched, runs to its end whatever the
    handle (CUDA IPC: a kernel on the device) says ``cancels_in_flight = False``: a caller that must know no byte
    lands any more waits for such a transfer to end instead of releasing it."""
    return bool(getattr(transport, "cancels_in_flight", True))
