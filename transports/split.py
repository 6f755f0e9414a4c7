"""One transport over a layout whose region groups need different transports: one part per set of groups.

SGLang on a GPU keeps its KV pages in VRAM and its aux rows in host memory, and one handoff moves both in one
post. CUDA IPC maps VRAM only, so on one node the pages would lose their fast path for the sake of a few small
rows. :class:`SplitTransport` gives each part of the layout a transport of its own (CUDA IPC over the VRAM
groups, a NIXL agent of its own over the host groups) and is one :class:`~kvlifecycle.transport.Transport` to the
handoff: one metadata (the parts' nested in it), one peer, one plan and one handle per post.

- A post is split by group, each part posting its own blocks (block and region ids shifted into the part's
  layout, :func:`kvlifecycle.layout.groups_layout`).
- The notification goes out through part 0 once every part is DONE. Attached to one part, it could reach the
  peer while another part's bytes were still landing.
- A part that fails fails the post, but only once no byte of another part can land any more. Parts that cancel
  in flight (NIXL) are released at once; a copy that cannot be cancelled (a CUDA IPC kernel) is waited for. So a
  caller that frees blocks when the post ends never frees one under a sibling's write (vLLM #56104's bug).
- It cancels in flight only if every part does. It has no ``post_after``: a host part cannot order after a device
  event, so its callers wait on the host before they post.

Part 0 also carries the standalone notifications and the connect-time probe (the fast path's). Every decoder of
the peer's metadata is total: a malformed or inconsistent offer is a :class:`RemoteMismatchError`, nothing added.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np

from kvlifecycle import layout as L
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BlockView,
    KVLayout,
    LayoutWire,
    Notification,
    PeerEpochError,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    RegistrationError,
    RemoteMismatchError,
    TransferFailedError,
    TransferHandle,
    Transport,
    TransportError,
    UnknownPeerError,
    XferOp,
    XferStats,
    XferStatus,
    cancels_in_flight,
)

from ._common import HandleQueries, HandleTable, XferRecord, check_pairing, check_post, new_epoch

NAME = "split"


class SplitBlob(msgspec.Struct, frozen=True):
    """A split endpoint's metadata blob: per part, the layout's groups it moves and its own metadata."""

    groups: list[list[int]]
    parts: list[PeerMetadata]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SplitBlob)


def part_offers(meta: PeerMetadata) -> SplitBlob:
    """The parts of a split peer's metadata; :class:`RemoteMismatchError` for anything else (total: no other
    exception, whatever the bytes)."""
    if meta.transport != NAME:
        raise RemoteMismatchError(f"{meta.agent} offers {meta.transport!r} metadata, not {NAME}")
    try:
        return _decoder.decode(meta.blob)
    except msgspec.DecodeError as exc:
        raise RemoteMismatchError(f"{meta.agent}: malformed {NAME} metadata: {exc}") from exc


@dataclass(frozen=True, slots=True)
class _Shift:
    """How one layout's block and region ids map into its parts: the part of each group, and what to add to a
    group's block ids (and a region's id) to get the part's own."""

    block_end: np.ndarray  # per group: one past its last block id
    part_of_group: np.ndarray
    block_shift: np.ndarray  # per group
    part_of_region: np.ndarray
    region_shift: np.ndarray  # per region

    @staticmethod
    def of(layout: KVLayout, groups: Sequence[Sequence[int]]) -> _Shift:
        counts = np.asarray([g.num_blocks for g in layout.region_groups], dtype=np.int64)
        regions = np.asarray([g.regions for g in layout.region_groups], dtype=np.int64)
        part = np.empty(counts.size, dtype=np.int64)
        block_shift = np.empty(counts.size, dtype=np.int64)
        region_shift = np.empty(counts.size, dtype=np.int64)
        block_start, region_start = np.cumsum(counts) - counts, np.cumsum(regions) - regions
        for i, gs in enumerate(groups):
            sub = np.asarray(gs, dtype=np.int64)
            part[sub] = i
            block_shift[sub] = (np.cumsum(counts[sub]) - counts[sub]) - block_start[sub]
            region_shift[sub] = (np.cumsum(regions[sub]) - regions[sub]) - region_start[sub]
        return _Shift(np.cumsum(counts), part, block_shift, np.repeat(part, regions), np.repeat(region_shift, regions))

    def group_of(self, blocks: np.ndarray) -> np.ndarray:
        if self.block_end.size == 1:  # one group: a split view's ids reach past num_blocks, all of them group 0
            return np.zeros(blocks.shape, dtype=np.int64)
        return np.searchsorted(self.block_end, blocks, side="right")


@dataclass(slots=True)
class _Peer:
    name: str
    epoch: int
    parts: tuple[str, ...]  # its name on each part
    layout: KVLayout
    shift: _Shift


@dataclass(slots=True)
class _Plan:
    plan: PreparedPlan
    parts: tuple[PreparedPlan, ...]


@dataclass(slots=True)
class _Post:
    """One post's parts in flight: (part index, its handle) each, which of them ended, the first failure."""

    rec: XferRecord
    peer: _Peer
    handles: list[tuple[int, TransferHandle]]
    note: Notification | None
    ended: set[int] = field(default_factory=set)  # indices into handles
    released: set[int] = field(default_factory=set)  # of those, the ones cancelled (released) already
    failure: TransportError | None = None


class SplitTransport(HandleQueries):
    """A :class:`~kvlifecycle.transport.Transport` made of ``parts``: (transport, the layout's region groups it
    moves) each, every group in exactly one part. Each part registers the layout of its groups; a peer must be
    split the same way (same groups per part, same part transports)."""

    name = NAME

    def __init__(self, agent: str, parts: Sequence[tuple[Transport, Sequence[int]]], *,
                 epoch: int | None = None) -> None:
        if not parts:
            raise ValueError("a split transport needs at least one part")
        self.agent = agent
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.parts: tuple[Transport, ...] = tuple(t for t, _ in parts)
        self.groups: tuple[tuple[int, ...], ...] = tuple(tuple(int(g) for g in gs) for _, gs in parts)
        # a kernel copy cannot be called back: cancelling in flight takes every part
        self.cancels_in_flight = all(cancels_in_flight(t) for t in self.parts)
        self.layout: KVLayout | None = None
        self._shift: _Shift | None = None
        self._lock = threading.RLock()
        self._handles = HandleTable()
        self._posts: dict[int, _Post] = {}
        self._peers: dict[str, _Peer] = {}
        self._known_epochs: dict[str, int] = {}
        self._senders: dict[tuple[int, str], str] = {}  # (part, the peer's name there) -> its name here
        self._plans: dict[int, _Plan] = {}
        self._plan_keys = itertools.count(1)
        self._closed = False

    # -- setup ------------------------------------------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self.layout is not None:
                raise RegistrationError("already registered")
            covered = sorted(g for gs in self.groups for g in gs)
            if covered != list(range(len(layout.region_groups))):
                raise RegistrationError(f"the parts' groups {list(self.groups)} must cover the layout's "
                                        f"{len(layout.region_groups)} region groups, each once")
            try:
                subs = [L.groups_layout(layout, gs) for gs in self.groups]
            except ValueError as exc:
                raise RegistrationError(f"cannot split the layout by {list(self.groups)}: {exc}") from exc
            for part, sub in zip(self.parts, subs, strict=True):
                part.register(sub)
            self.layout = layout
            self._shift = _Shift.of(layout, self.groups)

    def registered_regions(self) -> int:
        return sum(part.registered_regions() for part in self.parts)

    def local_metadata(self) -> PeerMetadata:
        if self.layout is None:
            raise RegistrationError("register before asking for metadata")
        blob = SplitBlob([list(gs) for gs in self.groups], [part.local_metadata() for part in self.parts])
        return PeerMetadata(self.agent, self.epoch, NAME, _encoder.encode(blob), LayoutWire.of(self.layout))

    def add_peer(self, meta: PeerMetadata) -> str:
        blob = part_offers(meta)
        remote = self._check_offer(meta, blob)
        with self._lock:
            if self.layout is None:
                raise RegistrationError("register before adding peers")
            known = self._peers.get(meta.agent)
            if known is not None and known.epoch == meta.epoch:
                return known.name
            last = self._known_epochs.get(meta.agent)
            if last is not None and meta.epoch < last:
                raise PeerEpochError(f"{meta.agent}: metadata epoch {meta.epoch} older than known {last}")
            if known is not None:
                self._drop_peer(known, f"peer restarted: epoch {known.epoch} -> {meta.epoch}")
            names: list[str] = []
            try:
                for part, offer in zip(self.parts, blob.parts, strict=True):
                    names.append(part.add_peer(offer))
            except BaseException:
                for part, added in zip(self.parts, names, strict=False):
                    with contextlib.suppress(TransportError):
                        part.remove_peer(added)
                raise
            peer = _Peer(meta.agent, meta.epoch, tuple(names), remote, _Shift.of(remote, self.groups))
            self._peers[peer.name] = peer
            self._known_epochs[peer.name] = peer.epoch
            for i, added in enumerate(names):
                self._senders[(i, added)] = peer.name
            return peer.name

    def _check_offer(self, meta: PeerMetadata, blob: SplitBlob) -> KVLayout:
        """The peer's layout, once its offer is split as this side is and each part's layout is its share."""
        if [tuple(gs) for gs in blob.groups] != list(self.groups) or len(blob.parts) != len(self.parts):
            raise RemoteMismatchError(f"{meta.agent} splits its groups as {blob.groups}, this side as "
                                      f"{[list(gs) for gs in self.groups]}")
        try:
            remote = meta.layout.to_layout()
            shares = [LayoutWire.of(L.groups_layout(remote, gs)) for gs in self.groups]
        except (ValueError, TypeError) as exc:
            raise RemoteMismatchError(f"{meta.agent}: its layout is not valid: {exc}") from exc
        for i, (part, offer, share) in enumerate(zip(self.parts, blob.parts, shares, strict=True)):
            if offer.transport != part.name:
                raise RemoteMismatchError(f"{meta.agent}: part {i} speaks {offer.transport!r}, here {part.name!r}")
            if offer.layout != share:
                raise RemoteMismatchError(f"{meta.agent}: part {i}'s layout is not its groups {self.groups[i]} "
                                          "of the whole")
        return remote

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            known = self._peers.get(peer)
            if known is not None:
                self._drop_peer(known, "peer removed")

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Under the lock: remove it from every part (each fails its transfers to it, and waits for those it
        cannot stop), then fail its posts, void its plans."""
        for i, (part, name) in enumerate(zip(self.parts, peer.parts, strict=True)):
            self._senders.pop((i, name), None)
            with contextlib.suppress(TransportError):
                part.remove_peer(name)
        for post in [p for p in self._posts.values() if p.peer is peer]:
            post.ended.update(range(len(post.handles)))
            self._finish(post, PeerEpochError(f"{peer.name}: {reason}"))
        for key in [k for k, p in self._plans.items() if p.plan.peer == peer.name]:
            del self._plans[key]
        del self._peers[peer.name]

    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        with self._lock:
            if self.layout is None:
                raise RegistrationError("register before preparing")
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r} (add_peer first)")
            nl, nr = check_pairing(self.layout, (local_view, remote_view), p.layout, groups=True)
            # a view slices the blocks of the layout's first group only (kvlifecycle.layout): its part takes it
            part_plans = tuple(
                part.prepare(name, local_view=local_view if 0 in gs else WHOLE_BLOCK,
                             remote_view=remote_view if 0 in gs else WHOLE_BLOCK)
                for part, name, gs in zip(self.parts, p.parts, self.groups, strict=True))
            plan = PreparedPlan(next(self._plan_keys), p.name, p.epoch, local_view, remote_view, nl, nr,
                                self.layout.num_regions, self.layout.region_groups, p.layout.region_groups)
            self._plans[plan.key] = _Plan(plan, part_plans)
            return plan

    # -- data -------------------------------------------------------------------------------------------------------
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
        op = XferOp(op)
        with self._lock:
            if self._closed or self._shift is None:
                raise TransportError("transport is closed" if self._closed else "register before posting")
            prepared = self._plans.get(plan.key) if isinstance(plan, PreparedPlan) else None
            if prepared is None or prepared.plan != plan:
                raise PeerEpochError(f"plan {getattr(plan, 'key', plan)} is void (peer removed or restarted)")
            peer = self._peers[plan.peer]
            shares = self._shares(plan, peer, local_blocks, remote_blocks, regions)
            rec = self._handles.new(op, plan.peer, plan.peer_epoch, transfer)
            post = _Post(rec, peer, [], notification)
            rec.t_post_start = time.perf_counter()
            for i, local, remote, regs in shares:
                try:
                    handle = self.parts[i].post(op, prepared.parts[i], local, remote, regions=regs,
                                                transfer=transfer)
                except TransportError as exc:
                    if not post.handles:  # nothing moves: refused as the part refused it
                        self._handles.pop(rec.handle)
                        raise
                    post.failure = exc  # the parts posted so far still land: the handle fails once they ended
                    break
                post.handles.append((i, handle))
            rec.t_post_end = time.perf_counter()
            self._posts[rec.handle.id] = post
            self._advance(post)
            return rec.handle

    def _shares(self, plan: PreparedPlan, peer: _Peer, local_blocks: np.ndarray | Sequence[int],
                remote_blocks: np.ndarray | Sequence[int], regions: np.ndarray | Sequence[int] | None,
                ) -> list[tuple[int, np.ndarray, np.ndarray, np.ndarray | None]]:
        """Each part's share of one post: (part, its local ids, its remote ids, its regions or None for all)."""
        assert self._shift is not None
        local, remote, regs = check_post(plan, local_blocks, remote_blocks, regions)
        local_group, remote_group = self._shift.group_of(local), peer.shift.group_of(remote)
        if not np.array_equal(local_group, remote_group):
            i = int(np.argmax(local_group != remote_group))
            raise RemoteMismatchError(f"block {int(local[i])} (group {int(local_group[i])}) cannot pair with "
                                      f"block {int(remote[i])} (group {int(remote_group[i])})")
        part_of = self._shift.part_of_group[local_group]
        shares = []
        for i in range(len(self.parts)):
            mine = part_of == i
            if not mine.any():
                continue
            part_regions = None
            if regs is not None:
                picked = regs[self._shift.part_of_region[regs] == i]
                if picked.size == 0:
                    continue
                part_regions = picked + self._shift.region_shift[picked]
            group = local_group[mine]
            shares.append((i, local[mine] + self._shift.block_shift[group],
                           remote[mine] + peer.shift.block_shift[group], part_regions))
        return shares

    def _advance(self, post: _Post) -> None:
        """Under the lock: poll the parts still in flight; settle the post once every part ended."""
        for k, (i, handle) in enumerate(post.handles):
            if k in post.ended:
                continue
            status = self.parts[i].poll(handle)
            if status is XferStatus.PENDING:
                continue
            post.ended.add(k)
            if status is XferStatus.FAILED and post.failure is None:
                post.failure = self.parts[i].error(handle) or TransferFailedError(f"part {i} failed")
        if post.failure is not None:  # stop what can be stopped; what cannot is waited for
            for k, (i, handle) in enumerate(post.handles):
                if k not in post.ended and cancels_in_flight(self.parts[i]):
                    with contextlib.suppress(TransportError):
                        self.parts[i].release(handle)
                    post.ended.add(k)
                    post.released.add(k)
        if len(post.ended) < len(post.handles):
            return
        failure = post.failure
        if failure is None and post.note is not None:
            try:
                self.parts[0].send_notification(post.peer.parts[0], post.note)
            except TransportError as exc:
                failure = exc
        self._finish(post, failure)

    def _finish(self, post: _Post, failure: TransportError | None) -> None:
        """Under the lock: the post's status, stats and error; its part handles released."""
        rec = post.rec
        rec.t_done = time.perf_counter()
        stats = [] if failure is not None else [self.parts[i].stats(h) for i, h in post.handles]
        for k, (i, handle) in enumerate(post.handles):
            if k in post.ended and k not in post.released:
                with contextlib.suppress(TransportError):
                    self.parts[i].release(handle)
        if failure is None:
            rec.status = XferStatus.DONE
            rec.stats = XferStats(rec.t_post_end - rec.t_post_start, rec.t_done - rec.t_submit,
                                  sum(s.bytes for s in stats if s is not None),
                                  sum(s.desc_count for s in stats if s is not None),
                                  "+".join(sorted({s.backend for s in stats if s is not None})) or NAME)
        else:
            rec.status, rec.error = XferStatus.FAILED, failure
        self._posts.pop(rec.handle.id, None)

    def poll(self, handle: TransferHandle) -> XferStatus:
        with self._lock:
            rec = self._handles.get(handle)
            post = self._posts.get(handle.id)
            if post is not None:
                self._advance(post)
            return rec.status

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            self._handles.pop(handle)
            post = self._posts.pop(handle.id, None)
            if post is not None:  # each part's own rule: NIXL cancels, a launched kernel runs to its end
                for i, part_handle in post.handles:
                    with contextlib.suppress(TransportError):
                        self.parts[i].release(part_handle)

    # -- notifications ----------------------------------------------------------------------------------------------
    def send_notification(self, peer: str, note: Notification) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r}")
            name = p.parts[0]
        self.parts[0].send_notification(name, note)

    def notifications(self) -> list[tuple[str, Notification]]:
        """Every part's, senders named as here; posts that ended meanwhile send theirs first."""
        with self._lock:
            for post in [p for p in self._posts.values() if p.note is not None]:
                self._advance(post)
            senders = dict(self._senders)
        return [(senders.get((i, sender), sender), note)
                for i, part in enumerate(self.parts) for sender, note in part.notifications()]

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        """Part 0's probe (the fast path's), under this side's name for the peer."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r}")
        result = self.parts[0].probe(p.parts[0], timeout_s=timeout_s)
        return ProbeResult(peer, result.bytes, result.seconds, result.backend)

    def expect_activity(self, seconds: float = 1.0) -> None:
        """Passed to the parts that poll faster when told a peer is about to move bytes (NIXL)."""
        for part in self.parts:
            expect = getattr(part, "expect_activity", None)
            if expect is not None:
                expect(seconds)

    def peer_part(self, peer: str, part: int) -> str:
        """The peer's name on part ``part`` (for the part's own queries: CUDA IPC's ``peer_info``)."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r}")
            return p.parts[part]

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "transport closed")
            self._plans.clear()
            self.layout = None
        for part in self.parts:
            with contextlib.suppress(TransportError):
                part.close()

    def __enter__(self) -> SplitTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
