"""Same-node GPU fast path: a CUDA IPC transport whose transfers are one batched block-copy kernel.

Why it is shaped this way:
- P's (and D's) KV regions are exported **once**, at :meth:`~CudaIpcTransport.register`, as CUDA IPC handles of
  the allocations that hold them (``cuIpcGetMemHandle``; one handle per allocation, however many regions it holds).
  The peer maps them **once**, at :meth:`~CudaIpcTransport.add_peer`, and drops the mapping when the peer's agent
  epoch changes (a restarted peer's old handles are never used, vLLM #49238).
- A transfer is one launch of :mod:`kvlifecycle.transports.triton_copy`'s kernel over every (region × block) pair
  on the transport's own stream; nothing is prepared per block (vLLM #55434: 90k–120k descriptors per transfer on
  cuda_ipc, posting 57 % of the transfer time). Its completion handle is a CUDA event: :meth:`poll` asks
  ``event.query()`` and never blocks.
- Pull (``READ``: local ← peer) and push (``WRITE``: peer ← local) both run on the side that posts.
- Notifications (``done`` after a copy, or the caller's own) go over a small ZMQ side channel bound on 127.0.0.1:
  the notification a post carries is sent when :meth:`poll` (or any progress call) first sees the copy's event
  complete, never earlier. The caller releases a source lease only then, so the P allocator cannot hand a block
  out while a kernel still reads it.
- At connect the peer runs a self-test: it copies the exporter's probe buffer (a pattern derived from its agent
  epoch) through the mapping with the same kernel and compares the bytes. :func:`select_same_node` uses this to
  choose this transport or fall back to NIXL.
- A peer in the same process is reached by address (CUDA cannot IPC-open a handle in the exporting process).
- A D process that dies while mapped leaves P's memory untouched; P reclaims its pinned blocks by lease expiry.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgspec
import numpy as np

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
    RemoteMismatchError,
    TransferFailedError,
    TransferHandle,
    Transport,
    TransportError,
    UnknownPeerError,
    XferOp,
    XferStats,
    XferStatus,
    decode_notification,
    encode_notification,
)

from . import native_post
from ._common import HandleTable, XferRecord, check_pairing, new_epoch

log = logging.getLogger("kvlifecycle.transports.cuda_ipc")

NAME = "cuda_ipc"
PROBE_BYTES = 1 << 16
DRAIN_TIMEOUT_S = 10.0
ID_RING_INTS = 1 << 18  # 1 MiB of staged block ids: hundreds of requests in flight
# Measured on an H200 (docs/gpu.md): a kernel reading the ids from pinned host memory over PCIe ran at 0.74x of
# the ceiling (512 MiB) against 0.93x with the ids copied to the device first, so the copy stays the default.
HOST_IDS_DEFAULT = False
REGION_GROUP_HOST_IDS = 8  # with ids in host memory, each program reads them once for 8 regions
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


# --- the CUDA driver, through ctypes (no extra dependency) ------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class CudaDriver:
    """The few driver calls CUDA IPC needs. Raises :class:`BackendUnavailableError` if libcuda is missing."""

    _instance: CudaDriver | None = None

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise BackendUnavailableError(f"libcuda.so.1 not loadable: {exc}") from exc
        lib = self.lib
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), _IpcHandle, ctypes.c_uint]
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]
        vp = ctypes.c_void_p
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxPushCurrent_v2.argtypes = [vp]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cuEventCreate.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        lib.cuEventDestroy_v2.argtypes = [vp]
        lib.cuEventRecord.argtypes = [vp, vp]
        lib.cuEventQuery.argtypes = [vp]
        lib.cuEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        lib.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
        lib.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t, vp]
        lib.cuPointerGetAttribute.argtypes = [vp, ctypes.c_int, ctypes.c_uint64]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDeviceCanAccessPeer.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        lib.cuDevicePrimaryCtxRelease_v2.argtypes = [ctypes.c_int]
        lib.cuCtxEnablePeerAccess.argtypes = [vp, ctypes.c_uint]
        # The same library again for the calls on a request's latency path (post, poll): PyDLL keeps the GIL
        # across them. None of them blocks, and releasing the GIL there lets another Python thread (the settler,
        # a log syncer) take it mid-request: a thread switch costs more than the call.
        self.fast = ctypes.PyDLL("libcuda.so.1")
        fast = self.fast
        fast.cuEventRecord.argtypes = [vp, vp]
        fast.cuEventQuery.argtypes = [vp]
        fast.cuStreamWaitEvent.argtypes = [vp, vp, ctypes.c_uint]
        fast.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, vp, ctypes.c_size_t, vp]

    @classmethod
    def get(cls) -> CudaDriver:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise TransportError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(allocation base, allocation size) of the allocation holding ``ptr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                    f"cuMemGetAddressRange({ptr:#x})")
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), f"cuIpcGetMemHandle({base:#x})")
        return ctypes.string_at(ctypes.addressof(handle), 64)  # all 64 bytes: a c_char field stops at NUL

    def open(self, raw: bytes) -> int:
        if len(raw) != 64:
            raise RemoteMismatchError(f"an IPC handle is 64 bytes, got {len(raw)}")
        handle = _IpcHandle()
        ctypes.memmove(ctypes.addressof(handle), raw, 64)
        ptr = ctypes.c_uint64()
        self._check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _IPC_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        self._check(self.lib.cuIpcCloseMemHandle(ptr), f"cuIpcCloseMemHandle({ptr:#x})")

    # The hot path (post / poll) talks to the driver directly: torch's stream and event wrappers cost more
    # (device-index normalisation, context managers) than the copy of a small request.
    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value or 0

    def push_context(self, ctx: int) -> None:
        self._check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        ctx = ctypes.c_void_p()
        self._check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)), "cuCtxPopCurrent")

    def event_create(self, timing: bool) -> int:
        ev = ctypes.c_void_p()
        self._check(self.lib.cuEventCreate(ctypes.byref(ev), 0 if timing else 2), "cuEventCreate")
        return ev.value or 0

    def event_destroy(self, ev: int) -> None:
        self.lib.cuEventDestroy_v2(ev)

    def event_record(self, ev: int, stream: int) -> None:
        self._check(self.lib.cuEventRecord(ev, stream), "cuEventRecord")

    def event_done(self, ev: int) -> bool:
        rc = self.fast.cuEventQuery(ev)
        if rc == 600:  # CUDA_ERROR_NOT_READY
            return False
        self._check(rc, "cuEventQuery")
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self._check(self.lib.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return float(ms.value)

    def stream_wait(self, stream: int, ev: int) -> None:
        self._check(self.lib.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")

    def device_pointer(self, host_ptr: int) -> int:
        """The device address of pinned host memory (0 if the device cannot address it)."""
        out = ctypes.c_uint64()
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(out), 3, host_ptr)  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        return out.value if rc == 0 else 0

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def enable_peer_access(self, device: int, peer: int) -> None:
        """Let the current context (``device``'s) reach ``peer``'s memory directly: what ``cuIpcOpenMemHandle``'s
        lazy peer access does for another process's allocations, for this process's own. Raises
        :class:`RemoteMismatchError` where the two devices cannot reach each other."""
        lib, can = self.lib, ctypes.c_int()
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), peer), f"cuDeviceGet({peer})")
        own = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(own), device), f"cuDeviceGet({device})")
        self._check(lib.cuDeviceCanAccessPeer(ctypes.byref(can), own, dev), "cuDeviceCanAccessPeer")
        if not can.value:
            raise RemoteMismatchError(f"GPU {device} cannot access GPU {peer}'s memory (no peer access)")
        # The peer's primary context is alive (its memory was allocated in this process): retain it only to name it.
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        try:
            rc = lib.cuCtxEnablePeerAccess(ctx, 0)
            if rc != 704:  # CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                self._check(rc, f"cuCtxEnablePeerAccess(GPU {device} -> GPU {peer})")
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev)


class _Event:
    """A driver event (timing on); ``query`` never blocks."""

    __slots__ = ("driver", "handle")

    def __init__(self, driver: CudaDriver, handle: int) -> None:
        self.driver, self.handle = driver, handle

    def query(self) -> bool:
        return self.driver.event_done(self.handle)


class _IdRing:
    """Pinned host + device staging for block ids: one async copy per post, no allocation on the hot path.

    A slot is reused only after the transfer that used it completed (its copy of the ids ran before its kernel).
    """

    def __init__(self, torch: Any, device: Any, capacity: int, driver: CudaDriver) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int32, device=device)
        self.host_ptr, self.dev_ptr = self.host.data_ptr(), self.dev.data_ptr()
        # Pinned memory is mapped into the device's address space (UVA): the kernel can read the ids in place.
        self.host_dev_ptr = driver.device_pointer(self.host_ptr)
        self.head = 0
        self.busy: dict[int, int] = {}  # start -> end of slots whose transfer has not completed

    def reserve(self, count: int) -> int | None:
        if count > self.capacity:
            return None
        start = self.head if self.head + count <= self.capacity else 0
        end = start + count
        if self.busy and any(s < end and start < e for s, e in self.busy.items()):
            return None  # still in use: the caller stages this post on its own
        self.busy[start] = end
        self.head = end
        return start

    def free(self, start: int) -> None:
        self.busy.pop(start, None)


# --- wire format --------------------------------------------------------------------------------------------------


class AllocationWire(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes
    base: int
    size: int


class CudaIpcBlob(msgspec.Struct, frozen=True):
    """This transport's part of :class:`PeerMetadata` (``blob``)."""

    host: str  # node identity: boot id + hostname; IPC only between equal hosts
    pid: int
    device_uuid: str
    device_id: int
    endpoint: str  # the side channel (ZMQ ROUTER) for notifications
    allocations: list[AllocationWire]
    probe_addr: int
    probe_bytes: int
    probe_seed: int  # the probe holds probe_pattern(probe_seed)


_blob_encoder = msgspec.msgpack.Encoder()
_blob_decoder = msgspec.msgpack.Decoder(CudaIpcBlob)
_header_decoder = msgspec.msgpack.Decoder(tuple[str, int])


_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _block_ids(ids: Any, limit: int, what: str) -> np.ndarray:
    """Block ids as a 1-D integer array within [0, limit) (no copy when they already are).

    One reduction checks both ends: viewed as unsigned, a negative id is larger than any limit (the hot path of
    ``post``; min() + max() cost two passes and two Python round trips)."""
    arr = ids if type(ids) is np.ndarray else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise RemoteMismatchError(f"{what} block ids must be a 1-D integer array")
    if arr.size:
        unsigned = arr.view(_UNSIGNED[arr.dtype.itemsize]) if arr.dtype.kind == "i" else arr
        if int(unsigned.max()) >= limit:
            raise RemoteMismatchError(f"{what} block ids must be in [0, {limit}), got [{arr.min()}, {arr.max()}]")
    return arr


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """The id vectors of a batch as one (int64 when several: an int and a uint vector would join as float)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty(0, dtype=np.int64)
    # unsafe: a uint64 id above 2**63 turns negative, which the range check (viewed as unsigned) refuses too
    return np.concatenate(parts, dtype=np.int64, casting="unsafe")


def _refuse_batch(requests: Sequence[tuple[Any, Any, Any, Any]], plan: PreparedPlan) -> NoReturn:
    """Raise the precise error of the first bad request of a refused ``post_batch``."""
    for i, (local_blocks, remote_blocks, _, _) in enumerate(requests):
        local = _block_ids(local_blocks, plan.local_blocks, f"request {i}: local")
        remote = _block_ids(remote_blocks, plan.remote_blocks, f"request {i}: remote")
        if local.size != remote.size:
            raise RemoteMismatchError(f"request {i}: {local.size} local blocks vs {remote.size} remote blocks")
    raise RemoteMismatchError("batch refused, yet every request checks out on its own")  # not expected


def node_identity() -> str:
    """Boot id + hostname: two processes with the same value share a kernel, hence GPUs and IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}@{socket.gethostname()}"


def probe_pattern(epoch: int, nbytes: int = PROBE_BYTES) -> np.ndarray:
    """Bytes the exporter writes into its probe buffer; the peer recomputes them to check what it read."""
    seed = np.uint64(epoch & 0xFFFFFFFF)
    idx = np.arange(nbytes, dtype=np.uint64)
    return ((idx * np.uint64(2654435761) + seed) >> np.uint64(7)).astype(np.uint8)


# --- bookkeeping --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Peer:
    name: str
    epoch: int
    layout: KVLayout  # as the peer sees it
    mapped: KVLayout  # the same regions at addresses this process can use
    opened: list[int]  # IPC mappings to close
    dealer: Any  # ZMQ socket to the peer's side channel
    same_process: bool
    probe: tuple[int, int, int]  # the peer's probe buffer (local address, bytes, pattern seed)
    self_test_s: float = 0.0
    self_test_gbps: float = 0.0


@dataclass(slots=True)
class _Group:
    """Regions that share unit size and strides on both sides: one copier (one launch) per direction."""

    regions: np.ndarray  # region indices, ascending
    read: Any  # BlockCopier peer -> local
    write: Any  # BlockCopier local -> peer
    unit_bytes: int


@dataclass(slots=True)
class _Launch:
    """What ``post`` needs for one set of groups, computed once (plan) or once per region subset."""

    read: list[Any]  # BlockCopier per group, peer -> local
    write: list[Any]  # BlockCopier per group, local -> peer
    bytes_per_block: int  # bytes moved per block id over every region
    regions: int  # regions (descriptors per block id)
    backend: str
    native_read: Any = None  # native_post.KernelList of ``read`` once every copier is warm (the compiled post)
    native_write: Any = None
    inline_read: Any = None  # the same with the inline-ids kernels (requests of at most inline_count blocks)
    inline_write: Any = None


def _launch_of(groups: list[_Group]) -> _Launch:
    return _Launch([g.read for g in groups], [g.write for g in groups],
                   sum(g.unit_bytes * len(g.regions) for g in groups), sum(len(g.regions) for g in groups),
                   groups[0].read.backend if groups else "")


@dataclass(slots=True)
class _Plan:
    plan: PreparedPlan
    groups: list[_Group]
    subsets: dict[tuple[int, tuple[int, ...]], _Group] = field(default_factory=dict)
    whole: _Launch | None = None  # the launch over every region (regions=None), built with the plan


@dataclass(slots=True)
class _Inflight:
    start: Any  # _Event (timing)
    end: Any  # _Event: the completion handle
    slot: int | None  # ring slot of the ids, freed when the copy completed
    keep: list[Any]  # ids staged outside the ring, alive until the copy finished
    notify: tuple[str, Notification] | None = None
    t_launched: float = 0.0  # host clock right after the last kernel launch call returned
    shared: list[int] | None = None  # post_batch: [handles still holding this launch's id slot and events]


_OPS = {op.value: op for op in XferOp}
# The CUDA contexts of every transport registered in this process. While there is one, a thread that once had it
# current keeps it (there is no other to switch to), so a transport may remember that per thread; with two (P and
# D on two GPUs of one process) a thread's current context follows torch's current device, so it is checked on
# every call that needs it.
_CONTEXTS_SEEN: set[int] = set()
SETTLE_AFTER_S = 0.0005  # a completed copy's notification waits at most this long for the caller's next call
# The settler keeps watching this long after the last copy settled before it sleeps until the next post: a
# transport in use then never pays the wake-up (a futex syscall, and a thread asking for the GIL) inside a post.
SETTLER_LINGER_S = 0.05


class CudaIpcTransport:
    """The CUDA IPC transport. See the module docstring; implements :class:`kvlifecycle.transport.Transport`."""

    name = NAME

    def __init__(
        self,
        agent: str,
        *,
        epoch: int | None = None,
        bind_host: str = "127.0.0.1",
        self_test: bool = True,
        chunk_bytes: int | None = None,
        num_warps: int | None = None,
        use_triton: bool | None = None,
        host_ids: bool | None = None,
        region_group: int | None = None,
        compiled_post: bool = True,
        inline_ids: bool | None = None,
    ) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise BackendUnavailableError("the CUDA IPC transport needs torch") from exc
        if not torch.cuda.is_available():
            raise BackendUnavailableError("the CUDA IPC transport needs a CUDA device (torch.cuda.is_available())")
        import zmq

        self._torch = torch
        self._driver = CudaDriver.get()
        self.agent = agent
        self.epoch = new_epoch() if epoch is None else int(epoch)
        self.self_test = self_test
        self._copier_kwargs: dict[str, Any] = {}
        if chunk_bytes is not None:
            self._copier_kwargs["chunk_bytes"] = chunk_bytes
        if num_warps is not None:
            self._copier_kwargs["num_warps"] = num_warps
        if use_triton is not None:
            self._copier_kwargs["use_triton"] = use_triton
        # Block ids: copied to the device before the kernel (default, measured faster), or read by the kernel
        # straight from pinned host memory over PCIe. KVL_CUDA_IPC_HOST_IDS=0/1 overrides the default.
        env_ids = os.environ.get("KVL_CUDA_IPC_HOST_IDS")
        self.host_ids = (env_ids != "0") if host_ids is None and env_ids is not None else bool(
            HOST_IDS_DEFAULT if host_ids is None else host_ids)
        group = region_group if region_group is not None else int(os.environ.get(
            "KVL_CUDA_IPC_REGION_GROUP", REGION_GROUP_HOST_IDS if self.host_ids else 1))
        self._copier_kwargs["region_group"] = group
        # Requests of at most INLINE_IDS blocks pass their ids as launch parameters (compiled post only): no id
        # copy on their latency path. KVL_CUDA_IPC_INLINE_IDS=0/1 overrides.
        env_inline = os.environ.get("KVL_CUDA_IPC_INLINE_IDS")
        self.inline_ids = (env_inline != "0") if inline_ids is None and env_inline is not None else (
            True if inline_ids is None else bool(inline_ids))
        self._copier_kwargs["inline_ids"] = self.inline_ids
        self.layout: KVLayout | None = None
        self.device: Any = None
        self._stream: Any = None
        self._exports: list[AllocationWire] = []
        self._probe: Any = None
        self._peers: dict[str, _Peer] = {}
        self._known_epochs: dict[str, int] = {}
        self._plans: dict[int, _Plan] = {}
        self._plan_keys = itertools.count(1)
        self._handles = HandleTable()
        self._inflight: dict[int, _Inflight] = {}
        self._draining: list[tuple[str, _Inflight]] = []  # released handles whose copy is still running
        self._cu_ctx = 0
        self._cu_stream = 0
        self._dev_index = 0
        self._order_event = 0
        self._ids_event = 0
        self._copy_stream: Any = None
        self._cu_copy = 0
        self._event_pool: list[tuple[_Event, _Event]] = []
        self._ring: _IdRing | None = None
        # The compiled post (native_post): its library, this transport's streams/events/staging as one C struct,
        # and the pageable int64 array numpy widens the caller's ids into.
        self._native: Any = None
        # True: the compiled post wherever it builds and loads (KVL_NATIVE_POST=0 turns it off); False: Python.
        self._want_native = bool(compiled_post)
        self._poster: native_post.PosterDesc | None = None
        self._poster_addr = 0
        self._post_args: np.ndarray | None = None
        self._post_call: Any = None
        self._args_kernels: Any = None  # the kernels and id limits the argument fields were last written for
        self._args_limits = (-1, -1)
        self._current_stream = torch._C._cuda_getCurrentRawStream  # the caller's stream, as a raw handle
        self._staging: np.ndarray | None = None
        # Copies seen complete whose stats and notification are still to be done (see _complete, _settle); a
        # small thread settles what no call of the caller's settled within SETTLE_AFTER_S.
        self._settling: list[tuple[XferRecord, _Inflight]] = []
        self._settle_kick = threading.Event()
        self._settler: threading.Thread | None = None
        self._settle_watching = False  # the settler is watching (copies in flight or settling); under _lock
        self._probe_seed = 0
        self._trace = os.environ.get("KVL_CUDA_IPC_TRACE") == "1"  # per-stage post timings in rec.extra
        # Threads seen with this transport's context current: their later calls skip the check (a thread that
        # switches context afterwards gets a loud driver error, never a silent wrong copy).
        self._ctx_ok = threading.local()
        self._stage_marks: tuple[Any, ...] = ()
        self._inbox: collections.deque[tuple[str, Notification]] = collections.deque()
        self._lock = threading.RLock()
        self.malformed_notifications = 0
        self.stale_notifications = 0
        self.failed_notifications = 0
        self._closed = False
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._host = node_identity()
        self._header = msgspec.msgpack.encode((self.agent, self.epoch))  # every notification's first frame

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
                self._cu_ctx = self._driver.current_context()
                _CONTEXTS_SEEN.add(self._cu_ctx)
                self._order_event = self._driver.event_create(timing=False)
                self._ids_event = self._driver.event_create(timing=False)
                self._copy_stream = torch.cuda.Stream(device)
                self._ring = _IdRing(torch, device, ID_RING_INTS, self._driver)
            self._cu_stream = self._stream.cuda_stream
            self._cu_copy = self._copy_stream.cuda_stream
            self._bind_native()
            self.device = device
            self._dev_index = device.index
            self._probe = probe
            self._exports = list(allocations.values())
            self.layout = layout

    def _bind_native(self) -> None:
        """Load the compiled post (built once per machine) and describe this transport to it."""
        lib = None if self.host_ids or not self._want_native else native_post.load()
        ring = self._ring
        if lib is None or ring is None:
            return
        self._staging = np.zeros(ring.capacity, dtype=np.int64)
        poster = native_post.PosterDesc()
        poster.stream, poster.copy_stream = self._cu_stream, self._cu_copy
        poster.order_event, poster.ids_event = self._order_event, self._ids_event
        poster.staging = self._staging.ctypes.data
        poster.ring_host, poster.ring_dev = ring.host_ptr, ring.dev_ptr
        poster.trace = 1 if self._trace else 0
        self._native, self._poster = lib, poster
        self._poster_addr = ctypes.addressof(poster)
        self._post_args = poster.call_args()
        self._post_call = lib.kvl_post_call

    @property
    def compiled_post(self) -> bool:
        """Whether posts go through the compiled path (``native_post``) once the kernels are warm."""
        return self._native is not None

    def registered_regions(self) -> int:
        return 0 if self.layout is None else self.layout.num_regions

    def local_metadata(self) -> PeerMetadata:
        if self.layout is None:
            raise RegistrationError("register before exporting metadata")
        props = self._torch.cuda.get_device_properties(self.device)
        blob = CudaIpcBlob(self._host, os.getpid(), str(getattr(props, "uuid", "")), self.device.index,
                           self.endpoint, self._exports, self._probe.data_ptr(), int(self._probe.numel()),
                           self._probe_seed)
        return PeerMetadata(self.agent, self.epoch, self.name, _blob_encoder.encode(blob), LayoutWire.of(self.layout))

    # -- peers ------------------------------------------------------------------------------------------------------
    def add_peer(self, meta: PeerMetadata) -> str:
        if meta.transport != self.name:
            raise TransportError(f"peer speaks {meta.transport!r}, not {self.name}")
        try:
            blob = _blob_decoder.decode(meta.blob)
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
            peer = self._map_peer(meta, blob, remote)
            try:
                if self.self_test:
                    self._run_self_test(peer, blob.probe_seed)
                peer.dealer = self._ctx.socket(self._zmq.DEALER)
                peer.dealer.setsockopt(self._zmq.LINGER, 0)
                peer.dealer.setsockopt(self._zmq.SNDHWM, 10000)
                peer.dealer.connect(blob.endpoint)
            except BaseException:
                self._unmap(peer)
                raise
            self._peers[peer.name] = peer
            self._known_epochs[peer.name] = peer.epoch
            log.info("cuda_ipc peer %s epoch %d mapped (%s, %d allocations, self-test %.1f us, %.1f GB/s)",
                     peer.name, peer.epoch, "same process" if peer.same_process else "IPC",
                     len(peer.opened), peer.self_test_s * 1e6, peer.self_test_gbps)
            return peer.name

    def _map_peer(self, meta: PeerMetadata, blob: CudaIpcBlob, remote: KVLayout) -> _Peer:
        """Translate the peer's addresses into this process: IPC-open each allocation once."""
        same_process = blob.pid == os.getpid()
        opened: list[int] = []
        table: list[tuple[int, int, int]] = []  # (remote base, size, local base)
        with self._torch.cuda.device(self.device):
            if same_process and blob.device_id != self.device.index:
                # One process, two GPUs: its own pointers, reachable once peer access is on (else refused here,
                # where selection falls back, rather than as an illegal address inside the self-test's kernel).
                try:
                    with self._context():  # a service thread (a connector's) may have no context current
                        self._driver.enable_peer_access(self.device.index, blob.device_id)
                except TransportError as exc:
                    raise RemoteMismatchError(f"{meta.agent}: cannot reach GPU {blob.device_id}: {exc}") from exc
            try:
                for alloc in blob.allocations:
                    local = alloc.base if same_process else self._driver.open(alloc.handle)
                    if not same_process:
                        opened.append(local)
                    table.append((alloc.base, alloc.size, local))
            except TransportError as exc:
                for ptr in opened:
                    self._driver.close(ptr)
                raise RemoteMismatchError(f"{meta.agent}: cannot map its memory: {exc}") from exc

        def translate(addr: int, nbytes: int) -> int:
            for base, size, local in table:
                if base <= addr and addr + nbytes <= base + size:
                    return local + (addr - base)
            raise RemoteMismatchError(f"{meta.agent}: region {addr:#x}+{nbytes} is in no exported allocation")

        try:
            mapped = KVLayout(remote.kind, self.device.index, remote.num_blocks,
                              tuple(translate(a, n) for a, n in zip(remote.base_addrs, remote.region_bytes,
                                                                    strict=True)),
                              remote.block_bytes)
            probe = translate(blob.probe_addr, blob.probe_bytes)
        except RemoteMismatchError:
            for ptr in opened:
                self._driver.close(ptr)
            raise
        return _Peer(meta.agent, meta.epoch, remote, mapped, opened, None, same_process,
                     (probe, blob.probe_bytes, blob.probe_seed))

    def _run_self_test(self, peer: _Peer, seed: int) -> None:
        """Copy the peer's probe through the mapping with the transfer kernel; refuse the peer if bytes differ."""
        seconds, got = self._probe_copy(peer)
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
            seconds, got = self._probe_copy(p, timeout_s)
            if not np.array_equal(got, probe_pattern(p.probe[2], got.size)):
                raise TransferFailedError(f"{peer}: probe read wrong bytes")
            return ProbeResult(peer, int(got.size), seconds, f"{NAME}/{'triton' if self._uses_triton() else 'torch'}")

    def _uses_triton(self) -> bool:
        from .triton_copy import HAVE_TRITON

        return HAVE_TRITON and self._copier_kwargs.get("use_triton", True) is not False

    def _probe_copy(self, peer: _Peer, timeout_s: float = 5.0) -> tuple[float, np.ndarray]:
        """One timed copy of the peer's probe into local scratch; returns (seconds, the bytes read)."""
        from .triton_copy import BlockCopier, RegionSpec

        torch = self._torch
        addr, nbytes, _seed = peer.probe
        scratch = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        copier = BlockCopier([RegionSpec(addr, nbytes, 1, nbytes)], [RegionSpec(scratch.data_ptr(), nbytes, 1, nbytes)],
                             self.device, **self._copier_kwargs)
        ids = torch.zeros(1, dtype=torch.int32, device=self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
            copier.copy(ids, ids)  # compile / warm up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            scratch.zero_()
            start.record()
            copier.copy(ids, ids)
            end.record()
        deadline = time.monotonic() + timeout_s
        while not end.query():
            if time.monotonic() > deadline:
                raise TransferFailedError(f"{peer.name}: probe copy did not finish in {timeout_s} s")
            time.sleep(1e-4)
        return start.elapsed_time(end) / 1e3, scratch.cpu().numpy()

    def peer_info(self, peer: str) -> dict[str, Any]:
        """What connecting to ``peer`` found and measured (for selection logs)."""
        p = self._peers.get(peer)
        if p is None:
            raise UnknownPeerError(peer)
        return {"peer": p.name, "epoch": p.epoch, "same_process": p.same_process, "ipc_mappings": len(p.opened),
                "self_test_us": round(p.self_test_s * 1e6, 2), "self_test_gbps": round(p.self_test_gbps, 2)}

    def remove_peer(self, peer: str) -> None:
        with self._lock:
            p = self._peers.get(peer)
            if p is not None:
                self._drop_peer(p, "peer removed")

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        """Void the peer's plans, fail its pending transfers, wait for copies that touch its memory, unmap it."""
        del self._peers[peer.name]
        self._plans = {k: p for k, p in self._plans.items() if p.plan.peer != peer.name}
        flights = []
        for rec in self._handles.live.values():
            if rec.handle.peer == peer.name and rec.status is XferStatus.PENDING:
                flight = self._inflight.pop(rec.handle.id, None)
                if flight is not None:
                    flights.append(flight)
                rec.status, rec.error = XferStatus.FAILED, PeerEpochError(f"{peer.name}: {reason}")
        flights += [f for name, f in self._draining if name == peer.name]
        self._draining = [(n, f) for n, f in self._draining if n != peer.name]
        if self._wait([f.end for f in flights if f.end is not None]):
            for flight in flights:
                self._retire(flight)
            self._unmap(peer)
        else:  # never unmap under a running kernel: leak the mapping instead
            log.error("cuda_ipc: copies touching %s still running after %.0f s; its mapping is kept",
                      peer.name, DRAIN_TIMEOUT_S)
            if peer.dealer is not None:
                peer.dealer.close(0)

    def _wait(self, events: list[Any]) -> bool:
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        with self._context():
            for event in events:
                while not event.query():
                    if time.monotonic() > deadline:
                        return False
                    time.sleep(1e-4)
        return True

    def _unmap(self, peer: _Peer) -> None:
        with self._torch.cuda.device(self.device):
            for ptr in peer.opened:
                try:
                    self._driver.close(ptr)
                except TransportError as exc:
                    log.warning("cuda_ipc: unmapping %s: %s", peer.name, exc)
        peer.opened = []
        if peer.dealer is not None:
            peer.dealer.close(0)
            peer.dealer = None

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
            local_specs = _specs(self.layout, local_view)
            remote_specs = _specs(p.mapped, remote_view)
            plan = PreparedPlan(next(self._plan_keys), peer, p.epoch, local_view, remote_view, nl, nr,
                                self.layout.num_regions)
            groups = self._groups(local_specs, remote_specs, np.arange(self.layout.num_regions))
            self._plans[plan.key] = _Plan(plan, groups, whole=_launch_of(groups))
            return plan

    def _groups(self, local_specs: list[Any], remote_specs: list[Any], regions: np.ndarray) -> list[_Group]:
        from .triton_copy import BlockCopier

        by_shape: dict[tuple[Any, ...], list[int]] = {}
        for r in regions.tolist():
            ls, rs = local_specs[r], remote_specs[r]
            key = (ls.stride, ls.unit_bytes, ls.split, ls.sub_stride, rs.stride, rs.split, rs.sub_stride)
            by_shape.setdefault(key, []).append(r)
        groups = []
        for regs in by_shape.values():
            loc = [local_specs[r] for r in regs]
            rem = [remote_specs[r] for r in regs]
            groups.append(_Group(np.asarray(regs, dtype=np.int64),
                                 BlockCopier(rem, loc, self.device, **self._copier_kwargs),
                                 BlockCopier(loc, rem, self.device, **self._copier_kwargs),
                                 loc[0].unit_bytes))
        return groups

    def _plan_groups(self, prepared: _Plan, regions: np.ndarray | Sequence[int] | None) -> list[_Group]:
        if regions is None:
            return prepared.groups
        regs = np.unique(np.asarray(regions, dtype=np.int64))
        if regs.size != len(regions) or (regs.size and (regs[0] < 0 or regs[-1] >= prepared.plan.num_regions)):
            raise RemoteMismatchError(f"regions must be distinct indices in [0, {prepared.plan.num_regions})")
        out = []
        for i, group in enumerate(prepared.groups):
            mine = np.intersect1d(group.regions, regs)
            if mine.size == group.regions.size:
                out.append(group)
            elif mine.size:
                key = (i, tuple(mine.tolist()))
                sub = prepared.subsets.get(key)
                if sub is None:
                    pick = np.searchsorted(group.regions, mine)
                    sub = _Group(mine, _subset(group.read, pick), _subset(group.write, pick), group.unit_bytes)
                    prepared.subsets[key] = sub
                out.append(sub)
        return out

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
        t0 = time.perf_counter()
        if op.__class__ is not XferOp:
            op = _OPS.get(op) or XferOp(op)  # type: ignore[call-overload]  # a dict hit is cheaper than Enum()
        with self._lock:
            launch = self._launch_for(plan, regions)
            notify = (plan.peer, notification) if notification is not None else None
            flight = None
            if self._native is not None:
                # The compiled post checks the ids itself: here only what makes them a pair of integer vectors.
                local = local_blocks if local_blocks.__class__ is np.ndarray else np.asarray(local_blocks)
                remote = remote_blocks if remote_blocks.__class__ is np.ndarray else np.asarray(remote_blocks)
                n = local.size
                if (n and n == remote.size and local.ndim == 1 and remote.ndim == 1
                        and local.dtype.kind in "iu" and remote.dtype.kind in "iu"):
                    kernels = self._kernels_for(launch, op, n)
                    if kernels is not None:
                        flight = self._post_native(kernels, op, plan, local, remote, n, notify)
            t_checked = time.perf_counter()
            if flight is None:  # the Python path: also where a bad id list gets its precise error
                local = _block_ids(local_blocks, plan.local_blocks, "local")
                remote = _block_ids(remote_blocks, plan.remote_blocks, "remote")
                n = local.size
                if n != remote.size:
                    raise RemoteMismatchError(f"{n} local blocks vs {remote.size} remote blocks")
                flight = self._launch_python(op, launch, local, remote, n, notify)
            # -- the copy is running (or there is nothing to copy): bookkeeping overlaps it --
            rec = self._handles.new(op, plan.peer, plan.peer_epoch, transfer)
            rec.t_post_start = t0
            rec.nbytes = n * launch.bytes_per_block
            rec.ndesc = n * launch.regions
            rec.native = launch.backend
            self._inflight[rec.handle.id] = flight
            rec.t_post_end = time.perf_counter()
            if self._settling:
                self._settle()  # earlier copies' stats and notifications, while this one runs
            self._watch()
            if flight.end is None:
                self._complete(rec)
                self._settle()
            elif self._trace:  # raw stamps only: the dict is built by stage_times(), off every latency path
                rec.extra["stages_raw"] = (t0, t_checked, flight.t_launched, rec.t_post_end, self._stage_marks)
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
            op = _OPS.get(op) or XferOp(op)  # type: ignore[call-overload]
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
                    _refuse_batch(requests, plan)
                sizes.append(loc.size)
                if loc.size:
                    locals_.append(loc)
                    remotes.append(rem)
            local, remote = _joined(locals_), _joined(remotes)
            n = local.size
            flight = None
            kernels = self._kernels_for(launch, op, n) if n else None
            if kernels is not None:
                flight = self._post_native(kernels, op, plan, local, remote, n, None)
            if flight is None:  # an id out of range, the ring full, or no compiled post
                try:
                    _block_ids(local, plan.local_blocks, "local")
                    _block_ids(remote, plan.remote_blocks, "remote")
                except RemoteMismatchError:
                    _refuse_batch(requests, plan)
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
                self._inflight[rec.handle.id] = _Inflight(flight.start, flight.end, flight.slot, flight.keep,
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

    def _launch_for(self, plan: PreparedPlan, regions: np.ndarray | Sequence[int] | None) -> _Launch:
        """The prepared launch of a live plan (every region, or a cached region subset)."""
        if self._closed:
            raise TransportError("transport is closed")
        prepared = self._plans.get(plan.key)
        if prepared is None or (prepared.plan is not plan and prepared.plan != plan):
            raise PeerEpochError(f"plan {plan.key} for {plan.peer} is void (peer removed or restarted)")
        if regions is None and prepared.whole is not None:
            return prepared.whole
        return _launch_of(self._plan_groups(prepared, regions))

    def _launch_python(self, op: XferOp, launch: _Launch, local: np.ndarray, remote: np.ndarray, n: int,
                       notify: tuple[str, Notification] | None) -> _Inflight:
        """The Python post of checked ids (the compiled post's fallback, and the path until kernels are warm)."""
        copiers = launch.read if op is XferOp.READ else launch.write
        if n == 0 or not copiers:
            return _Inflight(None, None, None, [], notify)
        src, dst = (remote, local) if op is XferOp.READ else (local, remote)
        pushed = self._need_context()  # a service thread may have no context current
        if pushed:
            self._driver.push_context(self._cu_ctx)
        try:
            return self._launch(copiers, src, dst, n, notify)
        finally:
            if pushed:
                self._driver.pop_context()

    def _kernels_for(self, launch: _Launch, op: XferOp, n: int) -> Any:
        """The launch's kernels for the compiled post of ``n`` block ids, once every copier is warm and bound (else
        None): the inline-ids kernels for a request small enough (no id copy), else the staged-ids ones."""
        if self.inline_ids:
            kernels = launch.inline_read if op is XferOp.READ else launch.inline_write
            if kernels is None:
                kernels = self._kernel_list(launch, op, "native_inline")
                if op is XferOp.READ:
                    launch.inline_read = kernels
                else:
                    launch.inline_write = kernels
            if kernels is not None and n <= kernels.inline_count:
                return kernels
        kernels = launch.native_read if op is XferOp.READ else launch.native_write
        if kernels is not None or self._native is None:
            return kernels
        kernels = self._kernel_list(launch, op, "native")
        if op is XferOp.READ:
            launch.native_read = kernels
        else:
            launch.native_write = kernels
        return kernels

    def _kernel_list(self, launch: _Launch, op: XferOp, attr: str) -> Any:
        """A ``KernelList`` of every copier's bound kernel ``attr``; None until all are warm and bound."""
        if self._native is None:
            return None
        copiers = launch.read if op is XferOp.READ else launch.write
        descs = [getattr(c, attr, None) for c in copiers]
        if not copiers or len(copiers) > native_post.MAX_KERNELS or any(d is None for d in descs):
            return None
        return native_post.KernelList(descs)

    def _post_native(self, kernels: Any, op: XferOp, plan: PreparedPlan, local: np.ndarray, remote: np.ndarray,
                     n: int, notify: tuple[str, Notification] | None) -> _Inflight | None:
        """One call into the compiled post: ids checked and staged, streams ordered, kernels launched, events
        recorded. None (nothing enqueued) when the id ring has no room, or an id is out of range: the Python path
        then stages the post on its own, or raises the precise error."""
        ring, staging = self._ring, self._staging
        assert ring is not None and staging is not None
        if op is XferOp.READ:  # peer -> local
            src, dst, src_limit, dst_limit = remote, local, plan.remote_blocks, plan.local_blocks
        else:
            src, dst, src_limit, dst_limit = local, remote, plan.local_blocks, plan.remote_blocks
        pad = -(-n // 4) * 4  # both id lists 16-byte aligned: one kernel specialisation whatever n is
        if kernels.inline_count:  # the ids go as launch parameters: no ring slot
            slot = None
        else:
            slot = ring.reserve(2 * pad)
            if slot is None:
                return None
        staging[:n] = src  # numpy widens any integer dtype to int64; the C side checks and narrows
        staging[pad:pad + n] = dst
        drv = self._driver
        start, end = self._event_pool.pop() if self._event_pool else (
            _Event(drv, drv.event_create(timing=True)), _Event(drv, drv.event_create(timing=True)))
        pushed = self._need_context()  # a service thread may have no context current
        if pushed:
            drv.push_context(self._cu_ctx)
        args = self._post_args  # PosterDesc.CALL_FIELDS, written in place: the call itself takes one pointer
        if kernels is not self._args_kernels or src_limit != self._args_limits[0] or dst_limit != self._args_limits[1]:
            args[0] = kernels.address  # what stays the same from one post of a plan to the next: written once
            args[1] = kernels.count
            args[5] = src_limit
            args[6] = dst_limit
            self._args_kernels, self._args_limits = kernels, (src_limit, dst_limit)
        args[2] = slot or 0
        args[3] = n
        args[4] = pad
        args[7] = self._current_stream(self._dev_index)
        args[8] = start.handle
        args[9] = end.handle
        args[10] = 1 if self._inflight or self._draining else 0
        t_call = time.perf_counter()
        try:
            rc = self._post_call(self._poster_addr)
        finally:
            if pushed:
                drv.pop_context()
        t_launched = time.perf_counter()
        if rc:
            if slot is not None:
                ring.free(slot)
            self._event_pool.append((start, end))
            if rc in (native_post.ERR_SRC_RANGE, native_post.ERR_DST_RANGE):
                return None
            if rc < 0:
                raise TransportError(f"compiled post refused its arguments ({rc})")
            assert self._poster is not None
            drv._check(rc, native_post.STEPS.get(self._poster.error_step, "compiled post"))
        if self._trace:  # the C side's own stamps (copied: the next post overwrites them), for stage_times()
            assert self._poster is not None
            self._stage_marks = ("native", t_call, t_launched, tuple(self._poster.trace_ns))
            self._poster.trace = 1  # tracing turned on after registration: stamps from the next post on
        return _Inflight(start, end, slot, [], notify, t_launched)

    def _launch(self, copiers: list[Any], src: np.ndarray, dst: np.ndarray, n: int,
                notify: tuple[str, Notification] | None) -> _Inflight:
        """Stage the ids (one async copy from the pinned ring), order after the caller's stream, launch every
        group's copy, record the completion event. Driver calls go straight to libcuda (no wrapper frames); a
        non-zero result is turned into an error by the checked wrapper."""
        drv = self._driver
        start, end = self._event_pool.pop() if self._event_pool else (
            _Event(drv, drv.event_create(timing=True)), _Event(drv, drv.event_create(timing=True)))
        t_a = time.perf_counter()
        pad = -(-n // 4) * 4  # both id lists 16-byte aligned: one kernel specialisation whatever n is
        ring = self._ring
        assert ring is not None
        slot = ring.reserve(2 * pad)
        try:
            return self._stage_and_launch(copiers, src, dst, n, notify, start, end, pad, slot, t_a)
        except BaseException:
            if slot is not None:
                ring.free(slot)  # a step failed before its kernel was enqueued (later ones: the context is gone)
            self._event_pool.append((start, end))
            raise

    def _stage_and_launch(self, copiers: list[Any], src: np.ndarray, dst: np.ndarray, n: int,
                          notify: tuple[str, Notification] | None, start: _Event, end: _Event, pad: int,
                          slot: int | None, t_a: float) -> _Inflight:
        drv, stream = self._driver, self._cu_stream
        lib = drv.fast
        ring = self._ring
        assert ring is not None
        keep: list[Any] = []
        ids_copied = False
        if slot is not None:
            host = ring.host_np
            host[slot:slot + n] = src
            host[slot + pad:slot + pad + n] = dst
            if self.host_ids and ring.host_dev_ptr and all(c.warm for c in copiers):
                src_ptr = ring.host_dev_ptr + 4 * slot  # the kernel reads the ids where the host wrote them
            elif self._inflight or self._draining:
                # On the copy stream: the ids move while an earlier transfer's kernel still runs, so back-to-back
                # transfers leave no copy-engine gap between their kernels.
                src_ptr = ring.dev_ptr + 4 * slot
                rc = lib.cuMemcpyHtoDAsync_v2(src_ptr, ring.host_ptr + 4 * slot, 8 * pad, self._cu_copy)
                if rc:
                    drv._check(rc, "cuMemcpyHtoDAsync")
                rc = lib.cuEventRecord(self._ids_event, self._cu_copy)
                if rc:
                    drv._check(rc, "cuEventRecord(ids)")
                ids_copied = True
            else:
                # Nothing in flight: no kernel to overlap with, so the ids go on the transfer's own stream (two
                # driver calls fewer on a lone request's latency path: no event, no cross-stream wait).
                src_ptr = ring.dev_ptr + 4 * slot
                rc = lib.cuMemcpyHtoDAsync_v2(src_ptr, ring.host_ptr + 4 * slot, 8 * pad, stream)
                if rc:
                    drv._check(rc, "cuMemcpyHtoDAsync")
        else:  # ring full of in-flight ids: stage this post on its own (pinned, tracked by torch)
            torch = self._torch
            host_t = torch.empty(2 * pad, dtype=torch.int32, pin_memory=True)
            host_t.numpy()[:n], host_t.numpy()[pad:pad + n] = src, dst
            with torch.cuda.stream(self._stream):
                dev_ids = host_t.to(self.device, non_blocking=True)
            keep = [host_t, dev_ids]
            src_ptr = dev_ids.data_ptr()
        t_b = time.perf_counter()
        # Blocks may have been written (P) or last read (D) on the caller's current stream: order after it.
        rc = lib.cuEventRecord(self._order_event, self._torch._C._cuda_getCurrentRawStream(self._dev_index))
        if rc:
            drv._check(rc, "cuEventRecord(order)")
        rc = lib.cuStreamWaitEvent(stream, self._order_event, 0)
        if rc:
            drv._check(rc, "cuStreamWaitEvent(order)")
        if ids_copied:
            rc = lib.cuStreamWaitEvent(stream, self._ids_event, 0)
            if rc:
                drv._check(rc, "cuStreamWaitEvent(ids)")
        rc = lib.cuEventRecord(start.handle, stream)
        if rc:
            drv._check(rc, "cuEventRecord(start)")
        t_c = time.perf_counter()
        dst_ptr = src_ptr + 4 * pad
        for copier in copiers:
            if not copier.launch_ptrs(stream, src_ptr, dst_ptr, n):
                ids = ring.dev[slot:slot + 2 * pad] if slot is not None else keep[1]  # first launch: Triton's JIT
                if slot is not None and src_ptr != ring.dev_ptr + 4 * slot:
                    drv.memcpy_htod_async(ring.dev_ptr + 4 * slot, ring.host_ptr + 4 * slot, 8 * pad, stream)
                copier.launch(self._stream, ids[:n], ids[pad:pad + n])
        t_d = time.perf_counter()
        rc = lib.cuEventRecord(end.handle, stream)
        if rc:
            drv._check(rc, "cuEventRecord(end)")
        if self._trace:
            self._stage_marks = ("python", t_a, t_b, t_c, t_d, time.perf_counter())
        return _Inflight(start, end, slot, keep, notify, t_d)

    def _need_context(self) -> bool:
        """Whether this thread must push the transport's context for driver calls (checked once per thread while
        the process has one context; on every call once it has two)."""
        if not self._cu_ctx or (getattr(self._ctx_ok, "ok", False) and len(_CONTEXTS_SEEN) == 1):
            return False
        if self._driver.current_context() == self._cu_ctx:
            self._ctx_ok.ok = True
            return False
        return True

    @contextlib.contextmanager
    def _context(self) -> Any:
        """Make this transport's CUDA context current for driver calls (a service thread may have none)."""
        drv = self._driver
        pushed = self._need_context()
        if pushed:
            drv.push_context(self._cu_ctx)
        try:
            yield
        finally:
            if pushed:
                drv.pop_context()

    def _retire(self, flight: _Inflight) -> None:
        """The copy finished: its id slot and events can be reused (by the last handle of a batch)."""
        if flight.shared is not None:
            flight.shared[0] -= 1
            if flight.shared[0] > 0:
                return
        if flight.slot is not None and self._ring is not None:
            self._ring.free(flight.slot)
        if flight.start is not None and isinstance(flight.end, _Event):
            self._event_pool.append((flight.start, flight.end))
        flight.keep.clear()

    def _complete(self, rec: XferRecord) -> None:
        """The copy's event completed: DONE now; stats and the notification in :meth:`_settle`.

        The caller waits for DONE to make the blocks visible; the stats (an event-time query) and above all the
        notification (a ZMQ send: ~20 us when its I/O thread was idle) are not needed for that, so they run on the
        transport's next call (stats, release, post, notifications, flush), or ``SETTLE_AFTER_S`` later on the
        settler thread if no call came: after the caller saw DONE, never before the bytes landed."""
        flight = self._inflight.pop(rec.handle.id)
        rec.t_done = time.perf_counter()
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
                        drv.push_context(self._cu_ctx)
                    try:
                        end = flight.end
                        if end.__class__ is _Event:
                            rc = drv.fast.cuEventQuery(end.handle)  # never blocks; no wrapper frames
                            if rc == 0:
                                self._complete(rec)
                            elif rc != 600:  # CUDA_ERROR_NOT_READY is the only "not yet"
                                drv._check(rc, "cuEventQuery")
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
        t0, t_checked, t_launched, t_end, marks = raw
        out = {"checks": (t_checked - t0) * 1e6, "to_launch": (t_launched - t0) * 1e6,
               "after_launch": (t_end - t_launched) * 1e6}
        if marks and marks[0] == "native" and marks[3][0]:  # C stamps (CLOCK_MONOTONIC, as perf_counter), if any
            _, t_call, t_return, ns = marks
            out["py_before_call"] = (t_call - t0) * 1e6
            out["call_entry"] = ns[0] / 1e3 - t_call * 1e6
            names = native_post.PosterDesc.TRACE_STAGES
            out.update({name: (ns[i + 1] - ns[i]) / 1e3 for i, name in enumerate(names)})
            out["call_exit"] = t_return * 1e6 - ns[len(names)] / 1e3
        elif marks and marks[0] == "python":
            _, t_a, t_b, t_c, t_d, t_e = marks
            out.update({"stage_ids": (t_b - t_a) * 1e6, "order+start": (t_c - t_b) * 1e6,
                        "kernel_launch": (t_d - t_c) * 1e6, "end_record": (t_e - t_d) * 1e6})
        return out

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
        raw = encode_notification(note)
        header = self._header
        try:
            p.dealer.send_multipart([header, raw], flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as exc:
            raise TransportError(f"notification to {peer}: {exc}") from exc

    def send_notification(self, peer: str, note: Notification) -> None:
        with self._lock:
            self._send(peer, note)

    def notifications(self) -> list[tuple[str, Notification]]:
        """Drain the side channel. Malformed messages and messages from a peer's older epoch are counted and
        dropped; each call also completes copies that have finished (so their notifications go out)."""
        zmq = self._zmq
        with self._lock:
            if self._closed:
                return []
            if self._inflight or self._draining or self._settling:
                with self._context():
                    self._progress()
                    self._settle()
            for _ in range(100_000):  # bounded drain
                try:
                    frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                if len(frames) != 3:
                    self.malformed_notifications += 1
                    continue
                try:
                    sender, sender_epoch = _header_decoder.decode(frames[1])
                    note = decode_notification(frames[2])
                except (msgspec.DecodeError, MalformedNotificationError):
                    self.malformed_notifications += 1
                    continue
                known = self._known_epochs.get(sender)
                if known is not None and sender_epoch < known:
                    self.stale_notifications += 1
                    continue
                self._inbox.append((sender, note))
            out = list(self._inbox)
            self._inbox.clear()
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
                with self._context():
                    for start, end in self._event_pool:
                        self._driver.event_destroy(start.handle)
                        self._driver.event_destroy(end.handle)
                    for ev in (self._order_event, self._ids_event):
                        if ev:
                            self._driver.event_destroy(ev)
            else:  # never free what a running kernel may still touch
                log.error("cuda_ipc: copies still running at close; their events and ids are kept")
            self._event_pool.clear()
            self._order_event = self._ids_event = 0
            self._inflight.clear()
            self._draining.clear()
            self._ring = None
            self._handles.live.clear()
            self._router.close(0)
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


def _specs(layout: KVLayout, view: BlockView) -> list[Any]:
    """Per-region :class:`RegionSpec` of ``layout`` under ``view`` (offset, length and split of every block)."""
    from .triton_copy import RegionSpec

    out = []
    for base, block in zip(layout.base_addrs, layout.block_bytes, strict=True):
        length = block - view.offset if view.length == 0 else view.length
        unit = length // view.split
        out.append(RegionSpec(base + view.offset, block, layout.num_blocks, unit, view.split, unit))
    return out


def _subset(copier: Any, pick: np.ndarray) -> Any:
    from .triton_copy import BlockCopier

    return BlockCopier([copier.src[i] for i in pick.tolist()], [copier.dst[i] for i in pick.tolist()], copier.device,
                       chunk_bytes=copier.chunk * copier.word, num_warps=copier.num_warps,
                       region_group=copier.region_group, use_triton=copier.use_triton, cache=copier.cache,
                       inline_ids=copier.inline_ids)


# --- selection ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    """Which path a connection took, why, and what the connect-time self-test measured. ``report`` is the
    :class:`kvlifecycle.transports.select.Selection` handed to the selection listeners (OTel)."""

    backend: str  # "cuda_ipc" or the fallback's name
    reason: str
    measured: dict[str, Any]
    report: Any = None
    probe: ProbeResult | None = None


def cuda_ipc_possible(local: KVLayout, remote: PeerMetadata | None) -> tuple[bool, str]:
    """Cheap checks before any mapping: both sides VRAM, the peer offers cuda_ipc metadata, same node."""
    if local.kind is not MemoryKind.VRAM:
        return False, f"local KV is {local.kind.value}, not VRAM"
    if remote is None or remote.transport != NAME:
        return False, "the peer offers no cuda_ipc metadata"
    if remote.layout.kind != MemoryKind.VRAM.value:
        return False, f"the peer's KV is {remote.layout.kind}, not VRAM"
    try:
        blob = _blob_decoder.decode(remote.blob)
    except msgspec.DecodeError as exc:
        return False, f"malformed cuda_ipc metadata: {exc}"
    if blob.host != node_identity():
        return False, f"the peer is on another node ({blob.host})"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA device here"
    return True, "same node, VRAM on both sides"


def select_same_node(
    local: KVLayout,
    cuda_transport: CudaIpcTransport | None,
    remote_cuda_meta: PeerMetadata | None,
    fallback: Callable[[], Transport],
    *,
    fallback_name: str = "nixl",
) -> tuple[Transport, str, Choice]:
    """Pick the transport for one peer: CUDA IPC when both sides hold VRAM on one node and the connect-time
    self-test (a kernel copy of the peer's probe buffer through the mapping, bytes checked) passes, else
    ``fallback()`` (NIXL). Returns (transport, peer name or "", choice); logs the choice and what it measured and,
    for CUDA IPC, tells :mod:`kvlifecycle.transports.select`'s listeners (the fallback's caller reports its own
    probe through ``select.probe_and_report``). ``cuda_transport`` must be registered already.
    """
    from kvlifecycle.transport import Locality

    from . import select

    ok, reason = cuda_ipc_possible(local, remote_cuda_meta)
    if ok and cuda_transport is None:
        ok, reason = False, "no local cuda_ipc transport"
    if ok:
        assert cuda_transport is not None and remote_cuda_meta is not None
        try:
            peer = cuda_transport.add_peer(remote_cuda_meta)
        except TransportError as exc:
            reason = f"connect-time self-test failed: {exc}"
        else:
            info = cuda_transport.peer_info(peer)
            kernel = "triton" if cuda_transport._uses_triton() else "torch"
            report = select.Selection(NAME, kernel, MemoryKind.VRAM, MemoryKind.VRAM, Locality.SAME_NODE,
                                      f"{reason}; self-test passed")
            probe = ProbeResult(peer, PROBE_BYTES, max(info["self_test_us"], 1e-3) / 1e6, f"{NAME}/{kernel}")
            log.info("transport selected: %s for %s (%s; measured %s)", NAME, peer, reason, info)
            select.on_selected(report, probe)
            return cuda_transport, peer, Choice(NAME, reason, info, report, probe)
    log.info("transport selected: %s (cuda_ipc not used: %s)", fallback_name, reason)
    return fallback(), "", Choice(fallback_name, reason, {})
