"""A :class:`~kvlifecycle.transport.Transport` over simulated memory: posts return at once, and a transfer moves
its bytes only when the scheduler completes it (so a completion can come late, out of order, or never), reading the
source bytes as they are *then*: a block reused under a read shows up in the tags.

Faults: :meth:`SimTransport.fail_next_posts` makes posts raise; :meth:`SimFabric.fail` fails an in-flight
transfer (one handle of several, say); :meth:`SimFabric.complete` with ``duplicate_notification`` delivers the
notification twice, and with ``corruption`` lands wrong bytes (:mod:`kvlifecycle.sim.corruption`); a peer that
crashed fails every transfer to it when the scheduler next touches it.

A transport made with ``cancels_in_flight=False`` is CUDA IPC's kind (a copy is a kernel that runs to its end): a
released PENDING handle, or a removed peer, does not stop its transfer; it stays in flight, lands its bytes when
the scheduler completes it (a released one without its notification; a removed peer's one then FAILED), and the
checks see whatever it lands in.

``autorun`` fabrics (the conformance suite, which polls in real time) complete a transfer on its first poll and
hand notifications over directly; the simulation's fabric sends them through the :class:`Network`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvlifecycle.sim.corruption import Corruption, other_slice
from kvlifecycle.sim.memory import AddressSpace
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BlockView,
    HandleReleasedError,
    KVLayout,
    LayoutWire,
    MemoryKind,
    Notification,
    PeerEpochError,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    RegistrationError,
    RemoteMismatchError,
    TransferFailedError,
    TransferHandle,
    TransportError,
    UnknownPeerError,
    XferOp,
    XferStats,
    XferStatus,
)

NoteSink = Callable[[str, str, Notification], None]  # (sender agent, receiver agent, note)


@dataclass(slots=True)
class _Xfer:
    handle: TransferHandle
    owner: SimTransport
    remote: SimTransport
    plan: PreparedPlan
    local: np.ndarray
    remote_ids: np.ndarray
    regions: list[int]
    notification: Notification | None
    status: XferStatus = XferStatus.PENDING
    error: TransportError | None = None
    stats: XferStats | None = None
    posted_at: float = 0.0
    released: bool = False  # its handle was released while the copy ran on (a transport that cannot cancel)
    doomed: TransportError | None = None  # its peer was removed while the copy ran on: FAILED once it ended

    def corruptions(self) -> tuple[Corruption, ...]:
        """The corruptions this transfer can suffer: ``slice`` only where a side moves a slice of its blocks."""
        mine, theirs = self.owner.layout, self.remote.layout
        assert mine is not None and theirs is not None
        sliced = _sliced(mine, self.plan.local_view) or _sliced(theirs, self.plan.remote_view)
        return ("flip", "slot", "slice") if sliced else ("flip", "slot")


def _sliced(layout: KVLayout, view: BlockView) -> bool:
    return view.split == 1 and 0 < view.length < layout.block_bytes[0]


class SimFabric:
    """What the endpoints share: the address space, the live agents by name, the transfers in flight."""

    def __init__(self, *, autorun: bool = False, note_sink: NoteSink | None = None,
                 now: Callable[[], float] = lambda: 0.0) -> None:
        self.now = now
        self.post_failures = 0
        self.memory = AddressSpace()
        self.agents: dict[str, SimTransport] = {}
        self.in_flight: list[_Xfer] = []
        self.autorun = autorun
        self.note_sink = note_sink
        self._ids = itertools.count(1)

    def deliver_note(self, sender: str, receiver: str, note: Notification) -> None:
        if self.note_sink is not None and not self.autorun:
            self.note_sink(sender, receiver, note)
            return
        target = self.agents.get(receiver)
        if target is not None and not target.closed:
            target.inbox.append((sender, note))

    def complete(self, index: int, *, duplicate_notification: bool = False, corruption: Corruption = "",
                 at: int = 0) -> _Xfer | None:
        """Finish the in-flight transfer at ``index`` (modulo): copy its bytes now and send its notification.
        ``corruption`` (one of the transfer's :meth:`_Xfer.corruptions`) lands them wrong; ``at`` picks the byte a
        flip hits."""
        if not self.in_flight:
            return None
        x = self.in_flight.pop(index % len(self.in_flight))
        if x.remote.closed or x.owner.closed:
            x.status, x.error = XferStatus.FAILED, TransferFailedError(f"{x.handle.peer} is gone")
            return x
        nbytes = _copy(x, corruption, at)
        if x.doomed is not None:
            x.status, x.error = XferStatus.FAILED, x.doomed
            return x
        x.status = XferStatus.DONE
        x.stats = XferStats(0.0, 0.0, nbytes, int(x.local.size) * len(x.regions), "sim")
        if x.notification is not None and not x.released:
            for _ in range(2 if duplicate_notification else 1):
                self.deliver_note(x.owner.agent, x.remote.agent, x.notification)
        return x

    def fail(self, index: int, reason: str = "injected transfer failure") -> _Xfer | None:
        if not self.in_flight:
            return None
        x = self.in_flight.pop(index % len(self.in_flight))
        x.status, x.error = XferStatus.FAILED, TransferFailedError(reason)
        return x

    def expire(self, deadline_s: float) -> int:
        """Fail every transfer posted more than ``deadline_s`` ago (the data plane's per-transfer timeout)."""
        cut = self.now() - deadline_s
        late = [x for x in self.in_flight if x.posted_at < cut]
        for x in late:
            x.status, x.error = XferStatus.FAILED, TransferFailedError(f"no completion within {deadline_s}s")
        self.in_flight = [x for x in self.in_flight if x.posted_at >= cut]
        return len(late)

    def fail_to(self, agent: str, reason: str) -> None:
        """Every transfer from or to ``agent`` fails (it crashed)."""
        keep = []
        for x in self.in_flight:
            if agent in (x.owner.agent, x.remote.agent):
                x.status, x.error = XferStatus.FAILED, TransferFailedError(reason)
            else:
                keep.append(x)
        self.in_flight = keep


def _view_span(layout: KVLayout, view: BlockView, region: int) -> tuple[int, int]:
    """(bytes per sub-block, blocks addressable) of ``view`` over ``region``."""
    length = layout.block_bytes[region] - view.offset if view.length == 0 else view.length
    return length // view.split, layout.num_blocks * view.split


def _byte_ranges(layout: KVLayout, view: BlockView, region: int, ids: np.ndarray) -> np.ndarray:
    sub, _ = _view_span(layout, view, region)
    block, part = ids // view.split, ids % view.split
    return block.astype(np.int64) * layout.block_bytes[region] + view.offset + part.astype(np.int64) * sub


def _copy(x: _Xfer, corruption: Corruption = "", at: int = 0) -> int:
    mine, theirs = x.owner, x.remote
    assert mine.layout is not None and theirs.layout is not None
    reading = x.handle.op is XferOp.READ
    local_view, remote_view, local, remote_ids = x.plan.local_view, x.plan.remote_view, x.local, x.remote_ids
    if corruption == "slice":  # the sliced side's bytes go to (or come from) the block's other heads
        if _sliced(theirs.layout, remote_view):
            remote_view = BlockView(other_slice(remote_view.offset, remote_view.length, theirs.layout.block_bytes[0]),
                                    remote_view.length)
        else:
            local_view = BlockView(other_slice(local_view.offset, local_view.length, mine.layout.block_bytes[0]),
                                   local_view.length)
    elif corruption == "slot" and local.size == 1:  # the source side's block id maps to its neighbouring slot
        if reading:
            remote_ids = (remote_ids + 1) % x.plan.remote_blocks
        else:
            local = (local + 1) % x.plan.local_blocks
    nbytes = 0
    for r in x.regions:
        sub, _ = _view_span(mine.layout, local_view, r)
        dst_region = mine.fabric.memory.region(mine.layout.base_addrs[r])
        src_region = theirs.fabric.memory.region(theirs.layout.base_addrs[r])
        local_at = _byte_ranges(mine.layout, local_view, r, local)
        remote_at = _byte_ranges(theirs.layout, remote_view, r, remote_ids)
        if reading:
            src, dst, src_at, dst_at = src_region, dst_region, remote_at, local_at
        else:
            src, dst, src_at, dst_at = dst_region, src_region, local_at, remote_at
        if corruption == "slot" and dst_at.size > 1:  # two blocks land in each other's slots
            dst_at = dst_at.copy()
            dst_at[[0, 1]] = dst_at[[1, 0]]
        for s, d in zip(src_at.tolist(), dst_at.tolist(), strict=True):
            dst[d : d + sub] = src[s : s + sub]
        if corruption == "flip" and r == x.regions[at % len(x.regions)]:
            hit = int(dst_at[at % dst_at.size]) + at % sub
            dst[hit] ^= 0xFF
        nbytes += sub * int(x.local.size)
    return nbytes


class SimTransport:
    """One endpoint on a :class:`SimFabric` (its agent name is the node's name; a restart gets a new epoch)."""

    name = "sim"

    def __init__(self, agent: str, fabric: SimFabric, *, epoch: int = 1, cancels_in_flight: bool = True) -> None:
        self.agent, self.fabric, self.epoch = agent, fabric, int(epoch)
        self.cancels_in_flight = cancels_in_flight  # read through kvlifecycle.transport.cancels_in_flight
        self.layout: KVLayout | None = None
        self.closed = False
        self.inbox: list[tuple[str, Notification]] = []
        self.malformed_notifications = 0
        self._peers: dict[str, tuple[int, SimTransport]] = {}
        self._plans: dict[int, PreparedPlan] = {}
        self._handles: dict[int, _Xfer] = {}
        self._plan_keys = itertools.count(1)
        self._fail_posts = 0
        fabric.agents[agent] = self  # the same address: a restarted agent replaces the old one

    # -- faults -----------------------------------------------------------------------------------------------------
    def fail_next_posts(self, count: int = 1) -> None:
        self._fail_posts += count

    # -- registration -----------------------------------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        self._open()
        if self.layout is not None:
            raise RegistrationError("regions are already registered")
        for base in layout.base_addrs:
            self.fabric.memory.region(base)  # raises for an address the simulated memory does not hold
        self.layout = layout

    def registered_regions(self) -> int:
        return 0 if self.layout is None or self.closed else self.layout.num_regions

    def local_metadata(self) -> PeerMetadata:
        if self.layout is None:
            raise RegistrationError("register before exporting metadata")
        return PeerMetadata(self.agent, self.epoch, self.name, b"", LayoutWire.of(self.layout))

    # -- peers ------------------------------------------------------------------------------------------------------
    def add_peer(self, meta: PeerMetadata) -> str:
        self._open()
        if meta.transport != self.name:
            raise TransportError(f"peer speaks {meta.transport!r}, not sim")
        peer = self.fabric.agents.get(meta.agent)
        if peer is None or peer.closed:
            raise UnknownPeerError(f"no live sim agent {meta.agent!r}")
        known = self._peers.get(meta.agent)
        if known is not None and known[0] != meta.epoch:
            if meta.epoch < known[0]:
                raise PeerEpochError(f"{meta.agent}: epoch {meta.epoch} older than known {known[0]}")
            self._drop_peer(meta.agent, f"peer restarted: epoch {known[0]} -> {meta.epoch}")
        self._peers[meta.agent] = (meta.epoch, peer)
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._drop_peer(peer, "peer removed")

    def _drop_peer(self, peer: str, reason: str) -> None:
        del self._peers[peer]
        self._plans = {k: p for k, p in self._plans.items() if p.peer != peer}
        still = []
        for x in self.fabric.in_flight:
            if x.owner is self and x.handle.peer == peer and not self.cancels_in_flight:
                x.doomed = PeerEpochError(reason)  # the copy runs on; PENDING until it ended
                still.append(x)
            elif x.owner is self and x.handle.peer == peer:
                x.status, x.error = XferStatus.FAILED, PeerEpochError(reason)
            else:
                still.append(x)
        self.fabric.in_flight = still

    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        self._open()
        if self.layout is None:
            raise RegistrationError("register before preparing")
        if peer not in self._peers:
            raise UnknownPeerError(peer)
        epoch, remote = self._peers[peer]
        assert remote.layout is not None
        if remote.layout.num_regions != self.layout.num_regions:
            raise RemoteMismatchError("region counts differ")
        for r in range(self.layout.num_regions):
            if _view_span(self.layout, local_view, r)[0] != _view_span(remote.layout, remote_view, r)[0]:
                raise RemoteMismatchError(f"region {r}: local and remote views cover different byte counts")
        plan = PreparedPlan(next(self._plan_keys), peer, epoch, local_view, remote_view,
                            _view_span(self.layout, local_view, 0)[1], _view_span(remote.layout, remote_view, 0)[1],
                            self.layout.num_regions)
        self._plans[plan.key] = plan
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
        self._open()
        op = XferOp(op)
        if self._plans.get(plan.key) != plan:
            raise PeerEpochError(f"plan {plan.key} for {plan.peer} is void (peer removed or restarted)")
        local = np.asarray(local_blocks, dtype=np.int64).reshape(-1)
        remote_ids = np.asarray(remote_blocks, dtype=np.int64).reshape(-1)
        if local.size != remote_ids.size:
            raise RemoteMismatchError(f"{local.size} local blocks but {remote_ids.size} remote blocks")
        if local.size and (local.min() < 0 or local.max() >= plan.local_blocks or remote_ids.min() < 0
                           or remote_ids.max() >= plan.remote_blocks):
            raise RemoteMismatchError("block id out of range of the prepared views")
        regs = list(range(plan.num_regions)) if regions is None else [int(r) for r in regions]
        if any(not 0 <= r < plan.num_regions for r in regs):
            raise RemoteMismatchError("region out of range")
        if self._fail_posts:
            self._fail_posts -= 1
            self.fabric.post_failures += 1
            raise TransferFailedError("injected post failure")
        epoch, remote = self._peers[plan.peer]
        handle = TransferHandle(next(self.fabric._ids), op, plan.peer, epoch, transfer)
        x = _Xfer(handle, self, remote, plan, local, remote_ids, regs, notification, posted_at=self.fabric.now())
        self._handles[handle.id] = x
        self.fabric.in_flight.append(x)
        return handle

    def _xfer(self, handle: TransferHandle) -> _Xfer:
        x = self._handles.get(handle.id)
        if x is None:
            raise HandleReleasedError(f"handle {handle.id} was released")
        return x

    def poll(self, handle: TransferHandle) -> XferStatus:
        x = self._xfer(handle)
        if x.status is XferStatus.PENDING and self.fabric.autorun and x in self.fabric.in_flight:
            self.fabric.complete(self.fabric.in_flight.index(x))
        return x.status

    def error(self, handle: TransferHandle) -> TransportError | None:
        return self._xfer(handle).error

    def stats(self, handle: TransferHandle) -> XferStats | None:
        return self._xfer(handle).stats

    def release(self, handle: TransferHandle) -> None:
        x = self._xfer(handle)
        del self._handles[handle.id]
        if x not in self.fabric.in_flight:
            return
        if self.cancels_in_flight:  # released while pending: it never completes, never notifies
            self.fabric.in_flight.remove(x)
        else:  # the copy runs to its end: its bytes land later, unannounced
            x.released = True

    def open_handles(self) -> int:
        return len(self._handles)

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        if peer not in self._peers:
            raise UnknownPeerError(peer)
        return ProbeResult(peer, 0, 0.0, "sim")

    # -- notifications ----------------------------------------------------------------------------------------------
    def send_notification(self, peer: str, note: Notification) -> None:
        self._open()
        if peer not in self._peers:
            raise UnknownPeerError(peer)
        self.fabric.deliver_note(self.agent, peer, note)

    def notifications(self) -> list[tuple[str, Notification]]:
        out, self.inbox = self.inbox, []
        return out

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        for x in list(self._handles.values()):
            if x in self.fabric.in_flight:
                self.fabric.in_flight.remove(x)
        self._handles.clear()
        self._peers.clear()
        self._plans.clear()
        self.closed = True
        if self.fabric.agents.get(self.agent) is self:
            del self.fabric.agents[self.agent]

    def _open(self) -> None:
        if self.closed:
            raise TransportError("transport is closed")


def sim_layout(fabric: SimFabric, *, regions: int, blocks: int, block_bytes: int) -> tuple[KVLayout, list[np.ndarray]]:
    """Allocate ``regions`` KV regions in the fabric's memory; returns the layout and the regions' arrays."""
    bases, arrays = [], []
    for _ in range(regions):
        base, array = fabric.memory.allocate(blocks * block_bytes)
        bases.append(base)
        arrays.append(array.reshape(blocks, block_bytes))
    return KVLayout(MemoryKind.DRAM, 0, blocks, tuple(bases), tuple(block_bytes for _ in bases)), arrays
