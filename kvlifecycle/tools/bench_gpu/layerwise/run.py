"""The verb: one run of every mode at every prompt length, side by side, and the JSON it prints.

Per prompt length, each repetition runs the modes back to back in a rotating order, over fresh block ids and
fresh inputs: ``stream`` (each layer's K and V posted after that layer, ordered on the device), ``post`` (every
layer's K and V in one post after the last layer: the post-prefill copy of the same bytes) and ``compute`` (the
prefill alone, so what streaming costs the prefill shows); on a GPU also ``stream_host`` (each layer's post made
by a thread of its own once the layer's event completed, as the vLLM adapter's streamer does for NIXL) and
``stream_device`` (the same thread posting at once, the layer's event handed to the transport's ``post_after``: the
streamer's path over CUDA IPC). The first
``--check-reps`` repetitions of each mode poison D's target blocks and P's source blocks first and compare, layer
by layer, SHA-256 digests of P's and D's blocks after it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle.transport import Notification, XferStatus

from .model import ModelShape, PrefillStandIn, caches_layout, digests, layer_regions, poison, vllm_caches

MODES = ("stream", "post", "compute")
# with --ab-launch-cache: streaming again with the transport's kept per-layer launches dropped before every post
# (each post rebuilds its launch, as posts of a region subset did before launches were kept), side by side
STREAMING = ("stream", "stream_rebuilt")
HOST_WAIT = "stream_host"  # on a GPU: the layer's post waits on the host for the layer's event (ThreadPoster)
DEVICE_WAIT = "stream_device"  # on a GPU: that thread hands the event to post_after instead (no host wait)
THREADED = (HOST_WAIT, DEVICE_WAIT)
GOAL_T_VISIBLE_RATIO = 0.2  # streaming's T_visible at most 0.2x the post-prefill copy's
WAIT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ModelShape()
    parser.add_argument("--tokens", default="512,1536,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=d.layers, help="model layers")
    parser.add_argument("--kv-heads", type=int, default=d.kv_heads, help="KV heads per layer")
    parser.add_argument("--head-size", type=int, default=d.head_size, help="elements per head")
    parser.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    parser.add_argument("--hidden", type=int, default=d.hidden, help="hidden size of the stand-in forward")
    parser.add_argument("--ffn", type=int, default=d.ffn, help="FFN size of the stand-in forward")
    parser.add_argument("--pool-blocks", type=int, default=0, help="blocks per layer cache (default: 2x the largest)")
    parser.add_argument("--reps", type=int, default=10, help="repetitions per mode and length (median reported)")
    parser.add_argument("--check-reps", type=int, default=2, help="repetitions per mode whose bytes are checked")
    parser.add_argument("--cpu", action="store_true", help="run on CPU over NIXL/DRAM (the harness without a GPU)")
    parser.add_argument("--ab-launch-cache", action="store_true",
                        help="also stream with each post's launch rebuilt (the kept launches' A/B, same run)")
    parser.add_argument("--profile", action="store_true",
                        help="add a cProfile of one streaming prefill at the shortest prompt (host time per call)")
    parser.add_argument("--out", help="also write the JSON object to this file")


def _shape(args: argparse.Namespace, tokens: list[int]) -> ModelShape:
    blocks = max(-(-t // args.block_size) for t in tokens)
    return ModelShape(args.layers, args.kv_heads, args.head_size, args.block_size, args.hidden, args.ffn,
                      args.pool_blocks or 2 * blocks)


class Target:
    """D's process (:mod:`.target`) and the pipe to it."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        from .target import d_main

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=d_main, args=(child, cfg), daemon=True)
        self.proc.start()

    def recv(self) -> Any:
        if not self.conn.poll(WAIT_S):
            raise RuntimeError(f"D's process did not answer within {WAIT_S} s")
        kind, value = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"D's process failed:\n{value}")
        return value

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(RuntimeError, OSError, EOFError):
                self.ask("stop")
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


class Harness:
    """P (this process): the prefill stand-in over P's caches, the transport, and D's process."""

    def __init__(self, torch: Any, shape: ModelShape, device: Any) -> None:
        import msgspec

        from kvlifecycle.transport import PeerMetadata

        from .ordering import CudaOrder, HostOrder, ThreadPoster

        self.torch, self.shape, self.device = torch, shape, device
        self.caches = vllm_caches(torch, shape, device)
        self.model = PrefillStandIn(torch, shape, device, seed=1)
        on_gpu = device.type == "cuda"
        fastpath: Any = _fastpath() if on_gpu else None  # the GPU-only module, loaded only on a GPU
        self.target = Target({"shape": shape.as_dict(), "device": str(device), "spin": on_gpu})
        try:
            if on_gpu:
                self.transport: Any = fastpath.CudaIpcTransport(f"layerwise-p-{os.getpid()}")
            else:
                from kvlifecycle.transports.nixl import NixlTransport

                self.transport = NixlTransport(f"layerwise-p-{os.getpid()}")
            self.transport.register(caches_layout(self.caches))
            d_meta = msgspec.msgpack.decode(self.target.recv(), type=PeerMetadata)
            self.peer = self.transport.add_peer(d_meta)
            self.target.conn.send(msgspec.msgpack.encode(self.transport.local_metadata()))
            self.plan = self.transport.prepare(self.peer)
            self.order: Any = (CudaOrder(torch, device, fastpath.transfer_stream(self.transport)) if on_gpu
                               else HostOrder(torch))
            self.posters: dict[str, Any] = {} if not on_gpu else {
                mode: ThreadPoster(torch, device, fastpath.transfer_stream(self.transport), WAIT_S,
                                   device_order=mode == DEVICE_WAIT) for mode in THREADED}
        except BaseException:
            self.target.close()
            raise
        self.rng = np.random.default_rng(11)
        self.runs = self.hops = 0

    def close(self) -> None:
        for poster in self.posters.values():
            poster.close()
        self.target.close()
        self.transport.close()

    def prefill(self, mode: str, tokens: int, *, check: bool) -> dict[str, Any]:
        """One prefill of ``tokens`` in ``mode``; its timings (ms) and, when checked, whether D's bytes are P's."""
        torch, order, shape = self.torch, self.order, self.shape
        self.runs += 1
        n = shape.blocks_for(tokens)
        p_ids = self.rng.choice(shape.pool_blocks, n, replace=False).astype(np.int32)
        d_ids = self.rng.choice(shape.pool_blocks, n, replace=False).astype(np.int32)
        transfer = f"run{self.runs}"
        if check:
            self.target.ask("poison", d_ids.tolist())
        handles, ends, marks = [], [], []
        forward_s: list[float] = []  # the forward thread's time per post: ordering + the transport's post
        note = Notification(transfer, transfer, self.runs, kind="done")
        t_start = time.perf_counter()
        with order.computing():  # the ids and inputs too: made on the stream that uses them
            p_dev = torch.as_tensor(p_ids, dtype=torch.long).to(self.device)
            x = self.model.inputs(n * shape.block_size, seed=self.runs)
            if check:
                poison(self.caches, p_dev)  # a copy that ran ahead of its layer would carry this to D
            start = order.mark()
            for layer in range(shape.layers):
                x = self.model.layer(x, self.caches[layer], p_dev)
                marks.append(order.mark())
                if mode in STREAMING:
                    last = layer == shape.layers - 1
                    t0 = time.perf_counter()
                    if mode == "stream_rebuilt":
                        _fastpath().forget_subset_launches(self.transport, self.plan)
                    handle, end = order.post_after(marks[-1], lambda layer=layer, last=last: self.transport.post(
                        "WRITE", self.plan, p_ids, d_ids, regions=layer_regions(layer),
                        notification=note if last else None, transfer=transfer))
                    forward_s.append(time.perf_counter() - t0)
                    handles.append(handle)
                    ends.append(end)
                elif mode in THREADED:
                    last = layer == shape.layers - 1
                    t0 = time.perf_counter()
                    self.posters[mode].queue_post(lambda after, layer=layer, last=last: self._layer_post(
                        after, p_ids, d_ids, layer, note if last else None, transfer))
                    forward_s.append(time.perf_counter() - t0)
            if mode == "post":
                t0 = time.perf_counter()
                handle, end = order.post_after(marks[-1], lambda: self.transport.post(
                    "WRITE", self.plan, p_ids, d_ids, notification=note, transfer=transfer))
                forward_s.append(time.perf_counter() - t0)
                handles.append(handle)
                ends.append(end)
        t_issued = time.perf_counter()
        computed_at = 0.0
        if mode in THREADED:  # block as a forward thread waiting on the device would: the GIL free for the poster
            marks[-1].synchronize()
            computed_at = time.perf_counter()
            for handle, end in self.posters[mode].take(shape.layers):
                handles.append(handle)
                ends.append(end)
        t_computed, t_landed, post_s = self._wait(marks[-1], handles, computed_at)
        out: dict[str, Any] = {"prefill_ms": order.elapsed_ms(start, marks[-1]),
                               "issue_ms": (t_issued - t_start) * 1e3}
        if handles:
            out["post_host_us"] = statistics.median(post_s) * 1e6
            out["forward_post_us"] = statistics.median(forward_s) * 1e6
            out["t_visible_wall_ms"] = (t_landed - t_computed) * 1e3
            arrival = self.target.ask("arrival", transfer)
            out["t_visible_d_ms"] = None if arrival is None else (arrival - t_computed) * 1e3
            out["hop_after_ms"] = self.notification_hop_ms(1)  # the side channel alone, right after this run
            if order.device_clock:
                out["t_visible_ms"] = order.elapsed_ms(marks[-1], ends[-1])
                out["e2e_ms"] = order.elapsed_ms(start, ends[-1])
            else:
                out["t_visible_ms"] = out["t_visible_wall_ms"]
                out["e2e_ms"] = out["prefill_ms"] + out["t_visible_wall_ms"]
        else:
            order.synchronize()
        if check and handles:
            out["byte_exact"] = digests(torch, self.caches, p_dev) == self.target.ask("digest", d_ids.tolist())
        return out

    def _layer_post(self, after: Any, p_ids: np.ndarray, d_ids: np.ndarray, layer: int, note: Notification | None,
                    transfer: str) -> Any:
        """A layer's post from a poster's thread: ordered after ``after`` on the device, or plain (None)."""
        kwargs = {"regions": layer_regions(layer), "notification": note, "transfer": transfer}
        if after is not None:
            return self.transport.post_after(after, "WRITE", self.plan, p_ids, d_ids, **kwargs)
        return self.transport.post("WRITE", self.plan, p_ids, d_ids, **kwargs)

    def _wait(self, last_mark: Any, handles: list[Any], computed_at: float = 0.0) -> tuple[float, float, list[float]]:
        """Spin as a worker would while the prefill runs: retire each layer's copy once it is done (in order: the
        copies run on one stream) and note when the last layer's work is seen done (unless ``computed_at`` says)
        and when the last copy is. Returns (t_computed, t_landed, the posts' host times in seconds)."""
        order, transport = self.order, self.transport
        deadline = time.monotonic() + WAIT_S
        t_computed, t_landed = computed_at, 0.0
        pending = list(handles)
        post_s: list[float] = []
        while not (t_computed and t_landed):
            if not t_computed and order.done(last_mark):
                t_computed = time.perf_counter()
            while pending:
                status = transport.poll(pending[0])
                if status is XferStatus.PENDING:
                    break
                if status is not XferStatus.DONE:
                    raise RuntimeError(f"copy failed: {transport.error(pending[0])}")
                handle = pending.pop(0)
                if not pending:
                    t_landed = time.perf_counter()
                stats = transport.stats(handle)  # settles: the last copy's notification goes out here
                post_s.append(stats.t_post_s if stats is not None else float("nan"))
                transport.release(handle)
            if not handles:
                t_landed = t_landed or time.perf_counter()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(pending)} copies not done within {WAIT_S} s")
        return t_computed, max(t_landed, t_computed), post_s

    def notification_hop_ms(self, reps: int) -> float | None:
        """P's notification → its arrival on D's host clock, nothing copied: the side channel's own share of
        what D sees (median)."""
        hops = []
        for _ in range(reps):
            self.hops += 1
            transfer = f"hop{self.hops}"
            t_sent = time.perf_counter()
            self.transport.send_notification(self.peer, Notification(transfer, transfer, self.hops, kind="hop"))
            arrival = self.target.ask("arrival", transfer)
            if arrival is not None:
                hops.append((arrival - t_sent) * 1e3)
        return statistics.median(hops) if hops else None

    def contiguous_copy_ms(self, nbytes: int, reps: int) -> float | None:
        """One device copy of ``nbytes`` contiguous bytes, CUDA events, median (None on CPU)."""
        torch = self.torch
        if self.device.type != "cuda":
            return None
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        times = []
        for _ in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        del src, dst
        return statistics.median(times[1:])


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    tokens = [int(t) for t in str(args.tokens).split(",") if t]
    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("kvlifecycle bench gpu-layerwise needs a CUDA device (or --cpu); "
                         "torch.cuda.is_available() is False here")
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    shape = _shape(args, tokens)
    res: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "transport": "cuda_ipc" if device.type == "cuda" else "nixl",
        "torch": torch.__version__, "shape": shape.as_dict(), "reps": args.reps, "check_reps": args.check_reps,
        "tokens": tokens,
    }
    harness = Harness(torch, shape, device)
    try:
        modes = (*MODES, *THREADED) if device.type == "cuda" else MODES
        modes = (*modes, "stream_rebuilt") if args.ab_launch_cache and device.type == "cuda" else modes
        for mode in modes:  # warm-up: every kernel (the per-layer region subsets too) compiled and bound
            harness.prefill(mode, tokens[0], check=False)
        per_tokens = {}
        for t in tokens:
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
            for rep in range(args.reps):
                for i in range(len(modes)):
                    mode = modes[(rep + i) % len(modes)]
                    runs[mode].append(harness.prefill(mode, t, check=rep < args.check_reps))
            per_tokens[str(t)] = _summary(shape, t, runs) | {
                "contiguous_copy_ms": harness.contiguous_copy_ms(shape.request_bytes(t), args.reps)}
        res["notification_hop_ms"] = harness.notification_hop_ms(max(args.reps, 5))
        if args.profile:
            res["profile_stream"] = _profile(lambda: harness.prefill("stream", tokens[0], check=False))
    finally:
        harness.close()
    res["per_tokens"] = per_tokens
    longest = per_tokens[str(max(tokens))]
    res["t_visible_ms_stream"] = longest["stream"]["t_visible_ms"]
    res["t_visible_ms_post"] = longest["post"]["t_visible_ms"]
    res["t_visible_ratio"] = longest["t_visible_ratio"]
    if HOST_WAIT in longest:
        res["t_visible_ms_stream_host"] = longest[HOST_WAIT]["t_visible_ms"]
        res["t_visible_ratio_host"] = longest["t_visible_ratio_host"]
    if DEVICE_WAIT in longest:
        res["t_visible_ms_stream_device"] = longest[DEVICE_WAIT]["t_visible_ms"]
        res["t_visible_ratio_device"] = longest["t_visible_ratio_device"]
    res["byte_exact"] = all(p["byte_exact"] for p in per_tokens.values())
    res["goal"] = {"t_visible_ratio_max": GOAL_T_VISIBLE_RATIO, "at_tokens": max(tokens),
                   "met": longest["t_visible_ratio"] <= GOAL_T_VISIBLE_RATIO,
                   "met_per_tokens": {t: p["t_visible_ratio"] <= GOAL_T_VISIBLE_RATIO for t, p in per_tokens.items()}}
    return res


def _fastpath() -> Any:
    from kvlifecycle.tools.bench_gpu import fastpath

    return fastpath


def _median(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _summary(shape: ModelShape, tokens: int, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    keys = ("prefill_ms", "issue_ms", "post_host_us", "forward_post_us", "t_visible_ms", "t_visible_wall_ms",
            "t_visible_d_ms", "hop_after_ms", "e2e_ms")
    out: dict[str, Any] = {"blocks": shape.blocks_for(tokens), "bytes": shape.request_bytes(tokens),
                           "layer_bytes": shape.request_bytes(tokens) // shape.layers}
    for mode, mode_runs in runs.items():
        out[mode] = {key: _median(mode_runs, key) for key in keys if any(key in r for r in mode_runs)}
    stream, post, compute = out["stream"], out["post"], out["compute"]
    out["t_visible_ratio"] = stream["t_visible_ms"] / post["t_visible_ms"]
    out["t_visible_wall_ratio"] = stream["t_visible_wall_ms"] / post["t_visible_wall_ms"]
    if stream.get("t_visible_d_ms") and post.get("t_visible_d_ms"):
        out["t_visible_d_ratio"] = stream["t_visible_d_ms"] / post["t_visible_d_ms"]
    out["e2e_ratio"] = stream["e2e_ms"] / post["e2e_ms"]  # prefill start -> D's blocks landed: the TTFT share
    out["prefill_slowdown_stream"] = stream["prefill_ms"] / compute["prefill_ms"]
    out["prefill_slowdown_post"] = post["prefill_ms"] / compute["prefill_ms"]
    if HOST_WAIT in out:  # the streamer's own ordering: a host wait on the layer's event, then the post
        host = out[HOST_WAIT]
        out["t_visible_ratio_host"] = host["t_visible_ms"] / post["t_visible_ms"]
        out["t_visible_wall_ratio_host"] = host["t_visible_wall_ms"] / post["t_visible_wall_ms"]
        out["prefill_slowdown_stream_host"] = host["prefill_ms"] / compute["prefill_ms"]
    if DEVICE_WAIT in out:  # the streamer's path over a transport that orders on the device: no host wait
        dev = out[DEVICE_WAIT]
        out["t_visible_ratio_device"] = dev["t_visible_ms"] / post["t_visible_ms"]
        out["t_visible_wall_ratio_device"] = dev["t_visible_wall_ms"] / post["t_visible_wall_ms"]
        out["prefill_slowdown_stream_device"] = dev["prefill_ms"] / compute["prefill_ms"]
    if "stream_rebuilt" in out:  # the kept launches' A/B: the forward thread's time per layer post, both ways
        rebuilt = out["stream_rebuilt"]
        out["forward_post_kept_over_rebuilt"] = stream["forward_post_us"] / rebuilt["forward_post_us"]
        out["prefill_kept_over_rebuilt"] = stream["prefill_ms"] / rebuilt["prefill_ms"]
    checked = [r["byte_exact"] for mode in runs for r in runs[mode] if "byte_exact" in r]
    out["checked_runs"] = len(checked)
    out["byte_exact"] = bool(checked) and all(checked)
    return out


def _profile(work: Any) -> str:
    """cProfile of ``work()``: the 25 functions with the most own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    work()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return text.getvalue()


def run(args: argparse.Namespace) -> int:
    res = measure(args)
    text = json.dumps(res, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    if getattr(args, "json", False):
        print(json.dumps(res))
    else:
        print(text)
    return 0 if res["byte_exact"] else 1


def main() -> int:  # pragma: no cover - ``python -m kvlifecycle.tools.bench_gpu.layerwise``
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    parser.add_argument("--json", action="store_true")
    return run(parser.parse_args())
