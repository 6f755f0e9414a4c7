"""Two GPUs of one process: P's memory on ``--peer-device``, D's kernels reading (a pull) or writing (a push)
across the peer link, and the torch peer copy that is the ceiling there."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any

from .in_process import InProcess
from .shapes import POISON, Shape, gbps, median, pinned_id_sets

# Kernel shapes tried across the peer link (--sweep with --peer-device): a read over NVLink waits longer than one
# from the GPU's own memory, so more bytes per program might pay there (on the H200 pair they all move at the
# link's rate: docs/benchmarks/2026-11-29-gpu-two-gpus.md).
PEER_VARIANTS = ((4096, 4), (8192, 4), (8192, 8), (16384, 4), (16384, 8), (32768, 8), (2048, 2), (4096, 8))


def _enable_peer_access(peer_device: int) -> None:
    """Let kernels of the current context read and write ``peer_device``'s memory (what IPC's lazy peer access does
    for mapped allocations, here for this process's own tensors on the other GPU)."""
    lib = ctypes.CDLL("libcuda.so.1")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    for rc, what in ((lib.cuDeviceGet(ctypes.byref(dev), peer_device), "cuDeviceGet"),
                     (lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")):
        if rc:
            raise RuntimeError(f"{what} failed ({rc})")
    rc = lib.cuCtxEnablePeerAccess(ctx, 0)
    if rc not in (0, 704):  # 704: CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
        raise RuntimeError(f"cuCtxEnablePeerAccess({peer_device}) failed ({rc})")


def bench_peer_kernels(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], peer_device: int) -> dict[str, Any]:
    """The block-copy kernel, run on this GPU, reading its source from ``peer_device`` (a pull) or writing its
    destination there (a push), for each of :data:`PEER_VARIANTS`, and pulling with the ids read in place from
    pinned host memory (no id copy; ``G``: regions per program): CUDA events, byte-checked."""
    from .fastpath import BlockCopier, RegionSpec

    _enable_peer_access(peer_device)
    peer = torch.device("cuda", peer_device)
    regions = shape.regions
    peer_src = ip.src[:regions].to(peer)  # the same bytes as ip.src, on the other GPU
    peer_dst = torch.full_like(peer_src, POISON)
    dev_sets = [(torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device)) for s, d in sets]
    host_sets = pinned_id_sets(torch, sets)
    stream = torch.cuda.current_stream(ip.device).cuda_stream
    src_ids, dst_ids = sets[-1]
    out: dict[str, Any] = {}
    for direction, src_t, dst_t in (("pull", peer_src, ip.dst), ("push", ip.src, peer_dst)):
        specs_src = [RegionSpec.of_tensor(src_t[r]) for r in range(regions)]
        specs_dst = [RegionSpec.of_tensor(dst_t[r]) for r in range(regions)]
        d_idx = torch.from_numpy(dst_ids).to(dst_t.device).long()
        s_idx = torch.from_numpy(src_ids).to(ip.device).long()
        rows = out[direction] = {}
        variants = [(c, w, 1, False) for c, w in PEER_VARIANTS]
        if direction == "pull":
            variants += [(4096, 4, g, True) for g in (1, 8)]
        for chunk, warps, group, host in variants:
            copier = BlockCopier(specs_src, specs_dst, ip.device, chunk_bytes=chunk, num_warps=warps,
                                 region_group=group)
            copier.copy(*dev_sets[0])  # Triton's JIT once: later launches are direct
            # fn is called with one of args' sets: (host ids, pad) for a direct launch, (src ids, dst ids) for copy
            fn: Callable[..., None]
            args: list[Any]
            if host:
                def launch(h: Any, pad: int, copier: Any = copier) -> None:
                    if not copier.launch_ptrs(stream, h.data_ptr(), h.data_ptr() + 4 * pad, shape.blocks):
                        raise RuntimeError("direct launch unavailable")
                fn, args = launch, host_sets
            else:
                fn, args = copier.copy, dev_sets
            ev = median(ip.time_events(fn, args))
            dst_t[:regions, d_idx] = POISON
            torch.cuda.synchronize(dst_t.device)  # the poison runs on that GPU's stream: done before the copy
            fn(*args[-1])
            torch.cuda.synchronize(ip.device)
            exact = bool(torch.equal(dst_t[:regions, d_idx].to(ip.device), ip.src[:regions, s_idx]))
            key = f"{chunk}B/{warps}w" + (f"/G{group}/host-ids" if host else "")
            rows[key] = {"event_s": ev, "gbps": gbps(shape.nbytes, ev), "exact": exact}
    del peer_src, peer_dst
    torch.cuda.empty_cache()
    return out


def peer_ceiling(torch: Any, ip: InProcess, nbytes: int, peer_device: int, reps: int = 10) -> tuple[float, float]:
    """Median time of a contiguous copy of ``nbytes`` from ``peer_device`` into this device: CUDA events, and wall
    (launch to its event seen, in a hot loop: how the one-GPU ceiling is timed)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=torch.device("cuda", peer_device))
    dst = ip.dst.view(-1)[:nbytes]
    sets = [()] * reps
    return (median(ip.time_events(lambda: dst.copy_(src), sets)),
            median(ip.time_wall(lambda: dst.copy_(src), sets)))
