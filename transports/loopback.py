"""In-process transport: torch copies between two endpoints of one process. Passes the conformance suite; used for
single-process runs and fast tests. A post completes inside ``post`` (there is no separate data plane)."""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Sequence

import numpy as np
import torch

from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BlockView,
    KVLayout,
    LayoutWire,
    MalformedNotificationError,
    MemoryKind,
    Notification,
    PeerEpochError,
    PeerMetadata,
    PreparedPlan,
    ProbeResult,
    RegistrationError,
    TransferHandle,
    TransportError,
    UnknownPeerError,
    XferOp,
    XferStats,
    XferStatus,
    decode_notification,
    encode_notification,
)
from kvlifecycle.untrusted import RateLimitedLog

from ._common import HandleQueries, HandleTable, check_pairing, new_epoch, plan_descs

log = logging.getLogger("kvlifecycle.transports.loopback")

_REGISTRY: weakref.WeakValueDictionary[str, LoopbackTransport] = weakref.WeakValueDictionary()
_REGISTRY_LOCK = threading.Lock()


def _region_tensor(addr: int, nbytes: int) -> torch.Tensor:
    buf = (ctypes.c_uint8 * nbytes).from_address(addr)
    return torch.from_numpy(np.ctypeslib.as_array(buf))


class LoopbackTransport(HandleQueries):
    name = "loopback"

    def __init__(self, agent: str, *, epoch: int | None = None) -> None:
        self.agent = agent
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.layout: KVLayout | None = None
        self._regions: list[torch.Tensor] = []
        self._peers: dict[str, tuple[int, LoopbackTransport]] = {}
        self._plans: dict[int, PreparedPlan] = {}
        self._plan_keys = itertools.count(1)
        self._handles = HandleTable()
        self._inbox: collections.deque[tuple[str, Notification]] = collections.deque()
        self._lock = threading.RLock()
        self.malformed_notifications = 0
        self._log_drop = RateLimitedLog(log)
        self._closed = False
        with _REGISTRY_LOCK:
            old = _REGISTRY.get(agent)
            if old is not None and not old._closed and old is not self:
                raise RegistrationError(f"a live loopback agent named {agent!r} exists in this process")
            _REGISTRY[agent] = self

    # -- registration -----------------------------------------------------------------------------------------------
    def register(self, layout: KVLayout, tensors: Sequence[torch.Tensor] | None = None) -> None:
        """Register ``layout``. DRAM regions are reached by address; VRAM regions need their ``tensors``."""
        with self._lock:
            if self.layout is not None:
                raise RegistrationError("regions are already registered")
            if tensors is not None:
                if len(tensors) != layout.num_regions:
                    raise RegistrationError("one tensor per region expected")
                regions = [t.view(-1).view(torch.uint8) for t in tensors]
            elif layout.kind is MemoryKind.DRAM:
                regions = [_region_tensor(a, n) for a, n in zip(layout.base_addrs, layout.region_bytes, strict=True)]
            else:
                raise RegistrationError("loopback VRAM regions need their tensors")
            self._regions = regions
            self.layout = layout

    def registered_regions(self) -> int:
        return len(self._regions)

    def local_metadata(self) -> PeerMetadata:
        if self.layout is None:
            raise RegistrationError("register before exporting metadata")
        return PeerMetadata(self.agent, self.epoch, self.name, b"", LayoutWire.of(self.layout))

    # -- peers ------------------------------------------------------------------------------------------------------
    def add_peer(self, meta: PeerMetadata) -> str:
        if meta.transport != self.name:
            raise TransportError(f"peer speaks {meta.transport!r}, not loopback")
        with _REGISTRY_LOCK:
            peer = _REGISTRY.get(meta.agent)
        if peer is None or peer._closed:
            raise UnknownPeerError(f"no live loopback agent {meta.agent!r} in this process")
        with self._lock:
            known = self._peers.get(meta.agent)
            if known is not None and known[0] != meta.epoch:
                if meta.epoch < known[0]:
                    raise PeerEpochError(f"{meta.agent}: epoch {meta.epoch} older than known {known[0]}")
                self._drop_peer(meta.agent, f"peer restarted: epoch {known[0]} -> {meta.epoch}")
            self._peers[meta.agent] = (meta.epoch, peer)
        return meta.agent

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            if peer in self._peers:
                self._drop_peer(peer, "peer removed")

    def _drop_peer(self, peer: str, reason: str) -> None:
        del self._peers[peer]
        self._plans = {k: p for k, p in self._plans.items() if p.peer != peer}
        for rec in self._handles.live.values():
            if rec.handle.peer == peer and rec.status is XferStatus.PENDING:
                rec.status, rec.error = XferStatus.FAILED, PeerEpochError(reason)

    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        with self._lock:
            if self.layout is None:
                raise RegistrationError("register before preparing")
            if peer not in self._peers:
                raise UnknownPeerError(peer)
            epoch, remote = self._peers[peer]
            assert remote.layout is not None
            nl, nr = check_pairing(self.layout, (local_view, remote_view), remote.layout)
            plan = PreparedPlan(next(self._plan_keys), peer, epoch, local_view, remote_view, nl, nr,
                                self.layout.num_regions)
            self._plans[plan.key] = plan
            return plan

    # -- data -------------------------------------------------------------------------------------------------------
    def _blocks(self, regions: list[torch.Tensor], layout: KVLayout, view: BlockView, r: int) -> torch.Tensor:
        block = layout.block_bytes[r]
        length = (block - view.offset) if view.length == 0 else view.length
        sub = length // view.split
        base = regions[r]
        return base.as_strided((layout.num_blocks, view.split, sub), (block, sub, 1), view.offset)

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
        notif = None if notification is None else encode_notification(notification)  # oversized: before any copy
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self._plans.get(plan.key) != plan:
                raise PeerEpochError(f"plan {plan.key} for {plan.peer} is void (peer removed or restarted)")
            epoch, remote = self._peers[plan.peer]
            local_ids, remote_ids, regs = plan_descs(plan, local_blocks, remote_blocks, regions)
            rec = self._handles.new(op, plan.peer, epoch, transfer)
            rec.t_post_start = time.perf_counter()
            assert self.layout is not None and remote.layout is not None
            n = len(local_ids) // max(len(regs), 1)
            lb, rb = local_ids[:n] % plan.local_blocks, remote_ids[:n] % plan.remote_blocks
            ls, rs = plan.local_view.split, plan.remote_view.split
            li = (torch.from_numpy(lb // ls), torch.from_numpy(lb % ls))
            ri = (torch.from_numpy(rb // rs), torch.from_numpy(rb % rs))
            nbytes = 0
            for r in regs.tolist():
                mine = self._blocks(self._regions, self.layout, plan.local_view, r)
                theirs = self._blocks(remote._regions, remote.layout, plan.remote_view, r)
                if op is XferOp.READ:
                    mine[li] = theirs[ri]
                else:
                    theirs[ri] = mine[li]
                nbytes += n * mine.shape[2]
            rec.t_post_end = rec.t_done = time.perf_counter()
            rec.status = XferStatus.DONE
            rec.stats = XferStats(rec.t_post_end - rec.t_post_start, rec.t_done - rec.t_post_start, nbytes,
                                  len(local_ids), "torch")
        if notif is not None:
            remote.receive_raw(self.agent, notif)
        return rec.handle

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            self._handles.pop(handle)

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        """Time a copy of one scratch buffer (in-process: never touches KV blocks)."""
        with self._lock:
            if peer not in self._peers:
                raise UnknownPeerError(peer)
        src = torch.ones(256 << 10, dtype=torch.uint8)
        dst = torch.empty_like(src)
        t0 = time.perf_counter()
        dst.copy_(src)
        return ProbeResult(peer, src.numel(), time.perf_counter() - t0, "torch")

    # -- notifications ----------------------------------------------------------------------------------------------
    def receive_raw(self, sender: str, raw: bytes) -> None:
        """A notification's bytes, as a peer's send delivers them: notifications travel encoded even in-process, so
        this double decodes exactly what a real wire would. Decoded into the inbox, or counted in
        ``malformed_notifications`` and dropped (logged at a bounded rate). Total: it never raises."""
        try:
            note = decode_notification(raw)
        except MalformedNotificationError as exc:
            self.malformed_notifications += 1
            self._log_drop("dropped a notification from %.100s: %.200s", sender, exc)
            return
        self._inbox.append((sender, note))

    def send_notification(self, peer: str, note: Notification) -> None:
        raw = encode_notification(note)
        with self._lock:
            if peer not in self._peers:
                raise UnknownPeerError(peer)
            remote = self._peers[peer][1]
        remote.receive_raw(self.agent, raw)

    def notifications(self) -> list[tuple[str, Notification]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            for peer in list(self._peers):
                self._drop_peer(peer, "transport closed")
            self._handles.live.clear()
            self._regions = []
            self.layout = None
            self._closed = True
        with _REGISTRY_LOCK:
            if _REGISTRY.get(self.agent) is self:
                del _REGISTRY[self.agent]
