"""The staging copy of a KV cache in VRAM into P's host pool, on a CUDA stream.

:class:`CudaStagingCopy` writes a staged lease's blocks straight from the GPU into their slots of the pinned host
pool: the pool's buffers are page-locked and mapped into the device's address space (``cudaHostRegister``), so
one gather launch of the CUDA IPC transport's block-copy kernel (:class:`BlockCopier`, one program per chunk of
one block of one region) moves every region's blocks over PCIe, whatever order the slots are in. The launch goes on
a stream of its own, ordered after the work already enqueued on the device's current stream by an event, so the
copy never reads a layer before the prefill wrote it; the Producer's service step only enqueues it and later
queries its completion event (never waits, and never on the engine's scheduler thread).

:class:`~kvlifecycle.handoff.staging_tier.StagingTier` takes it as its ``copier``: the pool's NIXL agent then
serves D's reads (and pushes) as before, while the copy into the pool is this kernel instead of a NIXL READ. A
copy on the device cannot be cancelled (``cancels_in_flight = False``): a released one runs to its end, and
:meth:`close` waits for it (bounded) before the pool may be unregistered. ``bench/staging_copy.py`` measures it
against a plain ``copy_`` to pinned memory.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvlifecycle.transport import (
    KVLayout,
    MemoryKind,
    TransferHandle,
    TransportError,
    XferOp,
    XferStatus,
)

from .cuda_ipc.triton_copy import BlockCopier, RegionSpec
from .host_pool import HostPool

CLOSE_WAIT_S = 10.0  # bound on waiting for copies still running at close


class CudaStagingCopy:
    """Copies a VRAM KV cache's blocks into ``pool``'s slots with one gather kernel per block size."""

    name = "cuda_staging"
    cancels_in_flight = False  # a launched kernel runs to its end

    def __init__(self, kv: KVLayout, pool: HostPool) -> None:
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise TransportError("the CUDA staging copy needs torch") from exc
        if kv.kind is not MemoryKind.VRAM or not torch.cuda.is_available():
            raise TransportError("the CUDA staging copy reads a KV cache in VRAM on a CUDA device")
        if pool.kv.block_bytes != kv.block_bytes:
            raise TransportError("the host pool is not laid out like this KV cache")
        self._torch = torch
        self.device = torch.device("cuda", kv.device_id)
        self.pool = pool
        self._registered: list[int] = []
        cudart = torch.cuda.cudart()
        for base, size in zip(pool.layout.base_addrs, pool.layout.block_bytes, strict=True):
            nbytes = size * pool.slots
            # portable | mapped: page-locked for every context, and (UVA) addressable by kernels at the same address
            rc = cudart.cudaHostRegister(base, nbytes, 3)
            if int(rc) != 0:
                self._unregister()
                raise TransportError(f"cudaHostRegister of {nbytes} B of the host pool failed: error {int(rc)}")
            self._registered.append(base)
        # one copier per block size: each copier launch covers every region of that size
        by_size: dict[int, list[int]] = {}
        for r, size in enumerate(kv.block_bytes):
            by_size.setdefault(size, []).append(r)
        self._copiers = [
            BlockCopier([RegionSpec(kv.base_addrs[r], size, kv.num_blocks, size) for r in regions],
                        [RegionSpec(pool.layout.base_addrs[r], size, pool.slots, size) for r in regions],
                        self.device)
            for size, regions in by_size.items()]
        self._stream = torch.cuda.Stream(self.device)
        self._copies: dict[int, tuple[Any, tuple[Any, ...]]] = {}  # handle id -> (end event, what the kernel reads)
        self._released: list[tuple[Any, tuple[Any, ...]]] = []  # released while running: kept until they end
        self._ids = 0

    def post(self, op: XferOp, plan: None, local_blocks: Any, remote_blocks: Any, *,
             transfer: str = "", notification: object = None) -> TransferHandle:
        """Copy KV blocks ``remote_blocks`` into pool slots ``local_blocks`` (a READ, as the NIXL path posts it)."""
        if XferOp(op) is not XferOp.READ or notification is not None:
            raise TransportError("the staging copy only reads the KV cache into the pool, without a notification")
        torch = self._torch
        slots = np.ascontiguousarray(local_blocks, dtype=np.int32)
        blocks = np.ascontiguousarray(remote_blocks, dtype=np.int32)
        for copier in self._copiers:
            copier.check_ids(blocks, slots)
        with torch.cuda.device(self.device):
            src = torch.from_numpy(blocks).to(self.device)
            dst = torch.from_numpy(slots).to(self.device)
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))  # the prefill's writes enqueued so far
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(produced)
                for copier in self._copiers:
                    copier.copy(src, dst)
                end = torch.cuda.Event()
                end.record(self._stream)
        self._ids += 1
        self._copies[self._ids] = (end, (src, dst))
        return TransferHandle(self._ids, XferOp.READ, "", 0, transfer)

    def poll(self, handle: TransferHandle) -> XferStatus:
        copy = self._copies.get(handle.id)
        if copy is None:
            raise TransportError(f"unknown or released staging copy {handle.id}")
        return XferStatus.DONE if copy[0].query() else XferStatus.PENDING

    def error(self, _handle: TransferHandle) -> TransportError | None:
        return None  # a launch that fails raises at post; a launched copy completes

    def release(self, handle: TransferHandle) -> None:
        """Forget a copy; one still running is kept until its event fires (it cannot be stopped)."""
        copy = self._copies.pop(handle.id, None)
        if copy is not None and not copy[0].query():
            self._released.append(copy)
        self._released = [c for c in self._released if not c[0].query()]

    def close(self) -> None:
        """Wait (bounded) for every copy still running, then unpin the pool."""
        running = [c for c in (*self._copies.values(), *self._released) if not c[0].query()]
        deadline = time.monotonic() + CLOSE_WAIT_S
        while running and time.monotonic() < deadline:
            time.sleep(1e-3)
            running = [c for c in running if not c[0].query()]
        self._copies.clear()
        self._released.clear()
        if not running:  # never unpin memory a running kernel writes
            self._unregister()

    def _unregister(self) -> None:
        cudart = self._torch.cuda.cudart()
        for base in self._registered:
            cudart.cudaHostUnregister(base)
        self._registered.clear()
