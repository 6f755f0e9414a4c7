"""How a post reaches the GPU: the resources it needs (:class:`PostStreams`) and the two strategies that use them.

- :class:`CompiledPost`: one call into ``_native_post.c`` checks and stages the ids (or passes up to
  ``INLINE_IDS`` of them as launch parameters), orders the streams, launches every group's kernel and records the
  events. Taken once every copier of the launch is warm and bound, where the C file builds and the installed Triton
  is one its launcher binding was checked on (``native_post.CHECKED_TRITON_VERSIONS``).
- :class:`PythonPost`: the same steps with one ctypes call each, the ids staged through the ring on the copy stream
  behind running copies (or on the transfer's own stream when nothing runs), or read by the kernel straight from
  pinned host memory (``host_ids``). The fallback of the compiled post, the path until kernels are warm, and where
  a bad id list gets its precise error.

Host time before the kernel launch adds to every request's latency; host time after it overlaps the copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle.transport import Notification, PreparedPlan, TransportError, XferOp

from . import native_post
from .driver import CudaDriver, DriverEvent
from .ids import ID_RING_INTS, IdRing
from .plans import Launch
from .triton_copy import BlockCopier

# The CUDA contexts of every transport registered in this process. While there is one, a thread that once had it
# current keeps it (there is no other to switch to), so a transport may remember that per thread; with two (P and
# D on two GPUs of one process) a thread's current context follows torch's current device, so it is checked on
# every call that needs it.
CONTEXTS_SEEN: set[int] = set()


@dataclass(slots=True)
class Inflight:
    start: Any  # DriverEvent (timing)
    end: Any  # DriverEvent: the completion handle
    slot: int | None  # ring slot of the ids, freed when the copy completed
    keep: list[Any]  # ids staged outside the ring, alive until the copy finished
    notify: tuple[str, Notification] | None = None
    t_launched: float = 0.0  # host clock right after the last kernel launch call returned
    shared: list[int] | None = None  # post_batch: [handles still holding this launch's id slot and events]


class PostStreams:
    """One registered transport's CUDA resources for posting: its context, its transfer and copy streams, the
    ordering events, the id ring and a pool of completion events. Built inside ``torch.cuda.device(device)``."""

    def __init__(self, torch: Any, driver: CudaDriver, device: Any, stream: Any, *, trace: bool) -> None:
        self.torch, self.driver, self.device = torch, driver, device
        self.dev_index = device.index
        self.stream = stream  # torch.cuda.Stream: the transfer's own
        self.cu_stream = stream.cuda_stream
        self.copy_stream = torch.cuda.Stream(device)  # ids move here while an earlier copy runs
        self.cu_copy = self.copy_stream.cuda_stream
        self.cu_ctx = driver.current_context()
        CONTEXTS_SEEN.add(self.cu_ctx)
        self.order_event = driver.event_create(timing=False)
        self.ids_event = driver.event_create(timing=False)
        self.ring = IdRing(torch, device, ID_RING_INTS, driver)
        self.event_pool: list[tuple[DriverEvent, DriverEvent]] = []
        self.trace = trace
        self.stage_marks: tuple[Any, ...] = ()  # the last traced post's raw stamps (see stage_times)
        self.current_stream = torch._C._cuda_getCurrentRawStream  # the caller's stream, as a raw handle
        # post_after: the copy is ordered after this stream, which first waits on the caller's event (the compiled
        # and Python posts both take a stream to order after, so the event goes through one)
        self.after_stream = torch.cuda.Stream(device)
        self.cu_after = self.after_stream.cuda_stream
        # Threads seen with this context current: their later calls skip the check (a thread that switches context
        # afterwards gets a loud driver error, never a silent wrong copy).
        self._ctx_ok = threading.local()

    def events(self) -> tuple[DriverEvent, DriverEvent]:
        """A (start, end) pair of timing events, from the pool when one is free."""
        if self.event_pool:
            return self.event_pool.pop()
        drv = self.driver
        return DriverEvent(drv, drv.event_create(timing=True)), DriverEvent(drv, drv.event_create(timing=True))

    def order_after(self, after: object) -> int:
        """The raw stream a post orders after so that its copy starts once ``after`` fired: a recorded
        ``torch.cuda.Event`` or a raw ``CUevent``. Every later post after an event also starts after this one (a
        caller's events from one compute stream come in that order anyway)."""
        raw = after if isinstance(after, int) else getattr(after, "cuda_event", None)
        if not isinstance(raw, int) or raw <= 0:
            raise TransportError(f"post_after needs a recorded CUDA event, got {type(after).__name__} ({raw!r})")
        with self.context():
            self.driver.stream_wait(self.cu_after, raw)
        return int(self.cu_after)

    def need_context(self) -> bool:
        """Whether this thread must push the transport's context for driver calls (checked once per thread while
        the process has one context; on every call once it has two)."""
        if not self.cu_ctx or (getattr(self._ctx_ok, "ok", False) and len(CONTEXTS_SEEN) == 1):
            return False
        if self.driver.current_context() == self.cu_ctx:
            self._ctx_ok.ok = True
            return False
        return True

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Make this transport's CUDA context current for driver calls (a service thread may have none)."""
        drv = self.driver
        pushed = self.need_context()
        if pushed:
            drv.push_context(self.cu_ctx)
        try:
            yield
        finally:
            if pushed:
                drv.pop_context()

    def destroy_events(self) -> None:
        """Destroy every pooled and ordering event (at close, once no copy runs)."""
        with self.context():
            for start, end in self.event_pool:
                self.driver.event_destroy(start.handle)
                self.driver.event_destroy(end.handle)
            for ev in (self.order_event, self.ids_event):
                if ev:
                    self.driver.event_destroy(ev)
        self.event_pool.clear()
        self.order_event = self.ids_event = 0


class PythonPost:
    """The post of checked ids in Python (see the module docstring)."""

    def __init__(self, res: PostStreams, *, host_ids: bool) -> None:
        self.res = res
        self.host_ids = host_ids

    def launch(self, op: XferOp, launch: Launch, local: np.ndarray, remote: np.ndarray, n: int,
               notify: tuple[str, Notification] | None, busy: bool, caller: int = 0) -> Inflight:
        """Launch ``launch``'s copiers for ``op`` over ``n`` checked id pairs; ``busy``: copies are in flight;
        ``caller``: the raw stream to order after (0: the calling thread's current stream)."""
        copiers = launch.read if op is XferOp.READ else launch.write
        if n == 0 or not copiers:
            return Inflight(None, None, None, [], notify)
        src, dst = (remote, local) if op is XferOp.READ else (local, remote)
        res = self.res
        pushed = res.need_context()  # a service thread may have no context current
        if pushed:
            res.driver.push_context(res.cu_ctx)
        try:
            start, end = res.events()
            t_a = time.perf_counter()
            pad = -(-n // 4) * 4  # both id lists 16-byte aligned: one kernel specialisation whatever n is
            slot = res.ring.reserve(2 * pad)
            try:
                return self._stage_and_launch(copiers, src, dst, n, notify, start, end, pad, slot, t_a, busy,
                                              caller)
            except BaseException:
                if slot is not None:
                    res.ring.free(slot)  # a step failed before its kernel was enqueued (later: the context is gone)
                res.event_pool.append((start, end))
                raise
        finally:
            if pushed:
                res.driver.pop_context()

    def _stage_and_launch(self, copiers: list[BlockCopier], src: np.ndarray, dst: np.ndarray, n: int,
                          notify: tuple[str, Notification] | None, start: DriverEvent, end: DriverEvent, pad: int,
                          slot: int | None, t_a: float, busy: bool, caller: int) -> Inflight:
        """Stage the ids (one async copy from the pinned ring), order after the caller's stream, launch every
        group's copy, record the completion event. Driver calls go straight to libcuda (no wrapper frames); a
        non-zero result is turned into an error by the checked wrapper."""
        res = self.res
        drv, stream, ring = res.driver, res.cu_stream, res.ring
        lib = drv.fast
        keep: list[Any] = []
        ids_copied = False
        if slot is not None:
            host = ring.host_np
            host[slot:slot + n] = src
            host[slot + pad:slot + pad + n] = dst
            if self.host_ids and ring.host_dev_ptr and all(c.warm for c in copiers):
                src_ptr = ring.host_dev_ptr + 4 * slot  # the kernel reads the ids where the host wrote them
            elif busy:
                # On the copy stream: the ids move while an earlier transfer's kernel still runs, so back-to-back
                # transfers leave no copy-engine gap between their kernels.
                src_ptr = ring.dev_ptr + 4 * slot
                rc = lib.cuMemcpyHtoDAsync_v2(src_ptr, ring.host_ptr + 4 * slot, 8 * pad, res.cu_copy)
                if rc:
                    drv.check(rc, "cuMemcpyHtoDAsync")
                rc = lib.cuEventRecord(res.ids_event, res.cu_copy)
                if rc:
                    drv.check(rc, "cuEventRecord(ids)")
                ids_copied = True
            else:
                # Nothing in flight: no kernel to overlap with, so the ids go on the transfer's own stream (two
                # driver calls fewer on a lone request's latency path: no event, no cross-stream wait).
                src_ptr = ring.dev_ptr + 4 * slot
                rc = lib.cuMemcpyHtoDAsync_v2(src_ptr, ring.host_ptr + 4 * slot, 8 * pad, stream)
                if rc:
                    drv.check(rc, "cuMemcpyHtoDAsync")
        else:  # ring full of in-flight ids: stage this post on its own (pinned, tracked by torch)
            torch = res.torch
            host_t = torch.empty(2 * pad, dtype=torch.int32, pin_memory=True)
            host_t.numpy()[:n], host_t.numpy()[pad:pad + n] = src, dst
            with torch.cuda.stream(res.stream):
                dev_ids = host_t.to(res.device, non_blocking=True)
            keep = [host_t, dev_ids]
            src_ptr = dev_ids.data_ptr()
        t_b = time.perf_counter()
        # Blocks may have been written (P) or last read (D) on the caller's current stream: order after it.
        rc = lib.cuEventRecord(res.order_event, caller or res.current_stream(res.dev_index))
        if rc:
            drv.check(rc, "cuEventRecord(order)")
        rc = lib.cuStreamWaitEvent(stream, res.order_event, 0)
        if rc:
            drv.check(rc, "cuStreamWaitEvent(order)")
        if ids_copied:
            rc = lib.cuStreamWaitEvent(stream, res.ids_event, 0)
            if rc:
                drv.check(rc, "cuStreamWaitEvent(ids)")
        rc = lib.cuEventRecord(start.handle, stream)
        if rc:
            drv.check(rc, "cuEventRecord(start)")
        t_c = time.perf_counter()
        dst_ptr = src_ptr + 4 * pad
        for copier in copiers:
            if not copier.launch_ptrs(stream, src_ptr, dst_ptr, n):
                ids = ring.dev[slot:slot + 2 * pad] if slot is not None else keep[1]  # first launch: Triton's JIT
                if slot is not None and src_ptr != ring.dev_ptr + 4 * slot:
                    drv.memcpy_htod_async(ring.dev_ptr + 4 * slot, ring.host_ptr + 4 * slot, 8 * pad, stream)
                copier.launch(res.stream, ids[:n], ids[pad:pad + n])
        t_d = time.perf_counter()
        rc = lib.cuEventRecord(end.handle, stream)
        if rc:
            drv.check(rc, "cuEventRecord(end)")
        if res.trace:
            res.stage_marks = ("python", t_a, t_b, t_c, t_d, time.perf_counter())
        return Inflight(start, end, slot, keep, notify, t_d)


class CompiledPost:
    """The compiled post (see the module docstring): its library and this transport's streams, events and staging
    described to it as one C structure, plus the pageable int64 array numpy widens the caller's ids into."""

    def __init__(self, res: PostStreams, lib: ctypes.CDLL, *, inline_ids: bool) -> None:
        self.res, self.lib, self.inline_ids = res, lib, inline_ids
        ring = res.ring
        self.staging = np.zeros(ring.capacity, dtype=np.int64)
        poster = native_post.PosterDesc()
        poster.stream, poster.copy_stream = res.cu_stream, res.cu_copy
        poster.order_event, poster.ids_event = res.order_event, res.ids_event
        poster.staging = self.staging.ctypes.data
        poster.ring_host, poster.ring_dev = ring.host_ptr, ring.dev_ptr
        poster.trace = 1 if res.trace else 0
        self.poster = poster
        self.poster_addr = ctypes.addressof(poster)
        self.args = poster.call_args()  # PosterDesc.CALL_FIELDS, written in place: the call takes one pointer
        self.call = lib.kvl_post_call
        self._args_kernels: Any = None  # the kernels and id limits the argument fields were last written for
        self._args_limits = (-1, -1)

    def kernels_for(self, launch: Launch, op: XferOp, n: int) -> Any:
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
        if kernels is not None:
            return kernels
        kernels = self._kernel_list(launch, op, "native")
        if op is XferOp.READ:
            launch.native_read = kernels
        else:
            launch.native_write = kernels
        return kernels

    @staticmethod
    def _kernel_list(launch: Launch, op: XferOp, attr: str) -> Any:
        """A ``KernelList`` of every copier's bound kernel ``attr``; None until all are warm and bound."""
        copiers = launch.read if op is XferOp.READ else launch.write
        descs = [d for d in (getattr(c, attr, None) for c in copiers) if d is not None]
        if not copiers or len(copiers) > native_post.MAX_KERNELS or len(descs) < len(copiers):
            return None
        return native_post.KernelList(descs)

    def post(self, kernels: Any, op: XferOp, plan: PreparedPlan, local: np.ndarray, remote: np.ndarray, n: int,
             notify: tuple[str, Notification] | None, busy: bool, caller: int = 0) -> Inflight | None:
        """One call into the compiled post: ids checked and staged, streams ordered (after ``caller``, a raw
        stream, or the calling thread's current stream for 0), kernels launched, events recorded. None (nothing
        enqueued) when the id ring has no room, or an id is out of range: the Python path then stages the post on
        its own, or raises the precise error."""
        res = self.res
        ring, staging = res.ring, self.staging
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
        drv = res.driver
        start, end = res.events()
        pushed = res.need_context()  # a service thread may have no context current
        if pushed:
            drv.push_context(res.cu_ctx)
        args = self.args
        if kernels is not self._args_kernels or src_limit != self._args_limits[0] or dst_limit != self._args_limits[1]:
            args[0] = kernels.address  # what stays the same from one post of a plan to the next: written once
            args[1] = kernels.count
            args[5] = src_limit
            args[6] = dst_limit
            self._args_kernels, self._args_limits = kernels, (src_limit, dst_limit)
        args[2] = slot or 0
        args[3] = n
        args[4] = pad
        args[7] = caller or res.current_stream(res.dev_index)
        args[8] = start.handle
        args[9] = end.handle
        args[10] = 1 if busy else 0
        t_call = time.perf_counter()
        try:
            rc = self.call(self.poster_addr)
        finally:
            if pushed:
                drv.pop_context()
        t_launched = time.perf_counter()
        if rc:
            if slot is not None:
                ring.free(slot)
            res.event_pool.append((start, end))
            if rc in (native_post.ERR_SRC_RANGE, native_post.ERR_DST_RANGE):
                return None
            if rc < 0:
                raise TransportError(f"compiled post refused its arguments ({rc})")
            drv.check(rc, native_post.STEPS.get(self.poster.error_step, "compiled post"))
        if res.trace:  # the C side's own stamps (copied: the next post overwrites them), for stage_times()
            res.stage_marks = ("native", t_call, t_launched, tuple(self.poster.trace_ns))
            self.poster.trace = 1  # tracing turned on after registration: stamps from the next post on
        return Inflight(start, end, slot, [], notify, t_launched)


def stage_times(raw: tuple[Any, ...]) -> dict[str, float]:
    """Where a traced post's host time went, in µs, from the raw stamps ``post`` kept (built here, off every
    latency path)."""
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
