"""(a) the CUDA IPC transport end to end, two processes, one GPU or two.

P (:mod:`.e2e_source`, spawned) owns the source regions and a :class:`SourceLedger`; D (:mod:`.e2e_decode`, this
process) maps them at connect and moves requests through its :class:`TargetLedger`. Per shape: single requests,
each followed by the contiguous copy timed at the same point of D's loop (torch's ``copy_``, then raw driver
calls); then requests in flight together, and the same requests as one scheduler step (``post_batch``). Both
ledgers log to disk and are replayed and checked at the end."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from kvlifecycle import envvars
from kvlifecycle.ledger import open_ledger
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.transport import KVLayout, MemoryKind, PeerMetadata

from . import fastpath
from .e2e_decode import DecodeLoop, PipeToP
from .e2e_source import p_main
from .in_process import InProcess
from .shapes import Shape, median

STEP_NAMES = ("start_load", "post", "wait_event", "part_done", "after_ready", "event_seen", "complete")


def bench_e2e(torch: Any, ip: InProcess, shapes: dict[str, Shape], reps: int, pipeline: int, peer_device: int,
              log_dir: str, *, compiled_post: bool = True) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    cfg = {"device": peer_device, "pool": ip.pool, "block_bytes": ip.block_bytes, "regions": ip.regions, "seed": 7,
           "log_dir": log_dir}
    proc = ctx.Process(target=p_main, args=(child, cfg), daemon=True)
    proc.start()
    pipe = PipeToP(parent)
    out: dict[str, Any] = {}
    transport = None
    try:
        layout = KVLayout(MemoryKind.VRAM, ip.device.index or 0, ip.pool,  # an unindexed device is device 0
                          tuple(ip.dst[r].data_ptr() for r in range(ip.regions)),
                          tuple(ip.block_bytes for _ in range(ip.regions)))
        transport = fastpath.CudaIpcTransport(f"bench-d-{os.getpid()}", compiled_post=compiled_post)
        loop = _connect(torch, ip, pipe, transport, layout, log_dir, out)
        profile = SmallProfile()
        for label, shape in shapes.items():
            out |= _measure_shape(loop, label, shape.blocks, reps, pipeline, profile)
        text = profile.report()
        if text is not None:
            out["profile_small"] = text
            print(text, file=sys.stderr)
        loop.close()
        pipe.send(("stop",))
        pipe.recv()
        proc.join(30)
        loop.ledger.log.close()
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


def _connect(torch: Any, ip: InProcess, pipe: PipeToP, transport: Any, layout: KVLayout, log_dir: str,
             out: dict[str, Any]) -> DecodeLoop:
    """D registers its regions, opens its ledger, maps P (timed: ``connect_s``) and prepares the plan."""
    fastpath.trace_stages(transport)
    transport.register(layout)
    ledger = open_ledger("target", ip.pool, log_dir + "/d", worker="d0")
    _, raw = pipe.recv()
    t0 = time.perf_counter()
    peer = transport.add_peer(msgspec.msgpack.decode(raw, type=PeerMetadata))
    out["connect_s"] = time.perf_counter() - t0
    out["connect"] = transport.peer_info(peer)
    pipe.send(("meta", msgspec.msgpack.encode(transport.local_metadata())))
    plan = transport.prepare(peer)
    return DecodeLoop(torch, ip, pipe, transport, ledger, peer, out["connect"]["epoch"], plan)


class SmallProfile:
    """``KVL_BENCH_PROFILE=1``: cProfile over the small shape's lone requests (``=batched``: its batched rounds,
    the first left out)."""

    def __init__(self) -> None:
        mode = envvars.BENCH_PROFILE.read()
        self.batched = mode == "batched"
        self.profile: Any = None
        if mode:
            import cProfile

            self.profile = cProfile.Profile()

    def start(self, label: str, batched: bool, first: bool = False) -> None:
        if self.profile is not None and label == "small" and self.batched == batched and not first:
            self.profile.enable()

    def stop(self) -> None:
        if self.profile is not None:
            self.profile.disable()

    def report(self) -> str | None:
        if self.profile is None:
            return None
        import io
        import pstats

        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("tottime").print_stats(25)
        return text.getvalue()[-5000:]


def _measure_shape(loop: DecodeLoop, label: str, n: int, reps: int, pipeline: int,
                   profile: SmallProfile) -> dict[str, Any]:
    loop.round(1, n, False)  # warm-up (kernel compile for this shape)
    loop.round(1, n, False)  # the first warm launch binds the compiled post
    out: dict[str, Any] = {f"{label}_compiled_post": fastpath.compiled_post_bound(loop.transport, loop.plan)}
    loop.steps.clear()
    loop.stages.clear()
    out |= _single_requests(loop, label, n, reps, profile)
    exact = out[f"{label}_exact"]
    piped = []
    for i in range(max(1, reps // 4)):
        w, _, _, ok, _ = loop.round(pipeline, n, verify=i == 0)
        piped.append(w)
        exact = exact and ok
    out[f"{label}_pipelined_wall_s"] = median(piped)
    batched = []  # the same requests as one scheduler step: one post_batch, one ledger step each way
    for i in range(max(1, reps // 4)):
        profile.start(label, batched=True, first=i == 0)
        w, _, _, ok, _ = loop.round(pipeline, n, verify=i == 0, batched=True)
        profile.stop()
        batched.append(w)
        exact = exact and ok
    out[f"{label}_batched_wall_s"] = median(batched)
    for kind, splits in loop.multi.items():
        out[f"{label}_{kind}_split_us"] = {k: round(float(np.median([x[k] for x in splits])) * 1e6, 1)
                                           for k in splits[0]}
    loop.multi.clear()
    out[f"{label}_exact"] = exact
    return out


def _single_requests(loop: DecodeLoop, label: str, n: int, reps: int, profile: SmallProfile) -> dict[str, Any]:
    """One request at a time, each followed by the contiguous copy timed at the same point of the loop (torch's
    ``copy_``, then the raw driver calls): walls, device time, P's round trips and the median step split."""
    out: dict[str, Any] = {}
    walls, kernels, trips, exact, in_loop, in_loop_raw = [], [], [], True, [], []
    stats0: dict[str, Any] = {}
    for i in range(reps):
        profile.start(label, batched=False)
        w, k, rt, ok, stats0 = loop.round(1, n, verify=i in (0, reps - 1))
        profile.stop()
        in_loop.append(loop.round(1, n, False, ceiling="torch")[0])  # the ceiling, same loop, next round
        in_loop_raw.append(loop.round(1, n, False, ceiling="driver")[0])
        walls.append(w)
        kernels.append(k)
        trips += rt
        exact = exact and ok
    out[f"{label}_wall_s"] = median(walls)
    out[f"{label}_ceiling_in_loop_wall_s"] = median(in_loop)
    out[f"{label}_ceiling_in_loop_driver_wall_s"] = median(in_loop_raw)
    out[f"{label}_kernel_s"] = median(kernels)
    out[f"{label}_roundtrip_s"] = median(trips)
    out[f"{label}_exact"] = exact
    out[f"{label}_stats"] = stats0
    steps, stages = loop.steps, loop.stages
    parts = np.median(np.array(steps), axis=0) * 1e6 if steps else [float("nan")] * len(STEP_NAMES)
    out[f"{label}_steps_us"] = dict(zip(STEP_NAMES, (round(float(x), 1) for x in parts), strict=True))
    out[f"{label}_post_us"] = float(parts[1])
    if stages:
        out[f"{label}_post_stages_us"] = {k: round(float(np.median([x[k] for x in stages])), 1) for k in stages[0]}
    return out
