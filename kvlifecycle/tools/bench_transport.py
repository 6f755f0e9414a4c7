"""``kvlifecycle bench transport``: raw NIXL calls vs kvlifecycle's NIXL transport with ledgers and logs on.

Two processes per pair (P and D), DRAM, one request = 64 regions × 128 blocks × 16 KiB (128 MiB) read by D in one
NIXL READ. Both pairs run in the same invocation and alternate transfer by transfer, so drift hits both alike.
- raw: ``make_prepped_xfer`` + ``transfer`` + ``check_xfer_state`` polling, P polling notifications;
- kvl: ``TargetLedger.reserve`` + ``Consumer.pull`` (claim heartbeat over the side channel, READ on the transport's
  service thread, completion notification to P, ``part_done``) with both event logs on, timed until D's load settled.
Also: T_post / T_xfer percentiles from NIXL telemetry, the first transfer vs the steady state, and the CPU an idle
worker burns with UCX's progress thread off (kvlifecycle's default) and on.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle.tools.progress import progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--iterations", type=int, default=21, help="transfers per side (first one included)")
    parser.add_argument("--regions", type=int, default=64, help="KV regions per side")
    parser.add_argument("--blocks", type=int, default=128, help="blocks per region")
    parser.add_argument("--block-bytes", type=int, default=16384, help="bytes per block per region")
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="how long to sample idle CPU")
    parser.add_argument("--keep", default=None, help="keep the event logs in this directory")
    parser.add_argument("--verify", choices=["none", "sample", "all"], default="none",
                        help="also time a kvlifecycle pair with per-block digests on (P digests, D re-reads what "
                             "landed), in the same run: verify_ratio = verified / unverified time")


class RawWorker:
    """Plain NIXL, the way a connector would call it without kvlifecycle (progress thread off, as ours)."""

    def __init__(self, cfg: Any) -> None:
        import torch

        from kvlifecycle import layout as L
        from kvlifecycle.transport import KVLayout, MemoryKind
        from kvlifecycle.transports.nixl_agent import make_agent

        self.cfg = cfg
        self._L = L
        gen = torch.Generator().manual_seed(cfg.seed)
        shape = (cfg.blocks, cfg.block_bytes)
        if cfg.side == "producer":
            self.kv = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(cfg.regions)]
        else:
            self.kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(cfg.regions)]
        self.layout = KVLayout(MemoryKind.DRAM, 0, cfg.blocks, tuple(t.data_ptr() for t in self.kv),
                               tuple(cfg.block_bytes for _ in self.kv))
        self.agent = make_agent(cfg.name, list(cfg.backends), progress_thread=cfg.prog_thread, capture_telemetry=True,
                                require_backends=False)
        self.reg = self.agent.register_memory(
            [(a, n, 0, "") for a, n in zip(self.layout.base_addrs, self.layout.region_bytes, strict=True)], "DRAM")
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", L.block_descs(self.layout), "DRAM")
        self.notifs = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        if cfg.side == "producer":  # P must progress (notifications, UCX over tcp) while D reads
            self._thread = threading.Thread(target=self._poll_notifs, daemon=True)
            self._thread.start()

    def _poll_notifs(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                got = self.agent.get_new_notifs()
            self.notifs += sum(len(v) for v in got.values())
            time.sleep(0.001)

    def hello(self) -> dict[str, Any]:
        import msgspec

        from kvlifecycle.transport import LayoutWire

        with self._lock:
            blob = self.agent.get_agent_metadata()
        return {"blob": bytes(blob), "layout": msgspec.to_builtins(LayoutWire.of(self.layout))}

    def connect(self, blob: bytes, layout: dict) -> None:
        import msgspec

        from kvlifecycle.transport import LayoutWire

        remote = msgspec.convert(layout, LayoutWire).to_layout()
        self.peer = self.agent.add_remote_agent(blob)
        self.agent.make_connection(self.peer)
        self.remote = self.agent.prep_xfer_dlist(self.peer, self._L.block_descs(remote), "DRAM")

    def bench_one(self, blocks: list[int]) -> dict[str, Any]:
        ids = np.asarray(blocks, dtype=np.int32)
        t0 = time.perf_counter()
        desc = self._L.desc_ids(ids, self.cfg.blocks, self.cfg.regions)
        handle = self.agent.make_prepped_xfer("READ", self.local, desc, self.remote, desc, b"raw")
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + 60
        while state == "PROC" and time.monotonic() < deadline:
            state = self.agent.check_xfer_state(handle)
        wall = time.perf_counter() - t0
        tel = self.agent.get_xfer_telemetry(handle)
        self.agent.release_xfer_handle(handle)
        return {"wall_s": wall, "ok": state == "DONE", "t_post_s": tel.postDuration / 1e6,
                "t_xfer_s": tel.xferDuration / 1e6, "bytes": int(tel.totalBytes), "descs": int(tel.descCount)}

    def digest(self, blocks: list[int]) -> str:
        import hashlib

        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        h = hashlib.sha256()
        for t in self.kv:
            h.update(t[idx].contiguous().numpy().tobytes())
        return h.hexdigest()

    def idle_cpu(self, seconds: float = 2.0) -> float:
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.monotonic() - w0)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.join(5)
        with self._lock:  # tear down in order, so nothing NIXL owns is alive at interpreter exit
            for name in ("remote", "local"):
                handle = getattr(self, name, None)
                if handle is not None:
                    self.agent.release_dlist_handle(handle)
            if getattr(self, "peer", None):
                self.agent.remove_remote_agent(self.peer)
            self.agent.deregister_memory(self.reg)
        return {}


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.tools.workers import WorkerConfig, WorkerProcess

    iters = max(3, args.iterations)
    size = {"regions": args.regions, "blocks": args.blocks, "block_bytes": args.block_bytes}
    logs = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvl-bench-"))
    blocks = list(range(args.blocks))
    workers: list[WorkerProcess] = []
    with progress("bench transport", iters + 2, json_output=args.json) as tick:
        try:
            rp = WorkerProcess(WorkerConfig("producer", "raw-p", seed=11, **size), RawWorker)
            rd = WorkerProcess(WorkerConfig("consumer", "raw-d", **size), RawWorker)
            kp = WorkerProcess(WorkerConfig("producer", "kvl-p", seed=11, log_dir=str(logs / "p"), fsync="10ms",
                                            **size))
            kd = WorkerProcess(WorkerConfig("consumer", "kvl-d", log_dir=str(logs / "d"), fsync="10ms", **size))
            workers += [rp, rd, kp, kd]
            rd.call("connect", rp.hello["blob"], rp.hello["layout"])
            addr = kp.hello["address"]
            kd.call("connect", addr)
            verifying = args.verify != "none"
            if verifying:  # the same pair with digests on, timed in the same loop
                vp = WorkerProcess(WorkerConfig("producer", "ver-p", seed=11, verify=args.verify, **size))
                vd = WorkerProcess(WorkerConfig("consumer", "ver-d", verify=args.verify, **size))
                workers += [vp, vd]
                vd.call("connect", vp.hello["address"])
            raw: list[dict[str, Any]] = []
            kvl: list[dict[str, Any]] = []
            ver: list[dict[str, Any]] = []
            for i in range(iters):
                if verifying:
                    vgrant = vp.call("alloc_grant", f"bench-{i}", blocks)
                    ver.append(vd.call("bench_one", f"bench-{i}", vp.hello["address"], vgrant, blocks))
                    deadline = time.monotonic() + 30
                    while not vp.call("free_released") and time.monotonic() < deadline:
                        time.sleep(0.001)
                grant = kp.call("alloc_grant", f"bench-{i}", blocks)
                if i % 2:  # alternate which side goes first, so an ordering effect cancels out
                    raw.append(rd.call("bench_one", blocks))
                    kvl.append(kd.call("bench_one", f"bench-{i}", addr, grant, blocks))
                else:
                    kvl.append(kd.call("bench_one", f"bench-{i}", addr, grant, blocks))
                    raw.append(rd.call("bench_one", blocks))
                tick(f"transfer {i + 1} of {iters}")
                deadline = time.monotonic() + 30
                while not kp.call("free_released") and time.monotonic() < deadline:
                    time.sleep(0.001)
            exact = (rp.call("digest", blocks) == rd.call("digest", blocks)
                     and kp.call("digest", blocks) == kd.call("digest", blocks)
                     and (not verifying or vp.call("digest", blocks) == vd.call("digest", blocks)))
            idle_off = kp.call("idle_cpu", args.idle_seconds)
            idle_raw_d = rd.call("idle_cpu", args.idle_seconds)
            tick("idle CPU, progress thread on")
            for w in workers:
                w.stop()
            workers.clear()
            # the same kvlifecycle worker with UCX's progress thread on, connected, idle
            pon = WorkerProcess(WorkerConfig("producer", "on-p", prog_thread=True, **size))
            don = WorkerProcess(WorkerConfig("consumer", "on-d", prog_thread=True, **size))
            workers += [pon, don]
            don.call("connect", pon.hello["address"])
            idle_on = pon.call("idle_cpu", args.idle_seconds)
            tick()
        finally:
            for w in workers:
                w.stop()
            if not args.keep:
                shutil.rmtree(logs, ignore_errors=True)
    steady_raw = [r["wall_s"] for r in raw[1:]]
    steady_kvl = [r["wall_s"] for r in kvl[1:]]
    raw_s, kvl_s = float(np.median(steady_raw)), float(np.median(steady_kvl))
    nbytes = args.regions * args.blocks * args.block_bytes
    result = {
        "request_bytes": nbytes,
        "iterations": iters,
        "raw_s": raw_s,
        "kvl_s": kvl_s,
        "ratio": kvl_s / raw_s,
        "raw_total_s": float(sum(steady_raw)),
        "kvl_total_s": float(sum(steady_kvl)),
        "raw_gbps": nbytes / raw_s / 1e9,
        "kvl_gbps": nbytes / kvl_s / 1e9,
        "t_post_p50_us": _pct([r["t_post_s"] * 1e6 for r in kvl[1:]], 50),
        "t_post_p90_us": _pct([r["t_post_s"] * 1e6 for r in kvl[1:]], 90),
        "t_post_p99_us": _pct([r["t_post_s"] * 1e6 for r in kvl[1:]], 99),
        "t_xfer_p50_us": _pct([r["t_xfer_s"] * 1e6 for r in kvl[1:]], 50),
        "t_xfer_p90_us": _pct([r["t_xfer_s"] * 1e6 for r in kvl[1:]], 90),
        "t_xfer_p99_us": _pct([r["t_xfer_s"] * 1e6 for r in kvl[1:]], 99),
        "raw_t_post_p50_us": _pct([r["t_post_s"] * 1e6 for r in raw[1:]], 50),
        "raw_t_xfer_p50_us": _pct([r["t_xfer_s"] * 1e6 for r in raw[1:]], 50),
        "first_s": kvl[0]["wall_s"],
        "first_over_steady": kvl[0]["wall_s"] / kvl_s,
        "raw_first_over_steady": raw[0]["wall_s"] / raw_s,
        "descs_per_transfer": kvl[-1]["descs"],
        "backend": kvl[-1].get("backend", ""),
        "idle_cpu_prog_thread_off": idle_off,
        "idle_cpu_prog_thread_on": idle_on,
        "idle_cpu_raw_agent": idle_raw_d,
        "all_ok": all(r["ok"] for r in raw + kvl + ver) and exact,
    }
    if ver:
        ver_s = float(np.median([r["wall_s"] for r in ver[1:]]))
        result.update({"verify": args.verify, "verify_s": ver_s, "verify_ratio": ver_s / kvl_s,
                       "verify_gbps": nbytes / ver_s / 1e9, "verified_parts": ver[-1]["verified"]})
        result["all_ok"] = result["all_ok"] and (args.verify == "sample" or ver[-1]["verified"] == len(ver))
    if args.json:
        print(json.dumps(result))
    else:
        mib = nbytes / 2**20
        print(f"transport bench: {iters} transfers per side of {args.regions} regions × {args.blocks} blocks × "
              f"{args.block_bytes // 1024} KiB = {mib:.0f} MiB, two processes, DRAM, {result['backend']}")
        print(f"  raw NIXL           median {raw_s * 1e3:8.2f} ms  ({result['raw_gbps']:.2f} GB/s)")
        print(f"  kvlifecycle NIXL   median {kvl_s * 1e3:8.2f} ms  ({result['kvl_gbps']:.2f} GB/s), ledgers + logs on")
        print(f"  ratio kvl/raw      {result['ratio']:.3f}  (target ≤ 1.10)")
        print(f"  T_post  p50/p90/p99 {result['t_post_p50_us']:.0f} / {result['t_post_p90_us']:.0f} / "
              f"{result['t_post_p99_us']:.0f} µs   T_xfer p50/p90/p99 {result['t_xfer_p50_us']:.0f} / "
              f"{result['t_xfer_p90_us']:.0f} / {result['t_xfer_p99_us']:.0f} µs")
        print(f"  first transfer     {result['first_s'] * 1e3:.2f} ms = {result['first_over_steady']:.2f}× steady "
              f"(target ≤ 2×; raw {result['raw_first_over_steady']:.2f}×)")
        print(f"  idle worker CPU    prog thread off {idle_off * 100:.1f}% of a core, on {idle_on * 100:.1f}% "
              f"(raw agent, off: {idle_raw_d * 100:.1f}%)")
        if ver:
            print(f"  verified ({args.verify})     median {result['verify_s'] * 1e3:8.2f} ms  "
                  f"({result['verify_gbps']:.2f} GB/s), verify_ratio {result['verify_ratio']:.3f} "
                  f"(verified / unverified kvlifecycle, same run)")
        print(f"  bytes exact        {'yes' if result['all_ok'] else 'NO'}")
    return 0 if result["all_ok"] else 1
