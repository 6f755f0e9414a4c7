"""The in-process paths, all on D's device: (d) the contiguous copy (the ceiling), (c) torch's index_select +
index_copy_, and the batched block-copy kernel alone, each CUDA-event and wall timed and byte-checked."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .shapes import POISON, Shape, busy, gbps, median, pinned_id_sets, spin


class InProcess:
    """Source and destination pools of ``shape.regions x pool`` blocks on one device, and the two timers."""

    def __init__(self, torch: Any, device: Any, shape: Shape, pool: int, seed: int) -> None:
        self.torch, self.device, self.pool = torch, device, pool
        self.regions, self.block_bytes = shape.regions, shape.block_bytes
        gen = torch.Generator(device=device).manual_seed(seed)
        self.src = torch.randint(0, 256, (shape.regions, pool, shape.block_bytes), dtype=torch.uint8, device=device,
                                 generator=gen)
        self.dst = torch.full_like(self.src, POISON)
        self.stream = torch.cuda.current_stream(device)

    def poison(self, dst_ids: np.ndarray) -> None:
        self.dst[:, self.torch.from_numpy(dst_ids).to(self.device).long()] = POISON

    def check(self, src_ids: np.ndarray, dst_ids: np.ndarray) -> bool:
        torch = self.torch
        s = torch.from_numpy(src_ids).to(self.device).long()
        d = torch.from_numpy(dst_ids).to(self.device).long()
        return bool(torch.equal(self.dst[:, d], self.src[:, s]))

    def time_events(self, fn: Any, sets: list[Any], warmup: int = 3, busy_cycles: int = 200_000) -> list[float]:
        torch = self.torch
        for i in range(warmup):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize(self.device)
        out = []
        for args in sets:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            busy(torch, busy_cycles)  # keep the GPU busy while Python launches: the events time the device work alone
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    def time_host(self, fn: Any, sets: list[Any], busy_cycles: int = 20_000_000) -> list[float]:
        """What each call costs the calling thread (launches, uploads): timed while a ~10 ms GPU spin runs ahead, so
        no launch waits on the device."""
        torch = self.torch
        out = []
        for args in sets:
            torch.cuda.synchronize(self.device)
            busy(torch, busy_cycles)
            t0 = time.perf_counter()
            fn(*args)
            out.append(time.perf_counter() - t0)
        torch.cuda.synchronize(self.device)
        return out

    def time_wall(self, fn: Any, sets: list[Any]) -> list[float]:
        torch = self.torch
        out = []
        for args in sets:
            torch.cuda.synchronize(self.device)
            end = torch.cuda.Event()
            t0 = time.perf_counter()
            fn(*args)
            end.record()
            spin(end)
            out.append(time.perf_counter() - t0)
        return out


def bench_in_process(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], sweep: bool,
                     pipeline: int) -> dict[str, Any]:
    out = _ceiling(torch, ip, shape, len(sets), pipeline)
    dev_sets = [(torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device)) for s, d in sets]
    out |= _torch_index(ip, sets, dev_sets)
    out |= _kernels(torch, ip, shape, sets, dev_sets, sweep)
    return out


def _ceiling(torch: Any, ip: InProcess, shape: Shape, n_sets: int, pipeline: int) -> dict[str, Any]:
    """(d): one contiguous copy of the request's bytes, at offsets that change every repetition."""
    out: dict[str, Any] = {}
    nbytes = shape.nbytes
    flat_src = ip.src.view(-1)
    flat_dst = ip.dst.view(-1)
    span = flat_src.numel() - nbytes
    offsets = [(i * 7919 * 4096) % max(span, 1) // 4096 * 4096 for i in range(n_sets)]

    def ceiling(off: int) -> None:
        flat_dst[off:off + nbytes].copy_(flat_src[off:off + nbytes])

    out["ceiling_event_s"] = median(ip.time_events(ceiling, [(o,) for o in offsets]))
    out["ceiling_wall_s"] = median(ip.time_wall(ceiling, [(o,) for o in offsets]))

    def ceiling_back_to_back(_: int) -> None:
        for k in range(pipeline):
            ceiling(offsets[k % len(offsets)])

    out["ceiling_pipelined_wall_s"] = median(ip.time_wall(ceiling_back_to_back, [(o,) for o in offsets[:5]]))
    ip.dst.fill_(POISON)
    ceiling(0)
    out["ceiling_exact"] = bool(torch.equal(flat_dst[:nbytes], flat_src[:nbytes]))
    return out


def _torch_index(ip: InProcess, sets: list[Any], dev_sets: list[Any]) -> dict[str, Any]:
    """(c): torch's own gather and scatter over the stacked ``[regions, blocks, bytes]`` pools."""
    out: dict[str, Any] = {}
    long_sets = [(s.long(), d.long()) for s, d in dev_sets]

    def torch_index(s: Any, d: Any) -> None:
        ip.dst.index_copy_(1, d, ip.src.index_select(1, s))

    out["torch_event_s"] = median(ip.time_events(torch_index, long_sets))
    out["torch_wall_s"] = median(ip.time_wall(torch_index, long_sets))
    ip.poison(sets[0][1])
    torch_index(*long_sets[0])
    out["torch_exact"] = ip.check(*sets[0])
    return out


def kernel_variants(sweep: bool) -> list[tuple[Any, ...]]:
    """(chunk bytes, warps, regions per program, ids in pinned host memory[, cache hint]): the first is the
    transport's default, the second its host-ids launch; ``sweep`` adds the shapes tried around them."""
    from . import fastpath

    variants: list[tuple[Any, ...]] = [
        (fastpath.DEFAULT_CHUNK_BYTES, fastpath.DEFAULT_NUM_WARPS, 1, False),
        (fastpath.DEFAULT_CHUNK_BYTES, fastpath.DEFAULT_NUM_WARPS, fastpath.REGION_GROUP_HOST_IDS, True)]
    if sweep:
        variants += [(4096, 4, g, h) for g in (1, 2, 4, 8, 16) for h in (False, True)]
        variants += [(c, w, 1, False) for c in (2048, 8192, 16384, 32768) for w in (2, 4, 8)]
        variants = list(dict.fromkeys(variants))
        for c, w in ((4096, 4), (2048, 2), (8192, 4)):  # cache hints: 0 none, 2 streaming stores only
            variants += [(c, w, 1, False, cache) for cache in (0, 2)]
    return variants


def _kernels(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], dev_sets: list[Any],
             sweep: bool) -> dict[str, Any]:
    """The block-copy kernel alone, for each of :func:`kernel_variants`; the default's launch also wall-timed."""
    from . import fastpath

    out: dict[str, Any] = {}
    specs_src = [fastpath.RegionSpec.of_tensor(ip.src[r]) for r in range(shape.regions)]
    specs_dst = [fastpath.RegionSpec.of_tensor(ip.dst[r]) for r in range(shape.regions)]
    variants = kernel_variants(sweep)
    host_sets = pinned_id_sets(torch, sets)
    stream = torch.cuda.current_stream(ip.device).cuda_stream
    out["kernel_variants"] = {}
    for variant in variants:
        chunk, warps, group, host = variant[:4]
        cache = variant[4] if len(variant) > 4 else 1
        copier = fastpath.BlockCopier(specs_src, specs_dst, ip.device, chunk_bytes=chunk, num_warps=warps,
                                      region_group=group, cache=cache)
        copier.copy(*dev_sets[0])  # through Triton's JIT once: later launches are direct
        # fn is called with one of args' sets: (host ids, pad) for a direct launch, (src ids, dst ids) for copy
        fn: Callable[..., None]
        args: list[Any]
        if host:
            def launch(h: Any, pad: int, copier: Any = copier) -> None:
                n = shape.blocks
                if not copier.launch_ptrs(stream, h.data_ptr(), h.data_ptr() + 4 * pad, n):
                    raise RuntimeError("direct launch unavailable")
            fn, args = launch, host_sets
        else:
            fn, args = copier.copy, dev_sets
        ev = median(ip.time_events(fn, args))
        ip.poison(sets[-1][1])
        fn(*args[-1])
        exact = ip.check(*sets[-1])
        key = f"{chunk}B/{warps}w/G{group}/{'host' if host else 'dev'}-ids" + (f"/cache{cache}" if cache != 1 else "")
        out["kernel_variants"][key] = {"event_s": ev, "gbps": gbps(shape.nbytes, ev), "exact": exact,
                                       "backend": copier.backend}
        if variant == variants[0]:
            out |= _default_kernel(torch, ip, copier, fn, args, ev, exact, key)
        elif variant == variants[1]:
            out["kernel_host_ids_event_s"] = ev
    return out


def _default_kernel(torch: Any, ip: InProcess, copier: Any, fn: Any, args: list[Any], event_s: float, exact: bool,
                    key: str) -> dict[str, Any]:
    """The transport's default kernel shape: its figures, its wall, and the host cost of one direct launch."""
    out: dict[str, Any] = {"kernel_event_s": event_s, "kernel_wall_s": median(ip.time_wall(fn, args)),
                           "kernel_exact": exact, "kernel_backend": copier.backend, "kernel_config": key}
    launch = []
    for a in args:  # host cost of one launch (direct, after the first JIT launch)
        torch.cuda.synchronize(ip.device)
        t0 = time.perf_counter()
        fn(*a)
        launch.append(time.perf_counter() - t0)
    out["kernel_launch_host_us"] = median(launch) * 1e6
    out["kernel_fast_launch"] = copier._compiled is not None
    return out
