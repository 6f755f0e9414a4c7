"""The CUDA IPC transport: regions exported once, peers mapped once, a transfer is one batched block-copy kernel
(see the package docstring for why it is shaped this way).

One concept, longer than most: the transport class itself (registration, peers, plans, posts, completions,
notifications, teardown), which shares one lock and one set of tables. The parts that stand alone already live
beside it in the package: driver binding, id ring, wire format, options, post strategies, peers and plans."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import attrs
import msgspec
import numpy as np

from kvlifecycle.digest import DIGEST_DTYPE
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BackendUnavailableError,
    BlockView,
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

from .._common import HandleTable, XferRecord, check_pairing, new_epoch
from . import native_post
from .driver import CUDA_ERROR_NOT_READY, CudaDriver, DriverEvent
from .ids import IdRing, block_ids, joined_ids, refuse_batch
from .notify import NotifyChannel
from .options import CudaIpcOptions
from .peers import Peer, map_peer, probe_copy, unmap_peer
from .plans import Launch, Plan, groups_of, launch_of, plan_groups, region_specs, subset_launch
from .post import CompiledPost, Inflight, PostStreams, PythonPost, stage_times
from .wire import (
    NAME,
    AllocationWire,
    CudaIpcBlob,
    blob_decoder,
    blob_encoder,
    node_identity,
    probe_pattern,
)

log = logging.getLogger("kvlifecycle.transports.cuda_ipc")

DRAIN_TIMEOUT_S = 10.0
_OPS = {op.value: op for op in XferOp}
SETTLE_AFTER_S = 0.0005  # a completed copy's notification waits at most this long for the caller's next call
# The settler keeps watching this long after the last copy settled before it sleeps until the next post: a
# transport in use then never pays the wake-up (a futex syscall, and a thread asking for the GIL) inside a post.
SETTLER_LINGER_S = 0.05


@attrs.define
class _Unmapping:
    """A removed peer whose mapping waits for the copies that may still touch it."""

    peer: Peer
    running: list[Inflight]
    deadline: float  # monotonic: past it the mapping is kept and an error logged


class CudaIpcTransport:
    """The CUDA IPC transport. See the package docstring; implements :class:`kvlifecycle.transport.Transport`."""

    name = NAME
    # a launched copy is a kernel on the device: releasing its handle cannot stop it (kvlifecycle.transport's
    # cancels_in_flight), so whoever must know that no byte lands any more waits for it to end
    cancels_in_flight = False

    def __init__(
        self,
        agent: str,
        *,
        epoch: int | None = None,
        options: CudaIpcOptions | None = None,
        bind_host: str | None = None,
        self_test: bool | None = None,
        chunk_bytes: int | None = None,
        num_warps: int | None = None,
        use_triton: bool | None = None,
        host_ids: bool | None = None,
        region_group: int | None = None,
        compiled_post: bool | None = None,
        inline_ids: bool | None = None,
    ) -> None:
        """``options``: how to stage, launch and report (:meth:`CudaIpcOptions.from_env` when not given); a keyword
        given here overrides its field of the same name."""
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise BackendUnavailableError("the CUDA IPC transport needs torch") from exc
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the CUDA IPC transport needs a CUDA device (torch.cuda.is_available())")
        opts = CudaIpcOptions.from_env() if options is None else options
        opts = opts.replace(bind_host=bind_host, self_test=self_test, chunk_bytes=chunk_bytes, num_warps=num_warps,
                            use_triton=use_triton, host_ids=host_ids, region_group=region_group,
                            compiled_post=compiled_post, inline_ids=inline_ids)
        self.options = opts
        self._torch = torch
        self._driver = CudaDriver.get()
        self.agent = agent
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.self_test = opts.self_test
        self.host_ids = opts.host_ids
        self.inline_ids = opts.inline_ids
        self._copier_kwargs = opts.copier_kwargs()
        self._trace = opts.trace  # per-stage post timings in rec.extra (read at register)
        # digest_reads: a READ of whole blocks is the fused copy + digest over the peer's mapping (its digester by
        # peer, None where its layout does not fit one); landed_digests() hands D what it wrote
        self._digest_reads = False
        self._read_digesters: dict[str, Any] = {}
        self.digested_reads = 0
        self.layout: KVLayout | None = None
        self.device: Any = None
        self._stream: Any = None
        self._exports: list[AllocationWire] = []
        self._probe: Any = None
        self._peers: dict[str, Peer] = {}
        self._known_epochs: dict[str, int] = {}
        self._plans: dict[int, Plan] = {}
        self._plan_keys = itertools.count(1)
        self._handles = HandleTable()
        self._inflight: dict[int, Inflight] = {}
        self._draining: list[tuple[str, Inflight]] = []  # released handles whose copy is still running
        # Removed peers whose mapping a running copy may still touch: unmapped by _progress once those copies
        # ended (or, past DRAIN_TIMEOUT_S, left mapped), so removing a peer never waits on the device.
        self._unmapping: list[_Unmapping] = []
        # What posting needs, built at register: the streams, events and id ring, and the two post paths (the
        # compiled one only where it builds and loads, see native_post).
        self._streams: PostStreams | None = None
        self._python_post: PythonPost | None = None
        self._compiled: CompiledPost | None = None
        self._why_not_compiled = "not registered yet"
        # Copies seen complete whose stats and notification are still to be done (see _complete, _settle); a
        # small thread settles what no call of the caller's settled within SETTLE_AFTER_S.
        self._settling: list[tuple[XferRecord, Inflight]] = []
        self._settle_kick = threading.Event()
        self._settler: threading.Thread | None = None
        self._settle_watching = False  # the settler is watching (copies in flight or settling); under _lock
        self._probe_seed = 0
        self._lock = threading.RLock()
        self.malformed_notifications = 0
        self.stale_notifications = 0
        self.failed_notifications = 0
        self._closed = False
        self._channel = NotifyChannel(agent, self.epoch, opts.bind_host)
        self.endpoint = self._channel.endpoint
        self._host = node_identity()

    # -- registration -----------------------------------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        torch = self._torch
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            if self.layout is not None:
                raise RegistrationError("regions are already registered")
            if layout.kind is not MemoryKind.VRAM:
                raise RegistrationError(f"the CUDA IPC transport moves VRAM only, got {layout.kind.value}")
            host_groups = [g for g, kind in enumerate(layout.group_kinds) if kind is not MemoryKind.VRAM]
            if host_groups:
                raise RegistrationError(f"the CUDA IPC transport moves VRAM only: region group {host_groups[0]} "
                                        "is in host memory")
            device = torch.device("cuda", layout.device_id)
            with torch.cuda.device(device):
                self._stream = torch.cuda.Stream(device)
                self._probe_seed = self.epoch & 0xFFFFFFFF
                probe = torch.from_numpy(probe_pattern(self._probe_seed)).to(device)
                torch.cuda.synchronize(device)
                allocations: dict[int, AllocationWire] = {}
                spans = [*zip(layout.base_addrs, layout.region_bytes, strict=True), (probe.data_ptr(), probe.numel())]
                for addr, nbytes in spans:
                    try:
                        base, size = self._driver.address_range(addr)
                    except TransportError as exc:
                        raise RegistrationError(f"region at {addr:#x} is not device memory: {exc}") from exc
                    if addr + nbytes > base + size:
                        raise RegistrationError(
                            f"region {addr:#x}+{nbytes} runs past its allocation {base:#x}+{size}")
                    if base not in allocations:
                        try:
                            allocations[base] = AllocationWire(self._driver.export(base), base, size)
                        except TransportError as exc:
                            raise RegistrationError(f"cannot export {base:#x} for IPC: {exc}") from exc
                streams = PostStreams(torch, self._driver, device, self._stream, trace=self._trace)
            self._streams = streams
            self._python_post = PythonPost(streams, host_ids=self.host_ids)
            self._compiled = self._bind_compiled(streams)
            self.device = device
            self._probe = probe
            self._exports = list(allocations.values())
            self.layout = layout

    def _bind_compiled(self, streams: PostStreams) -> CompiledPost | None:
        """The compiled post (built once per machine) bound to this transport, or None (``compiled_post_off``
        says why)."""
        if not self.options.compiled_post:
            self._why_not_compiled = "turned off (compiled_post=False, KVL_NATIVE_POST=0)"
            return None
        if self.host_ids:
            self._why_not_compiled = "ids read from host memory (host_ids) take the Python post"
            return None
        lib = native_post.load()
        if lib is None:
            self._why_not_compiled = native_post.why_not() or "the compiled post did not load"
            return None
        self._why_not_compiled = ""
        return CompiledPost(streams, lib, inline_ids=self.inline_ids)

    def digest_reads(self, enabled: bool = True) -> None:
        """D's check without a second pass: with ``enabled``, a READ of whole blocks (whole-block views, every
        region, one region group on both sides whose regions share one block size of whole 1024-byte rows) is
        launched as :meth:`~kvlifecycle.transports.digest_gpu.GpuDigester.copy_and_digest` from the peer's mapping
        into this transport's regions: one kernel moves the words and digests them, and :meth:`landed_digests`
        returns what it wrote. Other posts, and layouts that do not fit, take the block-copy kernel as before."""
        with self._lock:
            self._digest_reads = bool(enabled)

    def landed_digests(self, handle: TransferHandle) -> np.ndarray | None:
        """The digests (:data:`~kvlifecycle.digest.DIGEST_DTYPE`, one per block in ``local_blocks`` order) of
        what a DONE READ posted under :meth:`digest_reads` wrote; None for any other handle
        (:class:`kvlifecycle.transport.LandedDigests`)."""
        with self._lock:
            try:
                rec = self._handles.get(handle)
            except TransportError:  # released, or another transport's: it offers nothing
                return None
            digests = rec.extra.get("landed")
            if digests is None or rec.status is not XferStatus.DONE:
                return None
        found: np.ndarray = digests.cpu().numpy().view(DIGEST_DTYPE)  # the copy's end event fired: they are there
        return found

    @property
    def compiled_post(self) -> bool:
        """Whether posts go through the compiled path (``native_post``) once the kernels are warm."""
        return self._compiled is not None

    @property
    def compiled_post_off(self) -> str:
        """Why posts go through Python only ("" when the compiled post is bound)."""
        return self._why_not_compiled

    @property
    def kernel_backend(self) -> str:
        """``triton`` (the batched copy kernel) or ``torch`` (the index-copy fallback without Triton)."""
        from .triton_copy import HAVE_TRITON

        return "triton" if HAVE_TRITON and self._copier_kwargs.get("use_triton", True) is not False else "torch"

    @property
    def _ring(self) -> IdRing | None:
        return self._streams.ring if self._streams is not None else None

    @property
    def _stage_marks(self) -> tuple[Any, ...]:
        return self._streams.stage_marks if self._streams is not None else ()

    def registered_regions(self) -> int:
        return 0 if self.layout is None else self.layout.num_regions

    def local_metadata(self) -> PeerMetadata:
        if self.layout is None:
            raise RegistrationError("register before exporting metadata")
        props = self._torch.cuda.get_device_properties(self.device)
        blob = CudaIpcBlob(self._host, os.getpid(), str(getattr(props, "uuid", "")), self.device.index,
                           self.endpoint, self._exports, self._probe.data_ptr(), int(self._probe.numel()),
                           self._probe_seed)
        return PeerMetadata(self.agent, self.epoch, self.name, blob_encoder.encode(blob), LayoutWire.of(self.layout))

    # -- peers ------------------------------------------------------------------------------------------------------
    def add_peer(self, meta: PeerMetadata) -> str:
        if meta.transport != self.name:
            raise TransportError(f"peer speaks {meta.transport!r}, not {self.name}")
        try:
            blob = blob_decoder.decode(meta.blob)
        except msgspec.DecodeError as exc:
            raise RemoteMismatchError(f"{meta.agent}: malformed cuda_ipc metadata: {exc}") from exc
        remote = meta.layout.to_layout()
        with self._lock:
            if self.layout is None:
                raise RegistrationError("register before adding peers")
            if blob.host != self._host:
                raise RemoteMismatchError(f"{meta.agent} is on another node ({blob.host}); CUDA IPC is same-node only")
            if remote.kind is not MemoryKind.VRAM:
                raise RemoteMismatchError(f"{meta.agent} registered {remote.kind.value}, CUDA IPC needs VRAM")
            known = self._peers.get(meta.agent)
            if known is not None:
                if known.epoch == meta.epoch:
                    return known.name
                if meta.epoch < known.epoch:
                    raise PeerEpochError(f"{meta.agent}: metadata epoch {meta.epoch} older than known {known.epoch}")
                self._drop_peer(known, f"peer restarted: epoch {known.epoch} -> {meta.epoch}")
            self._finish_unmapping(meta.agent, meta.epoch)
            peer = map_peer(self._driver, self._torch, self.device, self._context, meta, blob, remote)
            try:
                if self.self_test:
                    self._run_self_test(peer, blob.probe_seed)
                peer.dealer = self._channel.connect(blob.endpoint)
            except BaseException:
                unmap_peer(self._driver, self._torch, self.device, peer)
                raise
            self._peers[peer.name] = peer
            self._known_epochs[peer.name] = peer.epoch
            log.info("cuda_ipc peer %s epoch %d mapped (%s, %d allocations, self-test %.1f us, %.1f GB/s)",
                     peer.name, peer.epoch, "same process" if peer.same_process else "IPC",
                     len(peer.opened), peer.self_test_s * 1e6, peer.self_test_gbps)
            return peer.name

    def _run_self_test(self, peer: Peer, seed: int) -> None:
        """Copy the peer's probe through the mapping with the transfer kernel; refuse the peer if bytes differ."""
        seconds, got = probe_copy(self._torch, self.device, self._stream, peer, self._copier_kwargs)
        expected = probe_pattern(seed, got.size)
        if not np.array_equal(got, expected):
            bad = int(np.count_nonzero(got != expected))
            raise TransferFailedError(f"{peer.name}: connect-time self-test read {bad} wrong bytes of {got.size}")
        peer.self_test_s = seconds
        peer.self_test_gbps = got.size / max(seconds, 1e-9) / 1e9

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        """READ the peer's probe buffer (never KV blocks) through the mapping with the transfer kernel, timed with
        CUDA events; the bytes are checked too."""
        with self._lock:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(peer)
            seconds, got = probe_copy(self._torch, self.device, self._stream, p, self._copier_kwargs, timeout_s)
            if not np.array_equal(got, probe_pattern(p.probe[2], got.size)):
                raise TransferFailedError(f"{peer}: probe read wrong bytes")
            return ProbeResult(peer, int(got.size), seconds, f"{NAME}/{self.kernel_backend}")

    def peer_info(self, peer: str) -> dict[str, Any]:
        """What connecting to ``peer`` found and measured (for selection logs)."""
        p = self._peers.get(peer)
        if p is None:
            raise UnknownPeerError(peer)
        return {"peer": p.name, "epoch": p.epoch, "same_process": p.same_process, "ipc_mappings": len(p.opened),
                "self_test_us": round(p.self_test_s * 1e6, 2), "self_test_gbps": round(p.self_test_gbps, 2)}

    def remove_peer(self, peer: str) -> None:
        """Forget ``peer`` without waiting on the device: its pending copies that already ended fail now; one
        still running stays PENDING (the caller must not free blocks it writes) and fails when its kernel ends;
        the peer's mapping is closed once no copy touches it (:meth:`_progress`)."""
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p, "peer removed")

    def _drop_peer(self, peer: Peer, reason: str) -> None:
        """Void the peer's plans, fail its pending transfers (a running one once its kernel ended), and queue its
        unmapping behind every copy that touches its memory."""
        del self._peers[peer.name]
        self._read_digesters.pop(peer.name, None)
        self._plans = {k: p for k, p in self._plans.items() if p.plan.peer != peer.name}
        running: list[Inflight] = []
        with self._context():
            for rec in self._handles.live.values():
                if rec.handle.peer == peer.name and rec.status is XferStatus.PENDING:
                    rec.error = PeerEpochError(f"{peer.name}: {reason}")  # _complete reads it: FAILED, not DONE
                    flight = self._inflight.get(rec.handle.id)
                    if flight is None or flight.end is None or flight.end.query():
                        if flight is not None:
                            del self._inflight[rec.handle.id]
                            self._retire(flight)
                        rec.status = XferStatus.FAILED
                    else:
                        running.append(flight)
            running += [f for name, f in self._draining if name == peer.name and f.end is not None]
        self._unmapping.append(_Unmapping(peer, running, time.monotonic() + DRAIN_TIMEOUT_S))
        self._unmap_ended()

    def _finish_unmapping(self, name: str, epoch: int) -> None:
        """The same incarnation added again while its old mapping waits for copies (remove, then add): its IPC
        handles are the ones still open, so the old mapping is closed first, after a bounded wait (a rare path:
        the only place removing a peer can wait on the device)."""
        for gone in [g for g in self._unmapping if g.peer.name == name and g.peer.epoch == epoch]:
            if self._wait([f.end for f in gone.running if self._running(f)]):
                unmap_peer(self._driver, self._torch, self.device, gone.peer)
                self._unmapping.remove(gone)

    def _running(self, flight: Inflight) -> bool:
        """Whether ``flight``'s copy may still run: it is still tracked (in flight, or released and draining) and
        its event has not fired. A retired flight's event may already serve another copy, so it is not asked."""
        tracked = any(f is flight for f in self._inflight.values()) or any(f is flight for _, f in self._draining)
        return tracked and flight.end is not None and not flight.end.query()

    def _unmap_ended(self) -> None:
        """Unmap every removed peer no running copy touches any more. A peer whose copies run past
        DRAIN_TIMEOUT_S stays mapped (never unmap under a running kernel), with an error logged."""
        if not self._unmapping:
            return
        still = []
        with self._context():
            for gone in self._unmapping:
                gone.running = [flight for flight in gone.running if self._running(flight)]
                if not gone.running:
                    unmap_peer(self._driver, self._torch, self.device, gone.peer)
                elif time.monotonic() > gone.deadline:
                    log.error("cuda_ipc: copies touching %s still running after %.0f s; its mapping is kept",
                              gone.peer.name, DRAIN_TIMEOUT_S)
                    if gone.peer.dealer is not None:
                        gone.peer.dealer.close(0)
                        gone.peer.dealer = None
                else:
                    still.append(gone)
        self._unmapping = still

    def _wait(self, events: list[Any]) -> bool:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._context():
            for event in events:
                while not event.query():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(1e-4)
        return True

    # -- plans ------------------------------------------------------------------------------------------------------
    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        with self._lock:
            if self.layout is None:
                raise RegistrationError("register before preparing")
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(peer)
            nl, nr = check_pairing(self.layout, (local_view, remote_view), p.layout)
            local_specs = region_specs(self.layout, local_view)
            remote_specs = region_specs(p.mapped, remote_view)
            plan = PreparedPlan(next(self._plan_keys), peer, p.epoch, local_view, remote_view, nl, nr,
                                self.layout.num_regions)
            groups = groups_of(local_specs, remote_specs, np.arange(self.layout.num_regions), self.device,
                               self._copier_kwargs)
            self._plans[plan.key] = Plan(plan, groups, whole=launch_of(groups))
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
        """Check, stage the ids, launch; the handle's bookkeeping runs after the launch, while the copy runs.

        Host time before the kernel launch adds to every request's latency; host time after it overlaps the copy.
        So everything that can wait (the handle record, byte counts, trace marks) comes after the launch."""
        return self._post(op, plan, local_blocks, remote_blocks, regions, notification, transfer, None)

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
        """:meth:`post`, the copy ordered after ``after`` (a recorded ``torch.cuda.Event`` or a raw ``CUevent``)
        instead of after the calling thread's stream (:class:`~kvlifecycle.transport.DeviceOrderedPost`)."""
        return self._post(op, plan, local_blocks, remote_blocks, regions, notification, transfer, after)

    def _post(self, op: XferOp | str, plan: PreparedPlan, local_blocks: np.ndarray | Sequence[int],
              remote_blocks: np.ndarray | Sequence[int], regions: np.ndarray | Sequence[int] | None,
              notification: Notification | None, transfer: str, after: object) -> TransferHandle:
        t0 = time.perf_counter()
        if op.__class__ is not XferOp:
            op = _OPS.get(op) or XferOp(op)  # a dict hit is cheaper than Enum()
        with self._lock:
            launch = self._launch_for(plan, regions)
            notify = (plan.peer, notification) if notification is not None else None
            flight = landed = None
            caller = self._streams.order_after(after) if after is not None and self._streams is not None else 0
            compiled = self._compiled
            if self._digest_reads and op is XferOp.READ and regions is None:
                fused = self._fused_read(plan, local_blocks, remote_blocks, notify, caller)
                if fused is not None:
                    flight, landed, n = fused
            if compiled is not None and flight is None:
                # The compiled post checks the ids itself: here only what makes them a pair of integer vectors.
                local = local_blocks if local_blocks.__class__ is np.ndarray else np.asarray(local_blocks)
                remote = remote_blocks if remote_blocks.__class__ is np.ndarray else np.asarray(remote_blocks)
                n = local.size
                if (n and n == remote.size and local.ndim == 1 and remote.ndim == 1
                        and local.dtype.kind in "iu" and remote.dtype.kind in "iu"):
                    kernels = compiled.kernels_for(launch, op, n)
                    if kernels is not None:
                        flight = compiled.post(kernels, op, plan, local, remote, n, notify, self._busy(), caller)
            t_checked = time.perf_counter()
            if flight is None:  # the Python path: also where a bad id list gets its precise error
                local = block_ids(local_blocks, plan.local_blocks, "local")
                remote = block_ids(remote_blocks, plan.remote_blocks, "remote")
                n = local.size
                if n != remote.size:
                    raise RemoteMismatchError(f"{n} local blocks vs {remote.size} remote blocks")
                flight = self._launch_python(op, launch, local, remote, n, notify, caller)
            # -- the copy is running (or there is nothing to copy): bookkeeping overlaps it --
            rec = self._handles.new(op, plan.peer, plan.peer_epoch, transfer)
            rec.t_post_start = t0
            rec.nbytes = n * launch.bytes_per_block
            rec.ndesc = n * launch.regions
            rec.native = launch.backend
            if landed is not None:
                rec.native, rec.extra["landed"] = "fused-digest", landed
            self._inflight[rec.handle.id] = flight
            rec.t_post_end = time.perf_counter()
            if self._settling:
                self._settle()  # earlier copies' stats and notifications, while this one runs
            self._watch()
            if flight.end is None:
                self._complete(rec)
                self._settle()
            elif self._streams is not None and self._streams.trace:  # raw stamps only: stage_times() builds the dict
                rec.extra["stages_raw"] = (t0, t_checked, flight.t_launched, rec.t_post_end,
                                          self._streams.stage_marks)
            return rec.handle

    def post_batch(
        self,
        op: XferOp | str,
        plan: PreparedPlan,
        requests: Sequence[tuple[Any, Any, Notification | None, str]],
        *,
        regions: np.ndarray | Sequence[int] | None = None,
    ) -> list[TransferHandle]:
        """Post several requests over one plan as **one** launch: ``requests`` are ``(local_blocks, remote_blocks,
        notification, transfer)``; each gets its own handle (its bytes, stats and notification), and all of them
        complete when the launch's event fires.

        This is a scheduler step's loads posted together: the fixed host cost of a post (id copy, stream ordering,
        events, kernel launch: ~20-35 us on the H200 host, docs/gpu.md) is paid once per step instead of once per
        request, which is what small requests need. The ids of all requests are checked together; a bad request
        refuses the whole batch (nothing is launched) and the error names it."""
        t0 = time.perf_counter()
        if op.__class__ is not XferOp:
            op = _OPS.get(op) or XferOp(op)
        with self._lock:
            launch = self._launch_for(plan, regions)
            if not requests:
                return []
            # Before the launch only what makes the requests pairs of integer vectors; the range check runs once
            # over all of them (in the compiled post, or below) instead of a reduction per request, and only a
            # refused batch is searched for the request to name.
            sizes, locals_, remotes = [], [], []
            for local_blocks, remote_blocks, _, _ in requests:
                loc = local_blocks if local_blocks.__class__ is np.ndarray else np.asarray(local_blocks)
                rem = remote_blocks if remote_blocks.__class__ is np.ndarray else np.asarray(remote_blocks)
                if (loc.ndim != 1 or rem.ndim != 1 or loc.size != rem.size
                        or (loc.size and (loc.dtype.kind not in "iu" or rem.dtype.kind not in "iu"))):
                    refuse_batch(requests, plan)
                sizes.append(loc.size)
                if loc.size:
                    locals_.append(loc)
                    remotes.append(rem)
            local, remote = joined_ids(locals_), joined_ids(remotes)
            n = local.size
            flight = None
            compiled = self._compiled
            kernels = compiled.kernels_for(launch, op, n) if n and compiled is not None else None
            if kernels is not None:
                assert compiled is not None
                flight = compiled.post(kernels, op, plan, local, remote, n, None, self._busy())
            if flight is None:  # an id out of range, the ring full, or no compiled post
                try:
                    block_ids(local, plan.local_blocks, "local")
                    block_ids(remote, plan.remote_blocks, "remote")
                except RemoteMismatchError:
                    refuse_batch(requests, plan)
                flight = self._launch_python(op, launch, local, remote, n, None)
            # -- the copy is running: one record per request, sharing the launch's id slot and events --
            shared = [len(requests)]
            records = []
            for size, (_, _, note, transfer) in zip(sizes, requests, strict=True):
                rec = self._handles.new(op, plan.peer, plan.peer_epoch, transfer)
                rec.t_post_start = t0
                rec.nbytes = size * launch.bytes_per_block
                rec.ndesc = size * launch.regions
                rec.native = launch.backend
                self._inflight[rec.handle.id] = Inflight(flight.start, flight.end, flight.slot, flight.keep,
                                                          (plan.peer, note) if note is not None else None,
                                                          flight.t_launched, shared)
                rec.t_post_end = time.perf_counter()
                records.append(rec)
            if self._settling:
                self._settle()
            self._watch()
            if flight.end is None:
                for rec in records:
                    self._complete(rec)
                self._settle()
            return [rec.handle for rec in records]

    def _launch_for(self, plan: PreparedPlan, regions: np.ndarray | Sequence[int] | None) -> Launch:
        """The prepared launch of a live plan (every region, or a cached region subset)."""
        if self._closed:
            raise TransportError("transport is closed")
        prepared = self._plans.get(plan.key)
        if prepared is None or (prepared.plan is not plan and prepared.plan != plan):
            raise PeerEpochError(f"plan {plan.key} for {plan.peer} is void (peer removed or restarted)")
        if regions is None:
            return prepared.whole if prepared.whole is not None else launch_of(plan_groups(prepared, None))
        return subset_launch(prepared, regions)

    def _fused_read(self, plan: PreparedPlan, local_blocks: np.ndarray | Sequence[int],
                    remote_blocks: np.ndarray | Sequence[int], notify: tuple[str, Notification] | None,
                    caller: int) -> tuple[Inflight, Any, int] | None:
        """A READ launched as the fused copy + digest (:meth:`digest_reads`) on the transfer's stream, ordered as
        the block copy is, between the same timing events: ``(flight, digests tensor, blocks)``; None where it does
        not apply (the block-copy kernel moves it)."""
        digester = self._read_digester(plan)
        if digester is None or self._streams is None or self.layout is None:
            return None
        local = block_ids(local_blocks, plan.local_blocks, "local")
        remote = block_ids(remote_blocks, plan.remote_blocks, "remote")
        n = local.size
        if n == 0:
            return None
        if n != remote.size:
            raise RemoteMismatchError(f"{n} local blocks vs {remote.size} remote blocks")
        res, torch = self._streams, self._torch
        drv, lib = res.driver, res.driver.fast
        with res.context():
            start, end = res.events()
            try:
                # Blocks may have been last read on the caller's current stream: order after it, as every post does.
                drv.check(lib.cuEventRecord(res.order_event, caller or res.current_stream(res.dev_index)),
                          "cuEventRecord(order)")
                drv.check(lib.cuStreamWaitEvent(res.cu_stream, res.order_event, 0), "cuStreamWaitEvent(order)")
                drv.check(lib.cuEventRecord(start.handle, res.cu_stream), "cuEventRecord(start)")
                with torch.cuda.stream(res.stream):
                    digests = digester.copy_and_digest(remote, self.layout.base_addrs, local)
                drv.check(lib.cuEventRecord(end.handle, res.cu_stream), "cuEventRecord(end)")
            except BaseException:
                res.event_pool.append((start, end))
                raise
        self.digested_reads += 1
        return Inflight(start, end, None, [], notify, time.perf_counter()), digests, n

    def _read_digester(self, plan: PreparedPlan) -> Any:
        """The fused copy's digester over ``plan``'s peer mapping (made once per peer), or None where the plan or
        the two layouts do not fit it."""
        if plan.local_view != WHOLE_BLOCK or plan.remote_view != WHOLE_BLOCK:
            return None
        if plan.peer in self._read_digesters:
            return self._read_digesters[plan.peer]
        from ..digest_gpu import ROW_BYTES, GpuDigester

        peer, local = self._peers[plan.peer], self.layout
        assert local is not None  # a live plan: registered
        sizes = {*local.block_bytes, *peer.layout.block_bytes}
        digester = None
        if (len(local.region_groups) == len(peer.layout.region_groups) == 1 and len(sizes) == 1
                and local.num_regions == peer.layout.num_regions and next(iter(sizes)) % ROW_BYTES == 0
                and all(a % 8 == 0 for a in (*local.base_addrs, *peer.mapped.base_addrs))):
            try:
                digester = GpuDigester(peer.mapped)
            except ValueError as exc:  # no Triton: the block copy, and D reads its blocks back
                log.info("cuda_ipc: reads from %s are not digested by the copy: %s", plan.peer, exc)
        self._read_digesters[plan.peer] = digester
        return digester

    def _launch_python(self, op: XferOp, launch: Launch, local: np.ndarray, remote: np.ndarray, n: int,
                       notify: tuple[str, Notification] | None, caller: int = 0) -> Inflight:
        """The Python post of checked ids (the compiled post's fallback, and the path until kernels are warm)."""
        assert self._python_post is not None
        return self._python_post.launch(op, launch, local, remote, n, notify, self._busy(), caller)

    def _busy(self) -> bool:
        """Copies in flight: a post's ids then move on the copy stream, overlapping the running kernel."""
        return bool(self._inflight or self._draining)

    def _need_context(self) -> bool:
        return self._streams is not None and self._streams.need_context()

    def _context(self) -> contextlib.AbstractContextManager[None]:
        """Make this transport's CUDA context current for driver calls (a service thread may have none)."""
        return self._streams.context() if self._streams is not None else contextlib.nullcontext()

    def _retire(self, flight: Inflight) -> None:
        """The copy finished: its id slot and events can be reused (by the last handle of a batch)."""
        if flight.shared is not None:
            flight.shared[0] -= 1
            if flight.shared[0] > 0:
                return
        streams = self._streams
        if streams is not None:
            if flight.slot is not None:
                streams.ring.free(flight.slot)
            if flight.start is not None and isinstance(flight.end, DriverEvent):
                streams.event_pool.append((flight.start, flight.end))
        flight.keep.clear()

    def _complete(self, rec: XferRecord) -> None:
        """The copy's event completed: DONE now; stats and the notification in :meth:`_settle`.

        The caller waits for DONE to make the blocks visible; the stats (an event-time query) and above all the
        notification (a ZMQ send: ~20 us when its I/O thread was idle) are not needed for that, so they run on the
        transport's next call (stats, release, post, notifications, flush), or ``SETTLE_AFTER_S`` later on the
        settler thread if no call came: after the caller saw DONE, never before the bytes landed."""
        flight = self._inflight.pop(rec.handle.id)
        rec.t_done = time.perf_counter()
        if rec.error is not None:  # its peer was removed while the kernel ran: ended now, failed, told to no one
            rec.status = XferStatus.FAILED
            self._retire(flight)
            return
        rec.status = XferStatus.DONE
        self._settling.append((rec, flight))

    def _watch(self) -> None:
        """Wake the settler (called by ``post`` after its launch, under the lock: off the latency path)."""
        if self._settle_watching:
            return
        self._settle_watching = True
        if self._settler is None:
            self._settler = threading.Thread(target=self._settle_later, name=f"kvl-cuda-ipc-settle-{self.agent}",
                                             daemon=True)
            self._settler.start()
        self._settle_kick.set()

    def _settle_later(self) -> None:
        """The settler thread. While copies are in flight or settling, and for ``SETTLER_LINGER_S`` after, it looks
        every ``SETTLE_AFTER_S`` and settles what has waited that long since the caller saw it DONE; then it sleeps
        until a post wakes it."""
        kick = self._settle_kick
        while not self._closed:
            if not kick.wait(1.0):  # bounded: re-checks ``_closed`` every second
                continue
            kick.clear()
            idle_since = None
            while not self._closed:  # ends after SETTLER_LINGER_S with nothing in flight or settling, or at close
                time.sleep(SETTLE_AFTER_S)
                with self._lock:
                    if self._closed:
                        return
                    settling = self._settling
                    now = time.perf_counter()
                    if settling and now - settling[0][0].t_done >= SETTLE_AFTER_S:
                        with self._context():
                            self._settle()
                    if self._inflight or self._settling:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now
                    elif now - idle_since >= SETTLER_LINGER_S:
                        self._settle_watching = False
                        break

    def _settle(self) -> None:
        """Stats, id slot and events back, then the notification, for every copy seen complete."""
        settling, self._settling = self._settling, []
        for rec, flight in settling:
            if flight.start is not None:
                try:
                    t_xfer = self._driver.elapsed_ms(flight.start.handle, flight.end.handle) / 1e3
                except Exception:  # an event that cannot time (a test's stand-in): wall clock instead
                    t_xfer = rec.t_done - rec.t_post_start
            else:  # nothing was copied (empty post)
                t_xfer = rec.t_done - rec.t_post_start
            self._retire(flight)
            rec.stats = XferStats(rec.t_post_end - rec.t_post_start, t_xfer, rec.nbytes, rec.ndesc,
                                  f"cuda_ipc/{rec.native}")
            if flight.notify is not None:
                peer, note = flight.notify
                try:
                    self._send(peer, note)
                except TransportError as exc:
                    self.failed_notifications += 1
                    log.warning("cuda_ipc: notification for %s to %s failed: %s", rec.handle.transfer, peer, exc)

    def flush(self) -> None:
        """Send the notifications (and fill the stats) of copies already seen complete."""
        with self._lock:
            if self._settling:
                with self._context():
                    self._settle()

    def _progress(self) -> None:
        """Complete every in-flight copy whose event has fired (non-blocking)."""
        for hid in list(self._inflight):
            rec = self._handles.live.get(hid)
            if rec is not None and self._inflight[hid].end.query():
                self._complete(rec)
        still = []
        for name, flight in self._draining:
            if flight.end.query():
                self._retire(flight)
            else:
                still.append((name, flight))
        self._draining = still
        self._unmap_ended()

    def poll(self, handle: TransferHandle) -> XferStatus:
        with self._lock:
            rec = self._handles.live.get(handle.id)
            if rec is None or (rec.handle is not handle and rec.handle != handle):
                rec = self._handles.get(handle)  # raises the precise error (released, or not ours)
            if rec.status is XferStatus.PENDING:
                flight = self._inflight.get(handle.id)
                if flight is not None:
                    drv = self._driver
                    pushed = self._need_context()
                    if pushed:
                        drv.push_context(self._streams.cu_ctx)  # type: ignore[union-attr]  # pushed: streams exist
                    try:
                        end = flight.end
                        if end.__class__ is DriverEvent:
                            rc = drv.fast.cuEventQuery(end.handle)  # never blocks; no wrapper frames
                            if rc == 0:
                                self._complete(rec)
                            elif rc != CUDA_ERROR_NOT_READY:  # the only "not yet"
                                drv.check(rc, "cuEventQuery")
                        elif end.query():  # any other completion object (tests hold an event back this way)
                            self._complete(rec)
                            return rec.status
                        settling = self._settling
                        if settling and (rec.status is XferStatus.PENDING
                                         and time.perf_counter() - settling[0][0].t_done > SETTLE_AFTER_S):
                            self._settle()  # a caller busy waiting for another copy: do not hold P's lease back
                    finally:
                        if pushed:
                            drv.pop_context()
            elif self._settling:  # polled again after DONE: past the latency path
                with self._context():
                    self._settle()
            return rec.status

    def stage_times(self, handle: TransferHandle) -> dict[str, float] | None:
        """Where a traced post's host time went (``KVL_CUDA_IPC_TRACE=1``), in µs; ``None`` when not traced.
        Built here from raw stamps, so tracing adds no work to the post itself."""
        with self._lock:
            raw = self._handles.get(handle).extra.get("stages_raw")
        if raw is None:
            return None
        return stage_times(raw)

    def error(self, handle: TransferHandle) -> TransportError | None:
        with self._lock:
            return self._handles.get(handle).error

    def stats(self, handle: TransferHandle) -> XferStats | None:
        with self._lock:
            rec = self._handles.get(handle)
            if self._settling:
                with self._context():
                    self._settle()
            return rec.stats

    def release(self, handle: TransferHandle) -> None:
        """Forget a handle. A copy still running cannot be cancelled: it keeps its peer mapped until it ends, and
        its notification is not sent (the caller gave it up)."""
        with self._lock:
            if self._settling:
                with self._context():
                    self._settle()
            rec = self._handles.pop(handle)
            flight = self._inflight.pop(rec.handle.id, None)
            if flight is not None:
                with self._context():
                    if flight.end.query():
                        self._retire(flight)
                    else:
                        self._draining.append((rec.handle.peer, flight))

    # -- notifications ----------------------------------------------------------------------------------------------
    def _send(self, peer: str, note: Notification) -> None:
        p = self._peers.get(peer)
        if p is None or p.dealer is None:
            raise UnknownPeerError(f"unknown peer {peer!r}")
        self._channel.send(p.dealer, peer, note)

    def send_notification(self, peer: str, note: Notification) -> None:
        with self._lock:
            self._send(peer, note)

    def notifications(self) -> list[tuple[str, Notification]]:
        """Drain the side channel. Malformed messages and messages from a peer's older epoch are counted and
        dropped; each call also completes copies that have finished (so their notifications go out)."""
        with self._lock:
            if self._closed:
                return []
            if self._inflight or self._draining or self._settling or self._unmapping:
                with self._context():
                    self._progress()
                    self._settle()
            out, malformed, stale = self._channel.receive(self._known_epochs)
            self.malformed_notifications += malformed
            self.stale_notifications += stale
            return out

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            if self._settling:
                with self._context():
                    self._settle()
            settler, self._settler = self._settler, None
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "transport closed")
            for rec in self._handles.live.values():
                if rec.status is XferStatus.PENDING:
                    rec.status, rec.error = XferStatus.FAILED, TransportError("transport closed")
            flights = [*self._inflight.values(), *(f for _, f in self._draining)]
            if self._wait([f.end for f in flights if f.end is not None]):
                for flight in flights:
                    self._retire(flight)
                for gone in self._unmapping:
                    unmap_peer(self._driver, self._torch, self.device, gone.peer)
                if self._streams is not None:
                    self._streams.destroy_events()
            else:  # never free or unmap what a running kernel may still touch
                log.error("cuda_ipc: copies still running at close; their events, ids and mappings are kept")
            self._inflight.clear()
            self._draining.clear()
            self._unmapping.clear()
            self._streams = self._python_post = self._compiled = None
            self._handles.live.clear()
            self._channel.close()
            self._plans.clear()
            self.layout = None
            self._probe = None
            self._closed = True
            self._settle_kick.set()
        if settler is not None and settler is not threading.current_thread():
            settler.join(5.0)  # it sees _closed at once (outside our lock: it may be waiting for it)

    def __enter__(self) -> CudaIpcTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
