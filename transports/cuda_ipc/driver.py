"""The few CUDA driver calls CUDA IPC needs, through ctypes (no extra dependency): export and map allocations,
contexts, events, streams, peer access.

The hot path (post / poll) talks to the driver directly: torch's stream and event wrappers cost more
(device-index normalisation, context managers) than the copy of a small request.
"""

from __future__ import annotations

import ctypes

from kvlifecycle.transport import BackendUnavailableError, RemoteMismatchError, TransportError

_IPC_LAZY_ENABLE_PEER_ACCESS = 1
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED = 704


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

    def check(self, rc: int, what: str) -> None:
        """Raise :class:`TransportError` naming ``what`` and the driver's error name unless ``rc`` is success."""
        if rc != 0:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(rc, ctypes.byref(name))
            raise TransportError(f"{what} failed: {(name.value or b'?').decode()} ({rc})")

    def address_range(self, ptr: int) -> tuple[int, int]:
        """(allocation base, allocation size) of the allocation holding ``ptr``."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ptr),
                    f"cuMemGetAddressRange({ptr:#x})")
        return base.value, size.value

    def export(self, base: int) -> bytes:
        handle = _IpcHandle()
        self.check(self.lib.cuIpcGetMemHandle(ctypes.byref(handle), base), f"cuIpcGetMemHandle({base:#x})")
        return ctypes.string_at(ctypes.addressof(handle), 64)  # all 64 bytes: a c_char field stops at NUL

    def open(self, raw: bytes) -> int:
        if len(raw) != 64:
            raise RemoteMismatchError(f"an IPC handle is 64 bytes, got {len(raw)}")
        handle = _IpcHandle()
        ctypes.memmove(ctypes.addressof(handle), raw, 64)
        ptr = ctypes.c_uint64()
        self.check(self.lib.cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, _IPC_LAZY_ENABLE_PEER_ACCESS),
                    "cuIpcOpenMemHandle")
        return ptr.value

    def close(self, ptr: int) -> None:
        self.check(self.lib.cuIpcCloseMemHandle(ptr), f"cuIpcCloseMemHandle({ptr:#x})")

    # The hot path (post / poll) talks to the driver directly: torch's stream and event wrappers cost more
    # (device-index normalisation, context managers) than the copy of a small request.
    def current_context(self) -> int:
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
        return ctx.value or 0

    def push_context(self, ctx: int) -> None:
        self.check(self.lib.cuCtxPushCurrent_v2(ctx), "cuCtxPushCurrent")

    def pop_context(self) -> None:
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctx)), "cuCtxPopCurrent")

    def event_create(self, timing: bool) -> int:
        ev = ctypes.c_void_p()
        self.check(self.lib.cuEventCreate(ctypes.byref(ev), 0 if timing else 2), "cuEventCreate")
        return ev.value or 0

    def event_destroy(self, ev: int) -> None:
        self.lib.cuEventDestroy_v2(ev)

    def event_record(self, ev: int, stream: int) -> None:
        self.check(self.lib.cuEventRecord(ev, stream), "cuEventRecord")

    def event_done(self, ev: int) -> bool:
        rc = self.fast.cuEventQuery(ev)
        if rc == CUDA_ERROR_NOT_READY:
            return False
        self.check(rc, "cuEventQuery")
        return True

    def elapsed_ms(self, start: int, end: int) -> float:
        ms = ctypes.c_float()
        self.check(self.lib.cuEventElapsedTime(ctypes.byref(ms), start, end), "cuEventElapsedTime")
        return float(ms.value)

    def stream_wait(self, stream: int, ev: int) -> None:
        self.check(self.lib.cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")

    def device_pointer(self, host_ptr: int) -> int:
        """The device address of pinned host memory (0 if the device cannot address it)."""
        out = ctypes.c_uint64()
        rc = self.lib.cuPointerGetAttribute(ctypes.byref(out), 3, host_ptr)  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER
        return out.value if rc == 0 else 0

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.check(self.lib.cuMemcpyHtoDAsync_v2(dst, src, nbytes, stream), "cuMemcpyHtoDAsync")

    def enable_peer_access(self, device: int, peer: int) -> None:
        """Let the current context (``device``'s) reach ``peer``'s memory directly: what ``cuIpcOpenMemHandle``'s
        lazy peer access does for another process's allocations, for this process's own. Raises
        :class:`RemoteMismatchError` where the two devices cannot reach each other."""
        lib, can = self.lib, ctypes.c_int()
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self.check(lib.cuDeviceGet(ctypes.byref(dev), peer), f"cuDeviceGet({peer})")
        own = ctypes.c_int()
        self.check(lib.cuDeviceGet(ctypes.byref(own), device), f"cuDeviceGet({device})")
        self.check(lib.cuDeviceCanAccessPeer(ctypes.byref(can), own, dev), "cuDeviceCanAccessPeer")
        if not can.value:
            raise RemoteMismatchError(f"GPU {device} cannot access GPU {peer}'s memory (no peer access)")
        # The peer's primary context is alive (its memory was allocated in this process): retain it only to name it.
        self.check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        try:
            rc = lib.cuCtxEnablePeerAccess(ctx, 0)
            if rc != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED:
                self.check(rc, f"cuCtxEnablePeerAccess(GPU {device} -> GPU {peer})")
        finally:
            lib.cuDevicePrimaryCtxRelease_v2(dev)


class DriverEvent:
    """A driver event (timing on); ``query`` never blocks."""

    __slots__ = ("driver", "handle")

    def __init__(self, driver: CudaDriver, handle: int) -> None:
        self.driver, self.handle = driver, handle

    def query(self) -> bool:
        return self.driver.event_done(self.handle)

