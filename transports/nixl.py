"""The NIXL transport (nixl 1.5.1, ``nixl._api``; UCX by default).

Why it is shaped this way:
- One *service thread* owns the agent: every NIXL call after construction runs on it, so the agent can stay in
  NIXL's lock-free sync mode. On DRAM ``transfer()`` returns only after the whole copy (measured: T_post ≈
  T_xfer), so posting there keeps it off the caller's (scheduler's) thread; ``post`` and ``poll`` never block.
- ``enable_prog_thread=False``: UCX's own progress thread spins a core per agent even when idle. Progress is driven
  by the service thread's polling (busy while transfers are in flight, ``idle_poll_s`` otherwise). A peer that is
  being READ from must keep polling too (UCX over tcp needs the target to progress), which it does.
- Registration once; descriptor lists prepared once per (peer, epoch, view); per-request descriptor ids are
  one numpy broadcast (``region * blocks + block``).
- Telemetry turned into :class:`XferStats`; a telemetry failure never fails a transfer (nixl #2266).
- A restarted peer (new epoch) is removed (``remove_remote_agent``) before its new metadata is loaded (vLLM
  #49238); its old plans are void and its in-flight transfers fail with :class:`PeerEpochError`.

One concept, longer than most: the transport class and the service thread that owns the agent; every NIXL call
goes through that one thread, so its queue, its tables and the calls it runs are read together. The parts that
stand alone (mixed memory kinds, the agent wrapper) live beside it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle import layout as L
from kvlifecycle.transport import (
    WHOLE_BLOCK,
    BackendUnavailableError,
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
    TransferFailedError,
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

from ._common import HandleQueries, HandleTable, XferRecord, check_pairing, new_epoch, plan_descs
from .nixl_agent import make_agent
from .nixl_kinds import DescLists, group_rows, prepare_lists, split_post

log = logging.getLogger("kvlifecycle.transports.nixl")

DEFAULT_BACKENDS: tuple[str, ...] = ("UCX",)


SLOW_CALL_S = 1.0  # a call to the service thread this slow is logged, with where its time went


def _noop() -> None:
    """A command that only wakes the service thread."""


def _call_phase(queued: float, started: list[float]) -> str:
    """Where a service-thread call's time went: waiting behind other commands, or in NIXL itself."""
    now = time.monotonic()
    if not started:
        return f"still queued after {now - queued:.3f} s: the service thread was busy"
    return f"queued {started[0] - queued:.3f} s, in NIXL {now - started[0]:.3f} s"


def map_nixl_error(exc: BaseException, what: str) -> TransportError:
    """A NIXL binding exception as one of the library's typed errors (the NIXL class name stays in the text)."""
    if isinstance(exc, TransportError):
        return exc
    kind = type(exc).__name__
    text = f"{what}: NIXL {kind}: {exc}"
    if "NotFound" in kind:
        return UnknownPeerError(text)
    if "Backend" in kind or "NotSupported" in kind:
        return BackendUnavailableError(text)
    return TransportError(text)


@dataclass(slots=True)
class _Peer:
    name: str
    epoch: int
    layout: KVLayout
    remote_dlists: dict[BlockView, DescLists]
    probe_addr: int = 0
    probe_bytes: int = 0
    probe_dlist: Any = None


@dataclass(slots=True)
class _Plan:
    plan: PreparedPlan
    local: DescLists
    remote: DescLists
    desc_bytes: np.ndarray  # bytes per descriptor, per region


class NixlTransport(HandleQueries):
    name = "nixl"

    def __init__(
        self,
        agent: str,
        *,
        backends: Sequence[str] = DEFAULT_BACKENDS,
        epoch: int | None = None,
        enable_prog_thread: bool = False,
        capture_telemetry: bool = True,
        idle_poll_s: float = 0.005,
        busy_poll_s: float = 0.001,
        inflight_poll_s: float = 0.00005,
        call_timeout_s: float = 30.0,
        num_threads: int = 0,
        probe_bytes: int = 1 << 20,
        strided_descriptors: bool = True,
    ) -> None:
        self.agent = agent
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.backends = tuple(backends)
        self.idle_poll_s = float(idle_poll_s)
        self.busy_poll_s = float(busy_poll_s)
        self.inflight_poll_s = float(inflight_poll_s)
        self._busy_until = 0.0  # poll at busy_poll_s until then (a peer announced it is about to read from us)
        self._wake_queued = False  # an expect_activity wake is queued: a caller that polls often adds no other
        self.call_timeout_s = float(call_timeout_s)
        try:
            self._nixl = make_agent(agent, self.backends, progress_thread=enable_prog_thread,
                                    capture_telemetry=capture_telemetry, num_threads=num_threads)
        except Exception as exc:  # a TransportError (backend missing, NIXL absent) stays as it is
            raise map_nixl_error(exc, f"creating NIXL agent {agent!r} with backends {list(self.backends)}") from exc
        self.probe_bytes = int(probe_bytes)
        self._scratch: Any = None  # the probe's scratch buffer (same memory kind as the KV)
        self._scratch_reg: Any = None
        self._scratch_dlist: Any = None
        self.layout: KVLayout | None = None
        self._reg_descs: list[Any] = []  # one registration per memory kind of the layout
        self._metadata_blob: bytes | None = None  # fixed once registered: exported without the service thread
        self._local_dlists: dict[BlockView, DescLists] = {}
        self._strided_ok = strided_descriptors  # compressed (Nx5) descriptor lists, where NIXL takes them
        self._peers: dict[str, _Peer] = {}
        self._plans: dict[int, _Plan] = {}
        self._plan_keys = itertools.count(1)
        self._handles = HandleTable()
        self._inflight: dict[int, XferRecord] = {}
        self._inbox: collections.deque[tuple[str, Notification]] = collections.deque()
        self._lock = threading.Lock()  # guards the Python-side tables, never held across a NIXL call
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any] | None]] = queue.SimpleQueue()
        self._closed = False
        self._stop = threading.Event()
        self._completion_listeners: list[Callable[[TransferHandle], None]] = []
        self._notification_listeners: list[Callable[[], None]] = []
        self.malformed_notifications = 0
        self.failed_notifications = 0
        self._log_drop = RateLimitedLog(log)  # a peer sending junk must not flood the log
        self.telemetry_failures = 0
        self._thread = threading.Thread(target=self._serve, name=f"nixl-{agent}", daemon=True)
        self._thread.start()

    # -- the service thread -----------------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any], what: str) -> Any:
        """Run ``fn`` on the service thread and wait (bounded) for its result."""
        if self._closed:
            raise TransportError(f"{what}: transport is closed")
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future[Any] = Future()
        queued = time.monotonic()
        started: list[float] = []

        def timed() -> Any:
            started.append(time.monotonic())
            return fn()

        self._commands.put((timed, fut))
        try:
            result = fut.result(timeout=self.call_timeout_s)
        except FutureTimeout as exc:
            raise TransportError(f"{what}: no answer from the NIXL service thread in {self.call_timeout_s}s "
                                 f"({_call_phase(queued, started)})") from exc
        spent = time.monotonic() - queued
        if spent >= SLOW_CALL_S:
            log.warning("NIXL %s took %.3f s (%s)", what, spent, _call_phase(queued, started))
        return result

    def _submit(self, fn: Callable[[], Any]) -> None:
        self._commands.put((fn, None))

    def _serve(self) -> None:
        while not self._stop.is_set():
            busy = bool(self._inflight)
            if busy:
                wait = 0.0
            elif time.monotonic() < self._busy_until:
                wait = self.busy_poll_s
            else:
                wait = self.idle_poll_s
            try:
                fn, fut = self._commands.get(timeout=wait)
            except queue.Empty:
                fn, fut = None, None
            if fn is not None:
                self._run_command(fn, fut)
                while True:  # drain what queued up behind it
                    try:
                        fn, fut = self._commands.get_nowait()
                    except queue.Empty:
                        break
                    self._run_command(fn, fut)
            if self._inflight:
                self._progress()
            self._drain_notifs()
            if busy and not fn:
                time.sleep(self.inflight_poll_s)  # drive progress without hogging a core the copy may need
        # answer anything still queued so no caller waits out its timeout
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None and not fut.done():
                fut.set_exception(TransportError("transport closed"))

    @staticmethod
    def _run_command(fn: Callable[[], Any], fut: Future[Any] | None) -> None:
        try:
            result = fn()
        except BaseException as exc:
            if fut is not None:
                fut.set_exception(exc)
            else:
                log.warning("NIXL command failed: %s", exc)
            return
        if fut is not None:
            fut.set_result(result)

    def _progress(self) -> None:
        for rec in list(self._inflight.values()):
            try:
                parts = rec.native if isinstance(rec.native, list) else [rec.native]
                states = [self._nixl.check_xfer_state(part) for part in parts]
            except Exception as exc:
                self._finish(rec, map_nixl_error(exc, "check_xfer_state"))
                continue
            self._settle(rec, states, f"NIXL reported a failure for transfer {rec.handle.transfer!r}")

    def _finish(self, rec: XferRecord, error: TransportError | None) -> None:
        rec.t_done = time.perf_counter()
        self._inflight.pop(rec.handle.id, None)
        stats = None
        if error is None:
            stats = self._telemetry(rec)
        self._release_native(rec)
        with self._lock:
            rec.stats = stats
            rec.error = error
            rec.status = XferStatus.DONE if error is None else XferStatus.FAILED
        for listener in self._completion_listeners:
            try:
                listener(rec.handle)
            except Exception:
                log.exception("completion listener failed")

    def _telemetry(self, rec: XferRecord) -> XferStats:
        backend = self.backends[0]
        parts = rec.native if isinstance(rec.native, list) else [rec.native]
        try:
            backend = self._nixl.query_xfer_backend(parts[0])
        except Exception:
            self.telemetry_failures += 1
        try:
            tels = [self._nixl.get_xfer_telemetry(part) for part in parts]
            return XferStats(sum(t.postDuration for t in tels) / 1e6, max(t.xferDuration for t in tels) / 1e6,
                             sum(int(t.totalBytes) for t in tels), sum(int(t.descCount) for t in tels), backend, True)
        except Exception:  # nixl #2266: telemetry off or unavailable must never fail the transfer
            self.telemetry_failures += 1
            return XferStats(rec.t_post_end - rec.t_post_start, rec.t_done - rec.t_post_start, rec.nbytes,
                             rec.ndesc, backend, False)

    def _release_native(self, rec: XferRecord) -> None:
        if rec.native is None:
            return
        for part in rec.native if isinstance(rec.native, list) else [rec.native]:
            try:
                self._nixl.release_xfer_handle(part)
            except Exception as exc:
                log.warning("releasing NIXL handle of %r failed: %s", rec.handle.transfer, exc)
        rec.native = None

    def _drain_notifs(self) -> None:
        try:
            got = self._nixl.get_new_notifs()
            batches = [(str(sender), list(messages)) for sender, messages in got.items()]
        except Exception as exc:
            self.failed_notifications += 1
            self._log_drop("get_new_notifs failed: %s", exc)
            return
        for sender, messages in batches:
            for raw in messages:
                self.receive_raw(sender, raw)
        if any(messages for _, messages in batches):
            for listener in self._notification_listeners:
                try:
                    listener()
                except Exception:
                    log.exception("notification listener failed")

    def receive_raw(self, sender: str, raw: bytes) -> None:
        """One notification's bytes as they arrived from ``sender``: decoded into the inbox, or counted in
        ``malformed_notifications`` and dropped (logged at a bounded rate). Total: it never raises."""
        try:
            note = decode_notification(raw)
        except MalformedNotificationError as exc:
            self.malformed_notifications += 1
            self._log_drop("dropped a notification from %.100s: %.200s", sender, exc)
            return
        self._inbox.append((sender, note))

    # -- registration -----------------------------------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        def do() -> None:
            if self.layout is not None:
                raise RegistrationError("regions are already registered")
            regions = list(zip(layout.base_addrs, layout.region_bytes, L.region_devices(layout).tolist(), strict=True))
            by_kind: dict[str, list[tuple[int, int, int, str]]] = {}
            for r0, r1, _d0, _d1, kind in group_rows(layout):  # NIXL registers one memory kind per call
                by_kind.setdefault(kind.value, []).extend((a, n, int(d), "") for a, n, d in regions[r0:r1])
            try:
                for kind_name, regs in by_kind.items():
                    self._reg_descs.append(self._nixl.register_memory(regs, kind_name))
            except Exception as exc:
                self._deregister_all()
                raise RegistrationError(f"register_memory failed: {map_nixl_error(exc, 'register')}") from exc
            self.layout = layout
            self._local_dlist(WHOLE_BLOCK)
            if self.probe_bytes:
                self._register_scratch(layout)
            self._metadata_blob = bytes(self._nixl.get_agent_metadata())

        self._call(do, "register")

    def _deregister_all(self) -> None:
        for reg in self._reg_descs:
            try:
                self._nixl.deregister_memory(reg)
            except Exception as exc:
                log.warning("deregister_memory: %s", exc)
        self._reg_descs = []

    def _register_scratch(self, layout: KVLayout) -> None:
        if layout.kind.value == "VRAM":
            import torch

            self._scratch = torch.zeros(self.probe_bytes, dtype=torch.uint8, device=f"cuda:{layout.device_id}")
            addr = self._scratch.data_ptr()
        else:
            self._scratch = np.zeros(self.probe_bytes, dtype=np.uint8)
            addr = self._scratch.ctypes.data
        desc = [(addr, self.probe_bytes, layout.device_id, "")]
        try:
            self._scratch_reg = self._nixl.register_memory(desc, layout.kind.value)
            self._scratch_dlist = self._nixl.prep_xfer_dlist(
                "NIXL_INIT_AGENT", [(addr, self.probe_bytes, layout.device_id)], layout.kind.value)
        except Exception as exc:
            log.warning("probe scratch region not registered (%s): no connect-time probe", exc)
            self._scratch = self._scratch_reg = self._scratch_dlist = None

    def _scratch_addr(self) -> int:
        if self._scratch is None:
            return 0
        return int(self._scratch.data_ptr()) if hasattr(self._scratch, "data_ptr") else int(self._scratch.ctypes.data)

    def registered_regions(self) -> int:
        return 0 if self.layout is None else self.layout.num_regions

    def _local_dlist(self, view: BlockView) -> DescLists:
        dl = self._local_dlists.get(view)
        if dl is None:
            assert self.layout is not None
            dl = self._prep_dlist("NIXL_INIT_AGENT", self.layout, view, "prep_xfer_dlist (local)")
            self._local_dlists[view] = dl
        return dl

    def _prep_dlist(self, agent: str, layout: KVLayout, view: BlockView, what: str) -> DescLists:
        """Prepare the (region x block) descriptor lists (one, or one per group of a layout of several memory
        kinds: nixl_kinds.py): one strided row per region where this NIXL takes Nx5 arrays, else one row per
        (region, block). Descriptor ids are the same either way."""

        def prep(strided: np.ndarray | None, descs: np.ndarray, kind: MemoryKind) -> Any:
            if strided is not None and self._strided_ok:
                try:
                    return self._nixl.prep_xfer_dlist(agent, strided, kind.value)
                except Exception as exc:  # this NIXL cannot take strided lists: use the long form from now on
                    log.info("strided descriptor lists unavailable (%s): using one descriptor per block", exc)
                    self._strided_ok = False
            try:
                return self._nixl.prep_xfer_dlist(agent, descs, kind.value)
            except Exception as exc:
                raise map_nixl_error(exc, what) from exc

        return prepare_lists(layout, view, prep, self._strided_ok)

    def _release_dlists(self, lists: DescLists, what: str) -> None:
        for dl in lists.handles:
            try:
                self._nixl.release_dlist_handle(dl)
            except Exception as exc:
                log.warning("release_dlist_handle (%s): %s", what, exc)

    def local_metadata(self) -> PeerMetadata:
        """This agent's metadata, taken once at registration (nothing registered later changes it): a side-channel
        thread answering a handshake never queues behind the service thread, which a NIXL call may hold for long
        (on DRAM ``transfer()`` returns only after the whole copy; a peer's wire-up waits for that peer)."""
        if self.layout is None:
            raise RegistrationError("register before exporting metadata")
        blob = self._metadata_blob
        if blob is None:
            blob = bytes(self._call(self._nixl.get_agent_metadata, "get_agent_metadata"))
        return PeerMetadata(self.agent, self.epoch, self.name, bytes(blob), LayoutWire.of(self.layout),
                            self._scratch_addr(), self.probe_bytes if self._scratch is not None else 0)

    # -- peers ------------------------------------------------------------------------------------------------------
    def add_peer(self, meta: PeerMetadata) -> str:
        if meta.transport != self.name:
            raise TransportError(f"peer speaks {meta.transport!r}, not nixl")
        remote_layout = meta.layout.to_layout()

        def do() -> str:
            known = self._peers.get(meta.agent)
            if known is not None:
                if known.epoch == meta.epoch:
                    return known.name
                if meta.epoch < known.epoch:
                    raise PeerEpochError(f"{meta.agent}: metadata epoch {meta.epoch} older than known {known.epoch}")
                self._drop_peer(known, f"peer restarted: epoch {known.epoch} -> {meta.epoch}")
            try:
                name = self._nixl.add_remote_agent(meta.blob)
            except Exception as exc:
                raise map_nixl_error(exc, f"add_remote_agent({meta.agent})") from exc
            if isinstance(name, bytes):
                name = name.decode()
            if name != meta.agent:
                self._nixl.remove_remote_agent(name)
                raise TransportError(f"metadata names agent {name!r}, handshake said {meta.agent!r}")
            try:  # connect now so the first transfer does not pay for it
                self._nixl.make_connection(name)
            except Exception as exc:
                log.info("make_connection(%s) deferred: %s", name, exc)
            self._peers[name] = _Peer(name, meta.epoch, remote_layout, {}, meta.probe_addr, meta.probe_bytes)
            return name

        return self._call(do, "add_peer")

    def add_notification_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` runs on the service thread whenever notifications arrived (keep it tiny: wake their reader,
        which would otherwise find them at its next idle poll)."""
        self._notification_listeners.append(fn)

    def add_completion_listener(self, fn: Callable[[TransferHandle], None]) -> None:
        """``fn(handle)`` runs on the service thread whenever a transfer settles (keep it tiny: wake someone)."""
        self._completion_listeners.append(fn)

    def expect_activity(self, seconds: float = 1.0) -> None:
        """A peer is about to read from (or write to) this side: poll at ``busy_poll_s`` for a while, because
        UCX needs the target side to progress, and idle polling would add up to ``idle_poll_s`` per transfer. A
        first READ from a new peer does not complete at all until this side progresses (UCX's wire-up answer):
        the service thread is woken now rather than at the end of its idle wait, and drains the notifications that
        arrived meanwhile. An engine that polls a transfer's state can call this on every poll (the wake is
        coalesced: one queued at a time), so a notification is picked up at its poll, not up to ``busy_poll_s``
        later."""
        self._busy_until = max(self._busy_until, time.monotonic() + seconds)
        if not self._closed and not self._wake_queued:
            self._wake_queued = True  # a lost race queues a second wake, which is harmless
            self._submit(self._woken)

    def _woken(self) -> None:
        self._wake_queued = False

    def peer_epoch(self, peer: str) -> int | None:
        p = self._peers.get(peer)
        return None if p is None else p.epoch

    def probe(self, peer: str, *, timeout_s: float = 5.0) -> ProbeResult:
        """READ the peer's scratch region into ours (never KV blocks), timed; which backend NIXL picked."""

        def do() -> ProbeResult:
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r}")
            if self._scratch_dlist is None or not p.probe_bytes:
                raise TransportError(f"no probe scratch region on {'this side' if p.probe_bytes else peer}")
            n = min(self.probe_bytes, p.probe_bytes)
            assert self.layout is not None
            if p.probe_dlist is None:
                p.probe_dlist = self._nixl.prep_xfer_dlist(p.name, [(p.probe_addr, p.probe_bytes, p.layout.device_id)],
                                                           p.layout.kind.value)
            handle = None
            try:
                handle = self._nixl.make_prepped_xfer("READ", self._scratch_dlist, [0], p.probe_dlist, [0])
                deadline = time.monotonic() + timeout_s
                for _ in range(2):  # the first pass warms the path (connection, rkeys); the second is timed
                    t0 = time.perf_counter()
                    state = self._nixl.transfer(handle)
                    while state == "PROC" and time.monotonic() < deadline:
                        # not a hot spin: the first pass waits for the peer's agent to answer UCX's wire-up,
                        # and on shared cores a spinning reader takes the CPU that answer needs
                        time.sleep(self.inflight_poll_s)
                        state = self._nixl.check_xfer_state(handle)
                    seconds = time.perf_counter() - t0
                    if state != "DONE":
                        raise TransferFailedError(f"probe of {peer} ended {state}")
                try:
                    backend = self._nixl.query_xfer_backend(handle)
                except Exception:
                    backend = "?"
                return ProbeResult(peer, n, seconds, backend)
            except TransportError:
                raise
            except Exception as exc:
                raise map_nixl_error(exc, f"probe({peer})") from exc
            finally:
                if handle is not None:
                    try:
                        self._nixl.release_xfer_handle(handle)
                    except Exception as exc:
                        log.warning("release probe handle: %s", exc)

        return self._call(do, "probe")

    def loaded_backends(self) -> list[str]:
        return list(self._nixl.backends)

    def backend_mem_types(self, backend: str) -> list[str]:
        return list(self._nixl.get_backend_mem_types(backend))

    def remove_peer(self, peer: str) -> None:
        def do() -> None:
            known = self._peers.get(peer)
            if known is not None:
                self._drop_peer(known, "peer removed")

        self._call(do, "remove_peer")

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """On the service thread: void plans, fail in-flight transfers, release dlists, forget the agent."""
        for rec in [r for r in self._inflight.values() if r.handle.peer == peer.name]:
            self._finish(rec, PeerEpochError(f"{peer.name}: {reason}"))
        with self._lock:
            for key in [k for k, p in self._plans.items() if p.plan.peer == peer.name]:
                del self._plans[key]
        for lists in peer.remote_dlists.values():
            self._release_dlists(lists, peer.name)
        if peer.probe_dlist is not None:
            try:
                self._nixl.release_dlist_handle(peer.probe_dlist)
            except Exception as exc:
                log.warning("release_dlist_handle for %s: %s", peer.name, exc)
        try:
            self._nixl.remove_remote_agent(peer.name)
        except Exception as exc:
            log.warning("remove_remote_agent(%s): %s", peer.name, exc)
        del self._peers[peer.name]

    def prepare(self, peer: str, *, local_view: BlockView = WHOLE_BLOCK,
                remote_view: BlockView = WHOLE_BLOCK) -> PreparedPlan:
        def do() -> PreparedPlan:
            if self.layout is None:
                raise RegistrationError("register before preparing")
            p = self._peers.get(peer)
            if p is None:
                raise UnknownPeerError(f"unknown peer {peer!r} (add_peer first)")
            nl, nr = check_pairing(self.layout, (local_view, remote_view), p.layout, groups=True)
            local = self._local_dlist(local_view)
            remote = p.remote_dlists.get(remote_view)
            if remote is None:
                remote = self._prep_dlist(p.name, p.layout, remote_view, f"prep_xfer_dlist ({p.name})")
                p.remote_dlists[remote_view] = remote
            plan = PreparedPlan(next(self._plan_keys), p.name, p.epoch, local_view, remote_view, nl, nr,
                                self.layout.num_regions, self.layout.region_groups, p.layout.region_groups)
            with self._lock:
                self._plans[plan.key] = _Plan(plan, local, remote, L.view_block_bytes(self.layout, local_view))
            return plan

        return self._call(do, "prepare")

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
        if self._closed:
            raise TransportError("transport is closed")
        local_ids, remote_ids, regs = plan_descs(plan, local_blocks, remote_blocks, regions)
        notif = b"" if notification is None else encode_notification(notification)
        with self._lock:
            if self._closed:
                raise TransportError("transport is closed")
            prepared = self._plans.get(plan.key)
            if prepared is None or prepared.plan != plan:
                raise PeerEpochError(f"plan {plan.key} for {plan.peer} is void (peer removed or restarted)")
            rec = self._handles.new(op, plan.peer, plan.peer_epoch, transfer)
            rec.ndesc = int(local_ids.size)
            rec.nbytes = (L.group_post_bytes(plan.local_groups, prepared.desc_bytes, local_ids)
                          if len(plan.local_groups) > 1
                          else int(prepared.desc_bytes[regs].sum()) * (local_ids.size // max(regs.size, 1)))
        self._submit(lambda: self._post_now(rec, prepared, local_ids, remote_ids, notif))
        return rec.handle

    def _post_now(self, rec: XferRecord, prepared: _Plan, local_ids: np.ndarray, remote_ids: np.ndarray,
                  notif: bytes) -> None:
        if rec.status is not XferStatus.PENDING or rec.handle.id not in self._handles.live:
            return  # released or failed (peer dropped) before it was posted
        if prepared.plan.peer not in self._peers or self._peers[prepared.plan.peer].epoch != rec.handle.peer_epoch:
            self._finish(rec, PeerEpochError(f"{rec.handle.peer}: epoch changed before the post"))
            return
        rec.t_post_start = time.perf_counter()
        op = rec.handle.op.value
        try:
            if len(prepared.local.handles) == 1 and len(prepared.remote.handles) == 1:
                rec.native = self._nixl.make_prepped_xfer(op, prepared.local.handles[0], local_ids,
                                                          prepared.remote.handles[0], remote_ids, notif)
                states = [self._nixl.transfer(rec.native)]
            else:  # memory kinds per group: one transfer per pair of lists, the notification once all are DONE
                parts: list[Any] = []
                rec.native, rec.extra["notify_after"] = parts, notif
                for local, lids, remote, rids in split_post(prepared.local, prepared.remote, local_ids, remote_ids):
                    parts.append(self._nixl.make_prepped_xfer(op, local, lids, remote, rids, b""))
                states = [self._nixl.transfer(part) for part in parts]
        except Exception as exc:
            rec.t_post_end = time.perf_counter()
            self._finish(rec, map_nixl_error(exc, f"posting {op} {rec.handle.transfer!r}"))
            return
        rec.t_post_end = time.perf_counter()
        self._settle(rec, states, f"NIXL refused to post {rec.handle.transfer!r}")

    def _settle(self, rec: XferRecord, states: list[str], failure: str) -> None:
        """Finish ``rec`` once every part is DONE (a split post's notification goes out first), fail it at the
        first part that is neither DONE nor PROC, else keep it in flight."""
        bad = [state for state in states if state not in ("DONE", "PROC")]
        if bad:
            self._finish(rec, TransferFailedError(f"{failure}: {bad[0]}"))
        elif all(state == "DONE" for state in states):
            notif = rec.extra.pop("notify_after", b"")
            if notif:
                try:
                    self._nixl.send_notif(rec.handle.peer, notif)
                except Exception as exc:
                    self._finish(rec, map_nixl_error(exc, f"notifying {rec.handle.peer} of {rec.handle.transfer!r}"))
                    return
            self._finish(rec, None)
        else:
            self._inflight[rec.handle.id] = rec

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            rec = self._handles.pop(handle)

        def do() -> None:  # a pending transfer: NIXL tries to cancel it when its handle is released
            self._inflight.pop(rec.handle.id, None)
            self._release_native(rec)

        if rec.native is not None or rec.status is XferStatus.PENDING:
            self._submit(do)

    # -- notifications ----------------------------------------------------------------------------------------------
    def send_notification(self, peer: str, note: Notification) -> None:
        raw = encode_notification(note)

        def do() -> None:
            if peer not in self._peers:
                raise UnknownPeerError(f"unknown peer {peer!r}")
            try:
                self._nixl.send_notif(peer, raw)
            except Exception as exc:
                raise map_nixl_error(exc, f"send_notif({peer})") from exc

        self._call(do, "send_notification")

    def notifications(self) -> list[tuple[str, Notification]]:
        out = []
        while self._inbox:
            out.append(self._inbox.popleft())
        return out

    # -- teardown ---------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return

        def do() -> None:
            for peer in list(self._peers.values()):
                self._drop_peer(peer, "transport closed")
            for rec in list(self._inflight.values()):
                self._finish(rec, TransportError("transport closed"))
            for lists in self._local_dlists.values():
                self._release_dlists(lists, "local")
            self._local_dlists.clear()
            for what, release, handle in (("scratch dlist", self._nixl.release_dlist_handle, self._scratch_dlist),
                                          ("scratch", self._nixl.deregister_memory, self._scratch_reg)):
                if handle is not None:
                    try:
                        release(handle)
                    except Exception as exc:
                        log.warning("release %s: %s", what, exc)
            self._scratch = self._scratch_reg = self._scratch_dlist = None
            self._deregister_all()
            self.layout = None

        try:
            self._call(do, "close")
        finally:
            self._closed = True
            self._stop.set()
            self._thread.join(timeout=self.call_timeout_s)
            with self._lock:
                self._handles.live.clear()

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
