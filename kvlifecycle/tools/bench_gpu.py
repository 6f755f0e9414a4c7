"""``kvlifecycle bench gpu``: the same-node GPU fast path against NIXL, torch and a contiguous copy, in one run.

A KV request is ``regions × blocks × block_bytes`` (default 64 × 256 × 32 KiB = 512 MiB) plus a small request of
``--small-blocks`` blocks in every region (default 16 → 32 MiB). Block ids are random, distinct, and change every
repetition (so neither the kernel nor the ceiling is served from L2). Paths, all on one device:

(a) ``kvl``: the CUDA IPC transport end to end, two processes. P (a spawned process) allocates its regions, registers
    them (IPC export), allocates + prefill_done + grants in its :class:`SourceLedger`; D (this process) maps P at
    connect, reserves, then ``start_load`` → ``post(READ)`` → polls the completion event → ``part_done`` in its
    :class:`TargetLedger`; the copy's notification tells P, whose ``consumer_done`` releases the lease. Timed on D
    from ``start_load`` to ``part_done`` (wall clock), and P's whole round trip (grant → lease released). Both
    ledgers log to disk and are replayed and checked at the end.
(b) ``nixl``: raw NIXL/UCX, two agents in this process, prepped descriptor lists, READ of the same blocks.
(c) ``torch``: ``index_select`` + ``index_copy_`` over a stacked ``[regions, blocks, bytes]`` tensor.
(d) ``ceiling``: one contiguous device-to-device copy of the same number of bytes.
Also ``kernel``: the batched block-copy kernel alone, in-process, CUDA-event timed.

Wall-clock figures are "launch → completion observed by polling" for every path, so they compare like with like;
CUDA-event figures time the device work alone. Every copy is checked byte for byte (destination poisoned first).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle import envvars

POISON = 0xA5
GOALS = {"large": 0.9, "small": 0.6}  # issue 7: one request end to end x the contiguous copy, 512 MiB / 16 blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--regions", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=256, help="blocks per region in the large request")
    parser.add_argument("--small-blocks", type=int, default=16, help="blocks per region in the small request")
    parser.add_argument("--block-kib", type=int, default=32)
    parser.add_argument("--pool-blocks", type=int, default=2048, help="blocks per region in each side's pool")
    parser.add_argument("--reps", type=int, default=20, help="repetitions per timed figure (median reported)")
    parser.add_argument("--pipeline", type=int, default=8, help="requests in flight in the pipelined e2e run")
    parser.add_argument("--nixl-reps", type=int, default=3)
    parser.add_argument("--no-nixl", action="store_true")
    parser.add_argument("--no-e2e", action="store_true")
    parser.add_argument("--no-ab", action="store_true",
                        help="skip the second e2e run with the Python post (the compiled post's A/B, same run)")
    parser.add_argument("--sweep", action="store_true", help="also time kernel variants (chunk bytes, warps)")
    parser.add_argument("--device", type=int, default=0, help="D's device (this process)")
    parser.add_argument("--peer-device", type=int, default=None, help="P's device (default: the same)")
    parser.add_argument("--dir", help="keep the ledgers' logs here (default: a temporary directory)")
    parser.add_argument("--out", help="also write the JSON object to this file")


@dataclass(frozen=True, slots=True)
class Shape:
    regions: int
    blocks: int
    block_bytes: int

    @property
    def nbytes(self) -> int:
        return self.regions * self.blocks * self.block_bytes


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds and seconds == seconds and seconds > 0 else float("nan")


def _id_sets(rng: np.random.Generator, pool: int, n: int, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(rng.choice(pool, n, replace=False).astype(np.int32), rng.choice(pool, n, replace=False).astype(np.int32))
            for _ in range(count)]


def _busy(torch: Any, cycles: int = 200_000) -> None:
    """~0.1 ms of GPU spin ahead of a timed region (CUDA-event timing then excludes host launch overhead)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


def _spin(event: Any, timeout_s: float = 30.0) -> None:
    deadline = time.perf_counter() + timeout_s
    while not event.query():
        if time.perf_counter() > deadline:
            raise TimeoutError("copy did not complete in time")


# --- in-process paths: ceiling, torch, kernel ----------------------------------------------------------------------


class InProcess:
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

    def time_events(self, fn: Any, sets: list[Any], warmup: int = 3) -> list[float]:
        torch = self.torch
        for i in range(warmup):
            fn(*sets[i % len(sets)])
        torch.cuda.synchronize(self.device)
        out = []
        for args in sets:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            _busy(torch)  # keep the GPU busy while Python launches, so the events time the device work alone
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
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
            _spin(end)
            out.append(time.perf_counter() - t0)
        return out


def _pinned_id_sets(torch: Any, sets: list[Any]) -> list[tuple[Any, int]]:
    """Pinned host copies of the id sets, 16-byte aligned halves, as the transport stages them: (tensor, pad)."""
    out = []
    for s, d in sets:
        pad = -(-len(s) // 4) * 4
        h = torch.zeros(2 * pad, dtype=torch.int32, pin_memory=True)
        h[: len(s)], h[pad:pad + len(s)] = torch.from_numpy(s), torch.from_numpy(d)
        out.append((h, pad))
    return out


def bench_in_process(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], sweep: bool,
                     pipeline: int) -> dict[str, Any]:
    from kvlifecycle.transports.cuda_ipc import REGION_GROUP_HOST_IDS
    from kvlifecycle.transports.cuda_ipc.triton_copy import (
        DEFAULT_CHUNK_BYTES,
        DEFAULT_NUM_WARPS,
        BlockCopier,
        RegionSpec,
    )

    out: dict[str, Any] = {}
    nbytes = shape.nbytes
    flat_src = ip.src.view(-1)
    flat_dst = ip.dst.view(-1)
    span = flat_src.numel() - nbytes
    offsets = [(i * 7919 * 4096) % max(span, 1) // 4096 * 4096 for i in range(len(sets))]

    def ceiling(off: int) -> None:
        flat_dst[off:off + nbytes].copy_(flat_src[off:off + nbytes])

    out["ceiling_event_s"] = _median(ip.time_events(ceiling, [(o,) for o in offsets]))
    out["ceiling_wall_s"] = _median(ip.time_wall(ceiling, [(o,) for o in offsets]))

    def ceiling_back_to_back(_: int) -> None:
        for k in range(pipeline):
            ceiling(offsets[k % len(offsets)])

    out["ceiling_pipelined_wall_s"] = _median(ip.time_wall(ceiling_back_to_back, [(o,) for o in offsets[:5]]))
    ip.dst.fill_(POISON)
    ceiling(0)
    out["ceiling_exact"] = bool(torch.equal(flat_dst[:nbytes], flat_src[:nbytes]))

    dev_sets = [(torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device)) for s, d in sets]
    long_sets = [(s.long(), d.long()) for s, d in dev_sets]

    def torch_index(s: Any, d: Any) -> None:
        ip.dst.index_copy_(1, d, ip.src.index_select(1, s))

    out["torch_event_s"] = _median(ip.time_events(torch_index, long_sets))
    out["torch_wall_s"] = _median(ip.time_wall(torch_index, long_sets))
    ip.poison(sets[0][1])
    torch_index(*long_sets[0])
    out["torch_exact"] = ip.check(*sets[0])

    specs_src = [RegionSpec.of_tensor(ip.src[r]) for r in range(shape.regions)]
    specs_dst = [RegionSpec.of_tensor(ip.dst[r]) for r in range(shape.regions)]
    # (chunk bytes, warps, regions per program, ids in pinned host memory): the first is the transport's default
    variants = [(DEFAULT_CHUNK_BYTES, DEFAULT_NUM_WARPS, 1, False),
                (DEFAULT_CHUNK_BYTES, DEFAULT_NUM_WARPS, REGION_GROUP_HOST_IDS, True)]
    if sweep:
        variants += [(4096, 4, g, h) for g in (1, 2, 4, 8, 16) for h in (False, True)]
        variants += [(c, w, 1, False) for c in (2048, 8192, 16384, 32768) for w in (2, 4, 8)]
        variants = list(dict.fromkeys(variants))
        for c, w in ((4096, 4), (2048, 2), (8192, 4)):  # cache hints: 0 none, 2 streaming stores only
            variants += [(c, w, 1, False, cache) for cache in (0, 2)]
    host_sets = _pinned_id_sets(torch, sets)
    stream = torch.cuda.current_stream(ip.device).cuda_stream
    out["kernel_variants"] = {}
    for variant in variants:
        chunk, warps, group, host = variant[:4]
        cache = variant[4] if len(variant) > 4 else 1
        copier = BlockCopier(specs_src, specs_dst, ip.device, chunk_bytes=chunk, num_warps=warps, region_group=group,
                             cache=cache)
        copier.copy(*dev_sets[0])  # through Triton's JIT once: later launches are direct
        if host:
            def fn(h: Any, pad: int, copier: Any = copier) -> None:
                n = shape.blocks
                if not copier.launch_ptrs(stream, h.data_ptr(), h.data_ptr() + 4 * pad, n):
                    raise RuntimeError("direct launch unavailable")
            args = host_sets
        else:
            fn, args = copier.copy, dev_sets
        ev = _median(ip.time_events(fn, args))
        ip.poison(sets[-1][1])
        fn(*args[-1])
        exact = ip.check(*sets[-1])
        key = f"{chunk}B/{warps}w/G{group}/{'host' if host else 'dev'}-ids" + (f"/cache{cache}" if cache != 1 else "")
        out["kernel_variants"][key] = {"event_s": ev, "gbps": _gbps(nbytes, ev), "exact": exact,
                                       "backend": copier.backend}
        if variant == variants[0]:
            out["kernel_event_s"] = ev
            out["kernel_wall_s"] = _median(ip.time_wall(fn, args))
            out["kernel_exact"] = exact
            out["kernel_backend"] = copier.backend
            out["kernel_config"] = key
            launch = []
            for a in args:  # host cost of one launch (direct, after the first JIT launch)
                torch.cuda.synchronize(ip.device)
                t0 = time.perf_counter()
                fn(*a)
                launch.append(time.perf_counter() - t0)
            out["kernel_launch_host_us"] = _median(launch) * 1e6
            out["kernel_fast_launch"] = copier._compiled is not None
        elif variant == variants[1]:
            out["kernel_host_ids_event_s"] = ev
    return out


# Kernel shapes tried across the peer link (--sweep with --peer-device): a read over NVLink waits longer than one
# from the GPU's own memory, so more bytes per program might pay there (on the H200 pair they all move at the
# link's rate: docs/gpu.md, "Two GPUs").
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
    from kvlifecycle.transports.cuda_ipc.triton_copy import BlockCopier, RegionSpec

    _enable_peer_access(peer_device)
    peer = torch.device("cuda", peer_device)
    regions = shape.regions
    peer_src = ip.src[:regions].to(peer)  # the same bytes as ip.src, on the other GPU
    peer_dst = torch.full_like(peer_src, POISON)
    dev_sets = [(torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device)) for s, d in sets]
    host_sets = _pinned_id_sets(torch, sets)
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
            if host:
                def fn(h: Any, pad: int, copier: Any = copier) -> None:
                    if not copier.launch_ptrs(stream, h.data_ptr(), h.data_ptr() + 4 * pad, shape.blocks):
                        raise RuntimeError("direct launch unavailable")
                args = host_sets
            else:
                fn, args = copier.copy, dev_sets
            ev = _median(ip.time_events(fn, args))
            dst_t[:regions, d_idx] = POISON
            torch.cuda.synchronize(dst_t.device)  # the poison runs on that GPU's stream: done before the copy
            fn(*args[-1])
            torch.cuda.synchronize(ip.device)
            exact = bool(torch.equal(dst_t[:regions, d_idx].to(ip.device), ip.src[:regions, s_idx]))
            key = f"{chunk}B/{warps}w" + (f"/G{group}/host-ids" if host else "")
            rows[key] = {"event_s": ev, "gbps": _gbps(shape.nbytes, ev), "exact": exact}
    del peer_src, peer_dst
    torch.cuda.empty_cache()
    return out


# --- (b) raw NIXL ---------------------------------------------------------------------------------------------------


def bench_nixl(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], reps: int,
               peer_device: int | None = None) -> dict[str, Any]:
    """Raw NIXL/UCX READ of the same blocks. With ``peer_device`` (two GPUs, issue 8) the owner's regions are a copy
    of the source on that device, so the READ crosses GPUs as the CUDA IPC path does."""
    from nixl._api import nixl_agent, nixl_agent_config

    out: dict[str, Any] = {}
    # Raw NIXL as users run it: default config (UCX, progress thread on, so the target side progresses too).
    cfg = nixl_agent_config(backends=["UCX"])
    stamp = f"{os.getpid()}-{time.monotonic_ns()}"
    reader, owner = nixl_agent(f"bench-d-{stamp}", cfg), nixl_agent(f"bench-p-{stamp}", cfg)
    dev = ip.device.index
    owner_dev = dev if peer_device is None else peer_device
    owner_src = ip.src if owner_dev == dev else ip.src.to(torch.device("cuda", owner_dev))
    region_bytes = ip.pool * ip.block_bytes

    def descs(t: Any) -> np.ndarray:
        base = np.array([t[r].data_ptr() for r in range(ip.regions)], dtype=np.uint64)
        addr = (base[:, None] + np.arange(ip.pool, dtype=np.uint64)[None, :] * np.uint64(ip.block_bytes)).reshape(-1)
        return np.stack([addr, np.full_like(addr, ip.block_bytes), np.full_like(addr, t.device.index)], axis=1)

    def reg_rows(t: Any) -> list[tuple[int, int, int, str]]:
        return [(t[r].data_ptr(), region_bytes, t.device.index, "") for r in range(ip.regions)]

    reader.register_memory(reg_rows(ip.dst), "VRAM")
    owner.register_memory(reg_rows(owner_src), "VRAM")
    reader.add_remote_agent(owner.get_agent_metadata())
    local = reader.prep_xfer_dlist("NIXL_INIT_AGENT", descs(ip.dst), "VRAM")
    remote = reader.prep_xfer_dlist(owner.name, descs(owner_src), "VRAM")
    regs = np.arange(ip.regions, dtype=np.int64)[:, None] * ip.pool
    times: list[float] = []
    exact = True
    for i in range(reps + 1):  # the first transfer connects and warms up
        s, d = sets[i % len(sets)]
        ip.poison(d)
        torch.cuda.synchronize(ip.device)
        handle = reader.make_prepped_xfer("READ", local, (regs + d[None, :]).reshape(-1).astype(np.int32),
                                          remote, (regs + s[None, :]).reshape(-1).astype(np.int32))
        t0 = time.perf_counter()
        state = reader.transfer(handle)
        while state == "PROC":
            state = reader.check_xfer_state(handle)
            if time.perf_counter() - t0 > 60:
                raise TimeoutError("NIXL transfer still in progress after 60 s")
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer ended in state {state}")
        torch.cuda.synchronize(ip.device)
        exact = exact and ip.check(s, d)
        reader.release_xfer_handle(handle)
        if i or elapsed > 10:
            times.append(elapsed)
        if elapsed > 10:  # too slow to repeat inside a lease: one figure is enough to compare
            break
    out["nixl_wall_s"] = _median(times)
    out["nixl_exact"] = exact
    out["nixl_backend"] = "UCX"
    out["nixl_owner_device"] = owner_dev
    reader.remove_remote_agent(owner.name)
    del local, remote, reader, owner, owner_src  # destroying the agents stops their progress threads
    return out


# --- (a) end to end: two processes ------------------------------------------------------------------------------------


def _p_main(conn: Any, cfg: dict[str, Any]) -> None:
    """P: regions in their own allocations, a SourceLedger with a log, the CUDA IPC transport."""
    try:
        import msgspec
        import torch

        from kvlifecycle.ledger import open_ledger
        from kvlifecycle.transport import KVLayout, MemoryKind, PeerMetadata
        from kvlifecycle.transports.cuda_ipc import CudaIpcTransport

        device = torch.device("cuda", cfg["device"])
        torch.cuda.set_device(device)
        pool, bb = cfg["pool"], cfg["block_bytes"]
        gen = torch.Generator(device=device).manual_seed(cfg["seed"])
        regions = [torch.randint(0, 256, (pool, bb), dtype=torch.uint8, device=device, generator=gen)
                   for _ in range(cfg["regions"])]
        torch.cuda.synchronize(device)
        layout = KVLayout(MemoryKind.VRAM, device.index, pool, tuple(t.data_ptr() for t in regions),
                          tuple(bb for _ in regions))
        transport = CudaIpcTransport(f"bench-p-{os.getpid()}")
        transport.register(layout)
        ledger = open_ledger("source", pool, cfg["log_dir"] + "/p", worker="p0")
        conn.send(("meta", msgspec.msgpack.encode(transport.local_metadata())))
        _, raw = conn.recv()
        transport.add_peer(msgspec.msgpack.decode(raw, type=PeerMetadata))
        rng = np.random.default_rng(cfg["seed"])
        counter = 0
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            _, count, n = msg
            picks = rng.permutation(pool)[: count * n].astype(np.int32).reshape(count, n)
            grants, t_grant = [], {}
            for i in range(count):
                name = f"r{counter}"
                counter += 1
                ledger.allocate(name, picks[i])
                ledger.prefill_done(name)
                t_grant[name] = time.perf_counter()
                g = ledger.grant(name, ttl_s=30.0)
                grants.append((name, g.transfer, g.generation, picks[i]))
            conn.send(("grants", grants))
            waiting = {g[1]: g for g in grants}
            roundtrip = []
            deadline = time.monotonic() + 60
            while waiting and time.monotonic() < deadline:
                notes = transport.notifications()
                if not notes:
                    time.sleep(20e-6)  # P idles between completions; do not steal D's core
                for _sender, note in notes:
                    if note.kind == "done" and note.transfer in waiting:
                        name, transfer, generation, _ = waiting.pop(note.transfer)
                        ledger.consumer_done(transfer, generation)
                        for released in ledger.take_released():
                            ledger.free(released.request)
                            roundtrip.append(time.perf_counter() - t_grant[released.request])
            ledger.commit()
            conn.send(("released", roundtrip, sorted(waiting)))
        transport.close()
        ledger.log.close()
        conn.send(("bye", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def bench_e2e(torch: Any, ip: InProcess, shapes: dict[str, Shape], reps: int, pipeline: int, peer_device: int,
              log_dir: str, *, compiled_post: bool = True) -> dict[str, Any]:
    import multiprocessing as mp

    import msgspec

    from kvlifecycle.ledger import open_ledger
    from kvlifecycle.replay import check, check_pair, replay
    from kvlifecycle.transport import KVLayout, MemoryKind, Notification, PeerMetadata, XferStatus
    from kvlifecycle.transports.cuda_ipc import CudaIpcTransport

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    cfg = {"device": peer_device, "pool": ip.pool, "block_bytes": ip.block_bytes, "regions": ip.regions, "seed": 7,
           "log_dir": log_dir}
    proc = ctx.Process(target=_p_main, args=(child, cfg), daemon=True)
    proc.start()

    def recv(timeout: float = 120.0, spin: bool = False) -> Any:
        if spin:
            # D busy-waits for P's grant, as a decode worker's busy scheduler loop would: a core that slept in a
            # blocking read starts the timed request cold (caches, clocks), while the ceiling it is compared with
            # is timed in a hot loop. Bounded like the blocking wait.
            deadline = time.perf_counter() + timeout
            while not parent.poll(0):
                if time.perf_counter() > deadline:
                    raise TimeoutError("P process did not answer")
        elif not parent.poll(timeout):
            raise TimeoutError("P process did not answer")
        msg = parent.recv()
        if msg[0] == "error":
            raise RuntimeError(f"P process failed:\n{msg[1]}")
        return msg

    out: dict[str, Any] = {}
    transport = None
    try:
        layout = KVLayout(MemoryKind.VRAM, ip.device.index, ip.pool,
                          tuple(ip.dst[r].data_ptr() for r in range(ip.regions)),
                          tuple(ip.block_bytes for _ in range(ip.regions)))
        transport = CudaIpcTransport(f"bench-d-{os.getpid()}", compiled_post=compiled_post)
        transport._trace = True  # per-stage post times (recorded after the launch, so off the latency path)
        transport.register(layout)
        ledger = open_ledger("target", ip.pool, log_dir + "/d", worker="d0")
        _, raw = recv()
        t0 = time.perf_counter()
        peer = transport.add_peer(msgspec.msgpack.decode(raw, type=PeerMetadata))
        out["connect_s"] = time.perf_counter() - t0
        out["connect"] = transport.peer_info(peer)
        parent.send(("meta", msgspec.msgpack.encode(transport.local_metadata())))
        plan = transport.prepare(peer)
        peer_epoch = out["connect"]["epoch"]
        mapped = transport._peers[peer].mapped  # P's regions as this process sees them, for the byte check
        from kvlifecycle.transports.cuda_ipc.triton_copy import _RawCudaArray

        src_views = [torch.as_tensor(_RawCudaArray(a, (ip.pool, ip.block_bytes), (ip.block_bytes, 1)),
                                     device=ip.device) for a in mapped.base_addrs]
        rng = np.random.default_rng(11)
        counter = [0]

        stages: list[dict[str, float]] = []  # KVL_CUDA_IPC_TRACE=1: where post's time goes
        multi: dict[str, list[dict[str, float]]] = {}  # rounds of several requests: where their wall goes
        steps: list[list[float]] = []  # single requests: start_load, post, wait for the event, ledger completion

        flat_src, flat_dst = ip.src.view(-1), ip.dst.view(-1)
        ceiling_end = torch.cuda.Event()
        drv = transport._driver
        fast = drv.fast
        fast.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        raw_end = drv.event_create(timing=False)
        raw_src, raw_dst = flat_src.data_ptr(), flat_dst.data_ptr()

        def raw_copy(nbytes: int) -> None:
            """The least host work a contiguous copy can take: two driver calls and a spin on the event."""
            stream = torch._C._cuda_getCurrentRawStream(ip.device.index)
            rc = fast.cuMemcpyDtoDAsync_v2(raw_dst, raw_src, nbytes, stream)
            rc = rc or fast.cuEventRecord(raw_end, stream)
            if rc:
                raise RuntimeError(f"raw ceiling copy failed ({rc})")
            deadline = time.perf_counter() + 30
            while fast.cuEventQuery(raw_end) == 600:
                if time.perf_counter() > deadline:
                    raise TimeoutError("raw ceiling copy did not complete in 30 s")

        def round_(count: int, n: int, verify: bool, batched: bool = False, ceiling: str = ""
                   ) -> tuple[float, float, list[float], bool, dict[str, Any]]:
            """``count`` requests of ``n`` blocks: posted one by one, or (``batched``) as one ``post_batch`` (a
            scheduler step's loads). Each ledger step's records are appended at its end, after the launch.

            ``ceiling`` ("torch" or "driver"): at the moment the transfer would start, time a contiguous copy of
            the same bytes first (D's own buffers; wall, launch to its event seen, as the ceiling is timed; torch's
            ``copy_``, or the raw driver calls), then run the round as usual, untimed. The ceiling measured at the
            same point of the same loop, side by side."""
            parent.send(("grant", count, n))
            _, grants = recv(spin=True)
            dst_sets = rng.permutation(ip.pool)[: count * n].astype(np.int32).reshape(count, n)
            names = []
            for i in range(count):
                name = f"d{counter[0]}"
                counter[0] += 1
                ledger.reserve(name, dst_sets[i])
                names.append(name)
                if verify:
                    ip.poison(dst_sets[i])
            ledger.commit()
            torch.cuda.synchronize(ip.device)
            handles = {}
            ceiling_s = 0.0
            t_start = time.perf_counter()
            if ceiling:
                nbytes = count * n * ip.regions * ip.block_bytes
                if ceiling == "driver":
                    raw_copy(nbytes)
                else:
                    flat_dst[:nbytes].copy_(flat_src[:nbytes])
                    ceiling_end.record()
                    _spin(ceiling_end)
                ceiling_s = time.perf_counter() - t_start
                torch.cuda.synchronize(ip.device)
                t_start = time.perf_counter()
            marks: list[float] = [t_start]
            batch_marks: list[float] = []

            def post_one(i: int) -> None:
                p_name, transfer, generation, src = grants[i]
                note = Notification(p_name, transfer, generation, transport.epoch, "done", 0)
                handles[transfer] = (transport.post("READ", plan, dst_sets[i], src, notification=note,
                                                    transfer=transfer), names[i])
                marks.append(time.perf_counter())

            def post_all() -> None:  # the step's requests as one post_batch
                batch = [(dst_sets[i], src, Notification(p_name, transfer, generation, transport.epoch, "done", 0),
                          transfer) for i, (p_name, transfer, generation, src) in enumerate(grants)]
                t_batch = time.perf_counter()
                posted = transport.post_batch("READ", plan, batch)
                t_batched = time.perf_counter()
                handles.update({b[3]: (h, names[i]) for i, (b, h) in enumerate(zip(batch, posted, strict=True))})
                flight = transport._inflight.get(posted[0].id)
                t_launched = flight.t_launched if flight is not None and flight.t_launched else t_batched
                marks_c = transport._stage_marks  # the compiled post's own stamps (traced): when it was called
                t_call = marks_c[1] if marks_c and marks_c[0] == "native" else t_batch
                batch_marks.extend((t_batch, t_call, t_launched, t_batched))

            with ledger.step():  # the gates act now; their log records are appended after the launch
                for i, (_, transfer, generation, _) in enumerate(grants):
                    ledger.start_load(names[i], transfer, generation=generation, peer=peer, peer_epoch=peer_epoch)
                    marks.append(time.perf_counter())
                    if not batched:
                        post_one(i)
                if batched:
                    post_all()
            t_issued = time.perf_counter()
            first_seen, part_done_s = 0.0, 0.0
            ready: list[tuple[str, Any, float]] = []
            kernel_s, stats0 = 0.0, {}
            t_ready = t_start
            deadline = time.perf_counter() + 60
            while handles:
                done = []
                for transfer, (handle, _name) in handles.items():
                    status = transport.poll(handle)
                    if status is XferStatus.FAILED:
                        raise RuntimeError(f"transfer failed: {transport.error(handle)}")
                    if status is XferStatus.DONE:
                        done.append(transfer)
                if not done:
                    if time.perf_counter() > deadline:
                        raise TimeoutError("e2e transfers did not complete in 60 s")
                    continue
                t_seen = time.perf_counter()
                first_seen = first_seen or t_seen
                marks.append(t_seen)
                # The blocks are READY_FOR_ATTENTION once part_done returns: that ends a request's latency (the
                # step's log records follow, at its end).
                with ledger.step():
                    for transfer in done:
                        ledger.part_done(transfer)
                    t_ready = time.perf_counter()
                part_done_s += t_ready - t_seen
                marks.append(t_ready)
                ready += [(transfer, handles.pop(transfer)[0], t_seen) for transfer in done]
            # Metrics and the handles' release change no block state: they follow once every request of the
            # round is READY (as an engine's step makes its loads visible first), off the latency path.
            for transfer, handle, t_seen in ready:
                rec = transport._handles.live[handle.id]
                st = transport.stats(handle)
                extra = transport.stage_times(handle)
                ledger.observe_transfer(transfer, t_post_s=st.t_post_s, t_xfer_s=st.t_xfer_s, nbytes=st.bytes,
                                        descriptors=st.desc_count, backend=st.backend, ok=True)
                transport.release(handle)
                kernel_s += st.t_xfer_s
                if count == 1 and not ceiling:
                    marks.append(time.perf_counter())
                    step = [b - a for a, b in itertools.pairwise(marks)]
                    # split of the wait: until the event was seen complete, then stats + notification to P
                    step += [rec.t_done - marks[2], t_seen - rec.t_done]
                    steps.append(step)
                    if extra:
                        stages.append(extra)
                stats0 = {"t_post_us": st.t_post_s * 1e6, "t_xfer_us": st.t_xfer_s * 1e6, "backend": st.backend,
                          "descriptors_replaced": st.desc_count}
            # start_load of the first -> the last request's blocks READY_FOR_ATTENTION
            elapsed = ceiling_s if ceiling else t_ready - t_start
            if count > 1 and not ceiling:  # where a multi-request round's wall goes (medians per row, in µs)
                starts = marks[1:count + 1] if batched else marks[1:2 * count:2]
                befores = marks[:count] if batched else marks[0:2 * count:2]
                split = {"start_loads": sum(b - a for a, b in zip(befores, starts, strict=True)),
                         "issue": t_issued - t_start, "until_first_seen": first_seen - t_issued,
                         "first_seen_to_last_ready": t_ready - first_seen, "part_dones": part_done_s,
                         "transfer_device": kernel_s / count if batched else kernel_s}
                if batched:
                    t_batch, t_call, t_launched, t_batched = batch_marks
                    split |= {"post_batch_to_launch": t_launched - t_batch, "post_batch_python_before_call":
                              t_call - t_batch, "post_batch_after_launch": t_batched - t_launched,
                              "step_exit": t_issued - t_batched}
                multi.setdefault(("batched" if batched else "pipelined"), []).append(split)
            exact = True
            if verify:
                for i, (_, _, _, src) in enumerate(grants):
                    s = torch.from_numpy(src).to(ip.device).long()
                    d = torch.from_numpy(dst_sets[i]).to(ip.device).long()
                    for r in range(ip.regions):
                        exact = exact and bool(torch.equal(ip.dst[r][d], src_views[r][s]))
            for name in names:
                ledger.finish(name)
            ledger.commit()
            _, roundtrip, missing = recv()
            if missing:
                raise RuntimeError(f"P never saw completions for {missing}")
            return elapsed, kernel_s / count, roundtrip, exact, stats0

        profile = None
        profile_what = envvars.BENCH_PROFILE.read()
        profile_batched = profile_what == "batched"  # else the lone small requests
        if profile_what:
            import cProfile

            profile = cProfile.Profile()
        for label, shape in shapes.items():
            n = shape.blocks
            round_(1, n, False)  # warm-up (kernel compile for this shape)
            round_(1, n, False)  # the first warm launch binds the compiled post
            whole = transport._plans[plan.key].whole
            out[f"{label}_compiled_post"] = whole is not None and whole.native_read is not None
            steps.clear()
            stages.clear()
            walls, kernels, trips, exact, in_loop, in_loop_raw = [], [], [], True, [], []
            for i in range(reps):
                if profile is not None and label == "small" and not profile_batched:
                    profile.enable()
                w, k, rt, ok, stats0 = round_(1, n, verify=i in (0, reps - 1))
                if profile is not None:
                    profile.disable()
                in_loop.append(round_(1, n, False, ceiling="torch")[0])  # the ceiling, same loop, next round
                in_loop_raw.append(round_(1, n, False, ceiling="driver")[0])
                walls.append(w)
                kernels.append(k)
                trips += rt
                exact = exact and ok
            out[f"{label}_wall_s"] = _median(walls)
            out[f"{label}_ceiling_in_loop_wall_s"] = _median(in_loop)
            out[f"{label}_ceiling_in_loop_driver_wall_s"] = _median(in_loop_raw)
            out[f"{label}_kernel_s"] = _median(kernels)
            out[f"{label}_roundtrip_s"] = _median(trips)
            out[f"{label}_exact"] = exact
            out[f"{label}_stats"] = stats0
            step_names = ("start_load", "post", "wait_event", "part_done", "after_ready", "event_seen", "complete")
            parts = np.median(np.array(steps), axis=0) * 1e6 if steps else [float("nan")] * len(step_names)
            out[f"{label}_steps_us"] = dict(zip(step_names, (round(float(x), 1) for x in parts), strict=True))
            out[f"{label}_post_us"] = float(parts[1])
            if stages:
                out[f"{label}_post_stages_us"] = {k: round(float(np.median([x[k] for x in stages])), 1)
                                                  for k in stages[0]}
            piped = []
            for i in range(max(1, reps // 4)):
                w, _, _, ok, _ = round_(pipeline, n, verify=i == 0)
                piped.append(w)
                exact = exact and ok
            out[f"{label}_pipelined_wall_s"] = _median(piped)
            batched = []  # the same requests as one scheduler step: one post_batch, one ledger step each way
            for i in range(max(1, reps // 4)):
                if profile is not None and label == "small" and profile_batched and i:
                    profile.enable()
                w, _, _, ok, _ = round_(pipeline, n, verify=i == 0, batched=True)
                if profile is not None:
                    profile.disable()
                batched.append(w)
                exact = exact and ok
            out[f"{label}_batched_wall_s"] = _median(batched)
            for kind, splits in multi.items():
                out[f"{label}_{kind}_split_us"] = {k: round(float(np.median([x[k] for x in splits])) * 1e6, 1)
                                                   for k in splits[0]}
            multi.clear()
            out[f"{label}_exact"] = exact
        if profile is not None:
            import io
            import pstats

            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
            out["profile_small"] = text.getvalue()[-5000:]
            print(out["profile_small"], file=sys.stderr)
        drv.event_destroy(raw_end)
        parent.send(("stop",))
        recv()
        proc.join(30)
        ledger.log.close()
        p_res, d_res = replay(Path(log_dir) / "p"), replay(Path(log_dir) / "d")
        violations = check(p_res, quiescent=True) + check(d_res, quiescent=True) + check_pair([p_res, d_res])
        out["replay_events"] = {"p": len(p_res.events), "d": len(d_res.events)}
        out["replay_violations"] = [str(v) for v in violations]
    finally:
        if transport is not None:
            transport.close()
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    return out


# --- the command -------------------------------------------------------------------------------------------------


def _peer_ceiling(torch: Any, ip: InProcess, nbytes: int, peer_device: int, reps: int = 10) -> tuple[float, float]:
    """Median time of a contiguous copy of ``nbytes`` from ``peer_device`` into this device: CUDA events, and wall
    (launch to its event seen, in a hot loop: how the one-GPU ceiling is timed)."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=torch.device("cuda", peer_device))
    dst = ip.dst.view(-1)[:nbytes]
    sets = [()] * reps
    return (_median(ip.time_events(lambda: dst.copy_(src), sets)),
            _median(ip.time_wall(lambda: dst.copy_(src), sets)))


def ledger_hot_us(blocks: int, reps: int, log_dir: str) -> dict[str, float]:
    """D's two ledger commands on a request's latency path, timed in a hot loop of nothing else (median µs; CPU
    only): the least the ledger adds to a request on this host, whatever the transport does."""
    from kvlifecycle.ledger import open_ledger

    ledger = open_ledger("target", max(4 * blocks, 64), log_dir, worker="hot")
    ids = np.arange(blocks, dtype=np.int32)
    start_us, done_us = [], []
    try:
        for i in range(reps + 50):  # the first 50 warm the loop and are dropped
            name, transfer = f"h{i}", f"ht{i}"
            ledger.reserve(name, ids)
            with ledger.step():
                t0 = time.perf_counter()
                ledger.start_load(name, transfer, peer="p", peer_epoch=1)
                t1 = time.perf_counter()
            with ledger.step():
                t2 = time.perf_counter()
                ledger.part_done(transfer)
                t3 = time.perf_counter()
            ledger.finish(name)
            ledger.commit()
            if i >= 50:
                start_us.append((t1 - t0) * 1e6)
                done_us.append((t3 - t2) * 1e6)
    finally:
        ledger.log.close()  # type: ignore[union-attr]
    return {"start_load": round(statistics.median(start_us), 2), "part_done": round(statistics.median(done_us), 2)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("kvlifecycle bench gpu needs a CUDA device; torch.cuda.is_available() is False here")
    device = torch.device("cuda", args.device)
    torch.cuda.set_device(device)
    bb = args.block_kib * 1024
    shapes = {"large": Shape(args.regions, args.blocks, bb), "small": Shape(args.regions, args.small_blocks, bb)}
    pool = max(args.pool_blocks, args.blocks * args.pipeline, args.small_blocks * args.pipeline)
    ip = InProcess(torch, device, Shape(args.regions, pool, bb), pool, seed=3)
    rng = np.random.default_rng(5)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "shape": {k: {"regions": s.regions, "blocks": s.blocks, "block_bytes": s.block_bytes, "bytes": s.nbytes}
                  for k, s in shapes.items()},
        "pool_blocks": pool,
    }
    try:
        import triton

        res["triton"] = triton.__version__
    except ImportError:
        res["triton"] = None
    id_sets = {label: _id_sets(rng, pool, shape.blocks, args.reps) for label, shape in shapes.items()}
    for label, shape in shapes.items():
        res[label] = bench_in_process(torch, ip, shape, id_sets[label], args.sweep, args.pipeline)
    if args.peer_device is not None and args.peer_device != args.device:
        # Two GPUs (issue 8): P's memory is on --peer-device; the ceiling is a torch peer copy of the same bytes.
        for label, shape in shapes.items():
            try:
                event_s, wall_s = _peer_ceiling(torch, ip, shape.nbytes, args.peer_device, max(10, args.reps))
                res[label] |= {"peer_ceiling_event_s": event_s, "peer_ceiling_wall_s": wall_s}
            except Exception as exc:
                res[label]["peer_ceiling_error"] = f"{type(exc).__name__}: {exc}"
    if not args.no_e2e:
        log_dir = args.dir or tempfile.mkdtemp(prefix="kvl-bench-gpu-")
        res["ledger_hot_us"] = ledger_hot_us(args.small_blocks, max(200, 10 * args.reps), f"{log_dir}/hot")
        peer = args.device if args.peer_device is None else args.peer_device
        # A/B in one run: the same e2e with the compiled post (the default) and with the Python post.
        for key, compiled in (("e2e", True), ("e2e_python_post", False)):
            if key != "e2e" and args.no_ab:
                continue
            try:
                e2e = bench_e2e(torch, ip, shapes, args.reps, args.pipeline, peer, f"{log_dir}/{key}",
                                compiled_post=compiled)
            except Exception as exc:
                e2e = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
            res[key] = e2e
        res["log_dir"] = log_dir
    if args.sweep and args.peer_device is not None and args.peer_device != args.device:
        for label, shape in shapes.items():
            try:
                res[label]["peer_kernel_variants"] = bench_peer_kernels(torch, ip, shape, id_sets[label],
                                                                        args.peer_device)
            except Exception as exc:  # reported, not fatal: a measurement beside the e2e
                res[label]["peer_kernel_error"] = f"{type(exc).__name__}: {exc}"
    if not args.no_nixl:  # last: NIXL's UCX progress threads spin cores while its agents live
        for label, shape in shapes.items():
            try:
                res[label].update(bench_nixl(torch, ip, shape, id_sets[label],
                                             args.nixl_reps if label == "large" else 10, args.peer_device))
            except Exception as exc:  # reported, not fatal: NIXL is a comparison here
                res[label]["nixl_error"] = f"{type(exc).__name__}: {exc}"
            gc.collect()
    return summarise(res, shapes, args.pipeline)


def summarise(res: dict[str, Any], shapes: dict[str, Shape], pipeline: int) -> dict[str, Any]:
    e2e = res.get("e2e", {})
    for label, shape in shapes.items():
        r, nb = res[label], shape.nbytes
        r["gbps_ceiling_event"] = _gbps(nb, r["ceiling_event_s"])
        r["gbps_ceiling_wall"] = _gbps(nb, r["ceiling_wall_s"])
        r["gbps_torch_event"] = _gbps(nb, r["torch_event_s"])
        r["gbps_kernel_event"] = _gbps(nb, r["kernel_event_s"])
        r["gbps_nixl"] = _gbps(nb, r.get("nixl_wall_s", float("nan")))
        r["gbps_kvl_wall"] = _gbps(nb, e2e.get(f"{label}_wall_s", float("nan")))
        r["gbps_kvl_kernel"] = _gbps(nb, e2e.get(f"{label}_kernel_s", float("nan")))
        r["gbps_kvl_pipelined"] = _gbps(nb * pipeline, e2e.get(f"{label}_pipelined_wall_s", float("nan")))
        r["gbps_ceiling_pipelined"] = _gbps(nb * pipeline, r["ceiling_pipelined_wall_s"])
        r["gbps_kvl_batched"] = _gbps(nb * pipeline, e2e.get(f"{label}_batched_wall_s", float("nan")))
        r["ratio_kvl_batched"] = r["gbps_kvl_batched"] / r["gbps_ceiling_pipelined"]
        r["ratio_kvl_to_ceiling_wall"] = r["gbps_kvl_wall"] / r["gbps_ceiling_wall"]
        # the same contiguous copy timed at the same point of D's loop as the request (side by side, alternating)
        r["gbps_ceiling_in_loop"] = _gbps(nb, e2e.get(f"{label}_ceiling_in_loop_wall_s", float("nan")))
        r["ratio_kvl_to_ceiling_in_loop"] = r["gbps_kvl_wall"] / r["gbps_ceiling_in_loop"]
        r["gbps_ceiling_in_loop_driver"] = _gbps(nb, e2e.get(f"{label}_ceiling_in_loop_driver_wall_s", float("nan")))
        r["ratio_kvl_to_ceiling_in_loop_driver"] = r["gbps_kvl_wall"] / r["gbps_ceiling_in_loop_driver"]
        r["ratio_kvl_kernel_to_ceiling_event"] = r["gbps_kvl_kernel"] / r["gbps_ceiling_event"]
        r["ratio_kernel_to_ceiling_event"] = r["gbps_kernel_event"] / r["gbps_ceiling_event"]
    large, small = res["large"], res["small"]
    for r, shape in ((large, shapes["large"]), (small, shapes["small"])):
        if "peer_ceiling_event_s" in r:  # two GPUs: the ratios that issue 8 asks for
            r["gbps_peer_ceiling"] = _gbps(shape.nbytes, r["peer_ceiling_event_s"])
            r["ratio_kvl_to_peer_ceiling"] = r["gbps_kvl_wall"] / r["gbps_peer_ceiling"]
            r["ratio_kvl_kernel_to_peer_ceiling"] = r["gbps_kvl_kernel"] / r["gbps_peer_ceiling"]
            r["ratio_nixl_to_peer_ceiling"] = r["gbps_nixl"] / r["gbps_peer_ceiling"]
            if "peer_ceiling_wall_s" in r:  # wall against wall, as the one-GPU headline compares them
                r["gbps_peer_ceiling_wall"] = _gbps(shape.nbytes, r["peer_ceiling_wall_s"])
                r["ratio_kvl_to_peer_ceiling_wall"] = r["gbps_kvl_wall"] / r["gbps_peer_ceiling_wall"]
            for rows in r.get("peer_kernel_variants", {}).values():
                for v in rows.values():
                    v["ratio_to_peer_ceiling"] = v["gbps"] / r["gbps_peer_ceiling"]
    res["gbps_kvl"] = large["gbps_kvl_wall"]
    res["gbps_ceiling"] = large["gbps_ceiling_wall"]
    res["ratio_to_ceiling"] = large["ratio_kvl_to_ceiling_wall"]
    res["gbps_kvl_kernel"] = large["gbps_kvl_kernel"]
    res["gbps_ceiling_event"] = large["gbps_ceiling_event"]
    res["ratio_kernel_to_ceiling"] = large["ratio_kvl_kernel_to_ceiling_event"]
    res["gbps_nixl"] = large["gbps_nixl"]
    res["gbps_torch"] = large["gbps_torch_event"]
    res["gbps_kvl_small"] = small["gbps_kvl_wall"]
    res["ratio_small"] = small["ratio_kvl_to_ceiling_wall"]
    res["ratio_to_ceiling_in_loop"] = large["ratio_kvl_to_ceiling_in_loop"]
    res["ratio_small_to_ceiling_in_loop"] = small["ratio_kvl_to_ceiling_in_loop"]
    res["ratio_to_ceiling_in_loop_driver"] = large["ratio_kvl_to_ceiling_in_loop_driver"]
    res["ratio_small_to_ceiling_in_loop_driver"] = small["ratio_kvl_to_ceiling_in_loop_driver"]
    res["ratio_small_kernel"] = small["ratio_kvl_kernel_to_ceiling_event"]
    res["gbps_kvl_pipelined"] = large["gbps_kvl_pipelined"]
    res["gbps_kvl_small_pipelined"] = small["gbps_kvl_pipelined"]
    res["ratio_pipelined"] = large["gbps_kvl_pipelined"] / large["gbps_ceiling_pipelined"]
    res["ratio_small_pipelined"] = small["gbps_kvl_pipelined"] / small["gbps_ceiling_pipelined"]
    res["ratio_batched"] = large["ratio_kvl_batched"]
    res["ratio_small_batched"] = small["ratio_kvl_batched"]
    res["host_us"] = _host_split(res, e2e, shapes)
    ab = res.get("e2e_python_post", {})
    if ab and "error" not in ab:  # the same e2e with the Python post, same run: the compiled post's A/B
        for label, shape in shapes.items():
            r = res[label]
            r["gbps_kvl_wall_python_post"] = _gbps(shape.nbytes, ab.get(f"{label}_wall_s", float("nan")))
            r["ratio_kvl_python_post"] = r["gbps_kvl_wall_python_post"] / r["gbps_ceiling_wall"]
            r["gbps_kvl_pipelined_python_post"] = _gbps(shape.nbytes * pipeline,
                                                        ab.get(f"{label}_pipelined_wall_s", float("nan")))
        res["ratio_to_ceiling_python_post"] = large["ratio_kvl_python_post"]
        res["ratio_small_python_post"] = small["ratio_kvl_python_post"]
        res["host_us_python_post"] = _host_split(res, ab, shapes)
    res["split"] = {
        "single_wall": {"large": res["ratio_to_ceiling"], "small": res["ratio_small"]},
        "single_wall_vs_ceiling_in_loop": {"large": res["ratio_to_ceiling_in_loop"],
                                           "small": res["ratio_small_to_ceiling_in_loop"]},
        "single_wall_vs_raw_copy_in_loop": {"large": res["ratio_to_ceiling_in_loop_driver"],
                                            "small": res["ratio_small_to_ceiling_in_loop_driver"]},
        "transfer_device_time": {"large": res["ratio_kernel_to_ceiling"], "small": res["ratio_small_kernel"]},
        "pipelined_wall": {"large": res["ratio_pipelined"], "small": res["ratio_small_pipelined"]},
        "step_batched_wall": {"large": res["ratio_batched"], "small": res["ratio_small_batched"]},
        "kernel_in_process": {"large": large["ratio_kernel_to_ceiling_event"],
                              "small": small["ratio_kernel_to_ceiling_event"]},
    }
    res["goal_large_met"] = bool(res["ratio_to_ceiling"] >= GOALS["large"])
    res["goal_small_met"] = bool(res["ratio_small"] >= GOALS["small"])
    res["host_budget_us"] = _host_budget(res, e2e, shapes)
    # the goals against each way of timing the contiguous copy: hot loop (the headline), torch copy_ and raw
    # driver calls at the same point of D's loop as the request
    res["goals"] = {name: {"large": bool(large_r >= GOALS["large"]), "small": bool(small_r >= GOALS["small"])}
                    for name, large_r, small_r in (
                        ("copy_hot_loop", res["ratio_to_ceiling"], res["ratio_small"]),
                        ("copy_in_loop", res["ratio_to_ceiling_in_loop"], res["ratio_small_to_ceiling_in_loop"]),
                        ("raw_copy_in_loop", res["ratio_to_ceiling_in_loop_driver"],
                         res["ratio_small_to_ceiling_in_loop_driver"]))}
    res["byte_exact"] = bool(all(
        res[lbl].get(k, True) for lbl in shapes for k in ("ceiling_exact", "torch_exact", "kernel_exact", "nixl_exact"))
        and all(res.get(key, {}).get(f"{lbl}_exact", True) for lbl in shapes for key in ("e2e", "e2e_python_post")))
    return res


def _host_budget(res: dict[str, Any], e2e: dict[str, Any], shapes: dict[str, Shape]) -> dict[str, Any]:
    """How much host work of its own a request may take and still meet its goal, against what it takes (µs).

    The least a request can cost at its point of D's loop is the raw driver copy timed there (one launch, one
    event, a spin: the host work no transfer avoids) plus the device time the block-gather kernel needs beyond a
    contiguous copy (both CUDA-event timed in-process, host launch excluded). Everything kvlifecycle adds on the
    path — the ledger's ``start_load`` and ``part_done``, the post's checks, the id copy, the stream ordering —
    must fit between that floor and the goal's wall (the hot-loop copy's wall / the goal). One GPU only: on two,
    the goal is against the peer copy."""
    budget: dict[str, Any] = {}
    for label in shapes:
        r, host = res[label], res.get("host_us", {}).get(label)
        raw = e2e.get(f"{label}_ceiling_in_loop_driver_wall_s")
        if host is None or raw is None or "peer_ceiling_event_s" in r:
            continue
        floor_s = raw + max(0.0, r["kernel_event_s"] - r["ceiling_event_s"])
        goal_wall_s = r["ceiling_wall_s"] / GOALS[label]
        budget[label] = {
            "goal": GOALS[label],
            "goal_wall_us": round(goal_wall_s * 1e6, 1),
            "floor_wall_us": round(floor_s * 1e6, 1),
            "ratio_at_floor": round(r["ceiling_wall_s"] / floor_s, 3),
            "budget_us": round((goal_wall_s - floor_s) * 1e6, 1),
            "spent_us": round(e2e[f"{label}_wall_s"] * 1e6 - floor_s * 1e6, 1),
            "ledger_us": round(host["start_load"] + host["part_done"], 1),
        }
        if "ledger_hot_us" in res:  # the same two commands in a hot loop of nothing else, this host
            budget[label]["ledger_hot_us"] = round(sum(res["ledger_hot_us"].values()), 1)
    return budget


def _host_split(res: dict[str, Any], e2e: dict[str, Any], shapes: dict[str, Shape]) -> dict[str, Any]:
    """The honest split of one request on D (median µs): host work before the kernel starts and after its event
    completes adds to latency; the copy's device time and the host work that overlaps it do not add twice."""
    host: dict[str, Any] = {}
    for label in shapes:
        steps, stages = e2e.get(f"{label}_steps_us"), e2e.get(f"{label}_post_stages_us", {})
        if not steps:
            continue
        h = {"start_load": steps["start_load"], "post_to_launch": stages.get("to_launch", float("nan")),
             "post_after_launch": stages.get("after_launch", float("nan")), "post_total": steps["post"],
             "complete_in_poll": steps["complete"], "part_done": steps["part_done"],
             "after_ready_observe_release": steps["after_ready"],
             "compiled_post": e2e.get(f"{label}_compiled_post")}
        h["on_latency_path"] = round(h["start_load"] + h["post_to_launch"] + h["complete_in_poll"] + h["part_done"], 1)
        h["wall_us"] = round(e2e.get(f"{label}_wall_s", float("nan")) * 1e6, 1)
        h["transfer_device_us"] = round(e2e.get(f"{label}_kernel_s", float("nan")) * 1e6, 1)
        h["ceiling_wall_us"] = round(res[label]["ceiling_wall_s"] * 1e6, 1)
        h["ceiling_in_loop_wall_us"] = round(e2e.get(f"{label}_ceiling_in_loop_wall_s", float("nan")) * 1e6, 1)
        h["raw_copy_in_loop_wall_us"] = round(e2e.get(f"{label}_ceiling_in_loop_driver_wall_s", float("nan")) * 1e6, 1)
        host[label] = h
    return host


def _print_budget(res: dict[str, Any]) -> None:
    for label, b in res.get("host_budget_us", {}).items():
        print(f"{label}: goal {b['goal']}x needs wall <= {b['goal_wall_us']} us; the floor at that point of D's loop "
              f"(raw driver copy + the kernel's extra device time) is {b['floor_wall_us']} us "
              f"({_fmt(b['ratio_at_floor'], 3)}x), so kvl's own host work may take {b['budget_us']} us: it takes "
              f"{b['spent_us']} us, the ledger's start_load + part_done alone {b['ledger_us']} us (in a hot loop "
              f"of nothing else: {_fmt(b.get('ledger_hot_us'))} us)")


def _fmt(x: Any, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else f"{x:,.{digits}f}"


def print_table(res: dict[str, Any]) -> None:
    from kvlifecycle.transports.cuda_ipc import REGION_GROUP_HOST_IDS

    print(f"device: {res['device']}   torch {res['torch']}   triton {res['triton']}")
    for label in ("large", "small"):
        r, shp = res[label], res["shape"][label]
        print(f"\n{label}: {shp['regions']} regions x {shp['blocks']} blocks x {shp['block_bytes'] // 1024} KiB "
              f"= {shp['bytes'] / 2**20:.0f} MiB")
        print(f"  {'path':<52}{'GB/s':>10}{'x ceiling':>11}")
        rows = [
            ("(d) contiguous copy, wall (ceiling)", r["gbps_ceiling_wall"], 1.0),
            ("(d) contiguous copy, CUDA events", r["gbps_ceiling_event"], 1.0),
            ("(a) kvl cuda_ipc e2e, 2 procs, wall", r["gbps_kvl_wall"], r["ratio_kvl_to_ceiling_wall"]),
            ("    same, Python post (A/B, same run)", r.get("gbps_kvl_wall_python_post"),
             r.get("ratio_kvl_python_post")),
            ("(d) contiguous copy_, wall, timed in D's loop", r.get("gbps_ceiling_in_loop"), 1.0),
            ("(a) kvl e2e, x that copy_", r["gbps_kvl_wall"], r.get("ratio_kvl_to_ceiling_in_loop")),
            ("(d) raw cuMemcpyDtoDAsync, wall, timed in D's loop", r.get("gbps_ceiling_in_loop_driver"), 1.0),
            ("(a) kvl e2e, x that raw copy", r["gbps_kvl_wall"], r.get("ratio_kvl_to_ceiling_in_loop_driver")),
            ("(a) kvl cuda_ipc device time post->done (events)", r["gbps_kvl_kernel"],
             r["ratio_kvl_kernel_to_ceiling_event"]),
            ("(d) contiguous copies back to back, wall", r["gbps_ceiling_pipelined"], 1.0),
            ("(a) kvl e2e pipelined, wall (x back-to-back)", r["gbps_kvl_pipelined"],
             r["gbps_kvl_pipelined"] / r["gbps_ceiling_pipelined"]),
            ("(a) kvl e2e, same requests as one step (post_batch)", r["gbps_kvl_batched"], r["ratio_kvl_batched"]),
            (f"    batched kernel in-process, events ({r.get('kernel_config')})", r["gbps_kernel_event"],
             r["ratio_kernel_to_ceiling_event"]),
            (f"    same, ids read from pinned host memory, G{REGION_GROUP_HOST_IDS}",
             _gbps(shp["bytes"], r.get("kernel_host_ids_event_s", 0)),
             _gbps(shp["bytes"], r.get("kernel_host_ids_event_s", 0)) / r["gbps_ceiling_event"]),
            ("(c) torch index_select+index_copy_, events", r["gbps_torch_event"],
             r["gbps_torch_event"] / r["gbps_ceiling_event"]),
            ("(b) raw NIXL/UCX READ, wall", r["gbps_nixl"], r["gbps_nixl"] / r["gbps_ceiling_wall"]),
        ]
        for name, gbps, ratio in rows:
            print(f"  {name:<52}{_fmt(gbps):>10}{_fmt(ratio, 3):>11}")
        if "gbps_peer_ceiling" in r:
            print(f"  two GPUs: torch peer copy (events) {_fmt(r['gbps_peer_ceiling'])} GB/s; kvl e2e "
                  f"{_fmt(r['ratio_kvl_to_peer_ceiling'], 3)}x (x the peer copy's wall in a hot loop, "
                  f"{_fmt(r.get('gbps_peer_ceiling_wall'))} GB/s: {_fmt(r.get('ratio_kvl_to_peer_ceiling_wall'), 3)}x)"
                  f", kvl device time "
                  f"{_fmt(r['ratio_kvl_kernel_to_peer_ceiling'], 3)}x, raw NIXL/UCX "
                  f"{_fmt(r['ratio_nixl_to_peer_ceiling'], 4)}x of it")
            for direction, rows in r.get("peer_kernel_variants", {}).items():
                print(f"  kernel across the peer link, {direction} (GB/s, x the peer copy): " + ", ".join(
                    f"{k} {_fmt(v['gbps'])} ({_fmt(v['ratio_to_peer_ceiling'], 3)}){'' if v['exact'] else ' NOT EXACT'}"
                    for k, v in rows.items()))
        if "nixl_error" in r:
            print(f"  NIXL: {r['nixl_error']}")
        if r.get("kernel_variants") and len(r["kernel_variants"]) > 2:
            print("  kernel variants (GB/s, events): " + ", ".join(
                f"{k} {_fmt(v['gbps'])}" for k, v in r["kernel_variants"].items()))
    e2e = res.get("e2e", {})
    if "error" in e2e:
        print(f"\ne2e failed: {e2e['error']}\n{e2e.get('trace', '')}")
    elif e2e:
        print(f"\nconnect (map + self-test): {_fmt(e2e['connect_s'] * 1e3, 2)} ms {e2e['connect']}")
        print(f"P round trip (grant -> lease released), median: large {_fmt(e2e['large_roundtrip_s'] * 1e6)} us, "
              f"small {_fmt(e2e['small_roundtrip_s'] * 1e6)} us")
        print(f"D single request, median us: large {e2e['large_steps_us']}, small {e2e['small_steps_us']}")
        for label, h in [*res.get("host_us", {}).items(),
                         *((f"{k} (Python post)", v) for k, v in res.get("host_us_python_post", {}).items())]:
            print(f"{label}: wall {h['wall_us']} us = host on the latency path {h['on_latency_path']} us (start_load "
                  f"{h['start_load']}, post up to the launch {h['post_to_launch']}, completion in poll "
                  f"{h['complete_in_poll']}, part_done {h['part_done']}) + device/poll; transfer device time "
                  f"{h['transfer_device_us']} us; overlapped: post after the launch {h['post_after_launch']}; "
                  f"after ready: observe+release {h['after_ready_observe_release']}; ceiling {h['ceiling_wall_us']} us")
        if "large_post_stages_us" in e2e:
            print(f"post stages, median us: large {e2e['large_post_stages_us']}, small {e2e['small_post_stages_us']}")
        print(f"post() host time, median: large {_fmt(e2e['large_post_us'])} us, small {_fmt(e2e['small_post_us'])} us;"
              f" kernel launch alone (in-process): {_fmt(res['large'].get('kernel_launch_host_us'))} us"
              f" (direct launch: {res['large'].get('kernel_fast_launch')})")
        for label in ("large", "small"):
            for kind, what in (("pipelined", "in flight"), ("batched", "as one step")):
                if f"{label}_{kind}_split_us" in e2e:
                    print(f"{label}, {kind} requests {what}, where the wall goes (median us): "
                          f"{e2e[f'{label}_{kind}_split_us']}")
        _print_budget(res)
        print(f"ledgers replayed: {e2e['replay_events']} events, violations: {len(e2e['replay_violations'])}")
    print(f"\nbyte-exact: {res['byte_exact']}   goal 512 MiB >= 0.9x: {res['goal_large_met']} "
          f"({_fmt(res['ratio_to_ceiling'], 3)})   goal 16 blocks >= 0.6x: {res['goal_small_met']} "
          f"({_fmt(res['ratio_small'], 3)})   [vs the copy hot; per way of timing it: {res.get('goals')}]")


def run(args: argparse.Namespace) -> int:
    res = measure(args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
    if args.json:
        print(json.dumps(res, default=str))
    else:
        print_table(res)
    ok = res["byte_exact"] and not any(res.get(key, {}).get("error") or res.get(key, {}).get("replay_violations")
                                       for key in ("e2e", "e2e_python_post"))
    return 0 if ok else 1


if __name__ == "__main__":  # pragma: no cover
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    sys.exit(run(parser.parse_args()))
