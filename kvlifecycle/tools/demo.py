"""``kvlifecycle demo``: P and D in two processes on 127.0.0.1, NIXL over DRAM, a few requests handed off by pull and
by push, bytes checked, both event logs written, replayed and checked.

The worker processes here (:func:`worker_main`, driven through :class:`WorkerProcess`) are also what the two-process
tests and ``kvlifecycle bench transport`` use. Commands travel over a multiprocessing pipe as msgpack.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

COMMAND_TIMEOUT_S = 60.0
WORKER_MAX_LIFETIME_S = 600.0  # a backstop for a worker whose parent vanished without closing the pipe
WORKER_SECONDS_PER_REQUEST = 1.0  # the demo's lifetime budget per request, far above what one takes


@dataclass
class WorkerConfig:
    side: str  # "producer" | "consumer"
    name: str
    regions: int = 8
    blocks: int = 64
    block_bytes: int = 4096
    seed: int = 0
    log_dir: str | None = None
    tp_rank: int = 0
    port: int = 0
    host: str = "127.0.0.1"  # the side channel's bind address (a host's own address across hosts)
    secret: str | None = None
    ttl_s: float = 30.0
    unit_bytes: int = 0
    backends: list[str] = field(default_factory=lambda: ["UCX"])
    transport: str = "nixl"
    compat: dict[str, Any] = field(default_factory=dict)
    heartbeat_every_s: float | None = None
    load_timeout_s: float = 60.0
    fsync: str = "never"
    prog_thread: bool = False
    iterations: int = 0
    max_lifetime_s: float = WORKER_MAX_LIFETIME_S


def default_compat(**over: Any) -> dict[str, Any]:
    base = {"model_id": "tiny-random-llama", "dtype": "bfloat16", "num_layers": 4, "num_kv_heads": 4,
            "head_size": 64, "block_size": 16, "kv_layout": "NHD", "tp_size": 1}
    base.update(over)
    return base


# --- the worker process ---------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        import torch

        from kvlifecycle.choices import SideName
        from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
        from kvlifecycle.handshake import CompatInfo
        from kvlifecycle.ledger import SourceLedger, open_ledger
        from kvlifecycle.transport import KVLayout, MemoryKind

        self.cfg = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        shape = (cfg.blocks, cfg.block_bytes)
        if cfg.side == "producer":
            self.kv = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen) for _ in range(cfg.regions)]
        else:
            self.kv = [torch.zeros(shape, dtype=torch.uint8) for _ in range(cfg.regions)]
        layout = KVLayout(MemoryKind.DRAM, 0, cfg.blocks, tuple(t.data_ptr() for t in self.kv),
                          tuple(cfg.block_bytes for _ in self.kv))
        if cfg.transport == "nixl":
            from kvlifecycle.transports.nixl import NixlTransport

            self.transport: Any = NixlTransport(cfg.name, backends=cfg.backends, enable_prog_thread=cfg.prog_thread)
        else:
            from kvlifecycle.transports.loopback import LoopbackTransport

            self.transport = LoopbackTransport(cfg.name)
        self.transport.register(layout)
        compat = CompatInfo(**(cfg.compat or default_compat()))
        on_connect = None
        if cfg.transport == "nixl" and cfg.side == "consumer":
            from kvlifecycle.transports import select

            selection = select.choose(MemoryKind.DRAM, MemoryKind.DRAM, "same_node",
                                      available=self.transport.loaded_backends())
            select.verify_backend(self.transport, selection)

            def on_connect(_link: Any, probe: Any) -> None:
                select.on_selected(selection, probe)

        options = HandoffOptions(secret=cfg.secret.encode() if cfg.secret else None, host=cfg.host, port=cfg.port,
                                 unit_bytes=cfg.unit_bytes, heartbeat_every_s=cfg.heartbeat_every_s,
                                 load_timeout_s=cfg.load_timeout_s, on_connect=on_connect)
        side: SideName = "source" if cfg.side == "producer" else "target"
        extra = {"default_ttl_s": cfg.ttl_s} if side == "source" else {}
        self.ledger: Any = open_ledger(side, cfg.blocks, cfg.log_dir, fsync=cfg.fsync, worker=cfg.name, **extra)
        from kvlifecycle import logs, telemetry

        # OTel spans/metrics (to files when $KVL_OTEL_DIR is set; no-ops otherwise) and debug-level event logs
        self.telemetry = telemetry.instrument_from_env(self.ledger)
        logs.log_events(self.ledger)
        if isinstance(self.ledger, SourceLedger):
            self.role: Any = Producer(self.ledger, self.transport, compat, tp_rank=cfg.tp_rank, options=options)
        else:
            self.role = Consumer(self.ledger, self.transport, compat, tp_rank=cfg.tp_rank, options=options)

    # -- commands ---------------------------------------------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        out = {"agent": self.transport.agent, "epoch": self.transport.epoch, "pid": os.getpid()}
        if self.cfg.side == "producer":
            out["address"] = self.role.address
        return out

    def digest(self, blocks: list[int], offset: int = 0, length: int = 0) -> str:
        import torch

        idx = torch.tensor(blocks, dtype=torch.long)
        h = hashlib.sha256()
        for t in self.kv:
            rows = t[idx]
            rows = rows[:, offset: offset + length] if length else rows[:, offset:]
            h.update(rows.contiguous().numpy().tobytes())
        return h.hexdigest()

    def alloc_grant(self, request: str, blocks: list[int], consumers: int = 1, ttl_s: float | None = None) -> dict:
        self.ledger.allocate(request, blocks)
        self.ledger.prefill_done(request)
        return msgspec.to_builtins(self.role.grant(request, consumers=consumers, ttl_s=ttl_s))

    def free_released(self) -> list[list[str]]:
        out = []
        for rel in self.ledger.take_released():
            self.ledger.free(rel.request)
            out.append([rel.request, rel.transfer, rel.reason])
        return out

    def lease(self, transfer: str) -> dict[str, Any] | None:
        lease = self.ledger.leases.get(transfer)
        return None if lease is None else {"done": sorted(lease.done), "consumers": lease.consumers}

    def connect(self, address: str, push: bool = True) -> dict[str, Any]:
        link = self.role.connect(address, push=push)
        return {"agent": link.agent, "epoch": link.epoch, "parts": link.plan.parts,
                "consumers": link.plan.consumers_per_p_rank,
                "probe_gbps": link.probe.gbps if link.probe else None,
                "probe_backend": link.probe.backend if link.probe else None}

    def reserve(self, request: str, blocks: list[int]) -> None:
        self.ledger.reserve(request, blocks)

    def pull(self, request: str, grants: list[list[Any]]) -> str:
        from kvlifecycle.handoff import GrantReply

        pairs = [(addr, msgspec.convert(g, GrantReply)) for addr, g in grants]
        return self.role.pull(request, pairs)

    def push(self, request: str, grant: dict, address: str) -> str:
        from kvlifecycle.handoff import GrantReply

        return self.role.request_push(request, msgspec.convert(grant, GrantReply), address=address)

    def pull_then_die(self, request: str, grants: list[list[Any]]) -> None:
        """Tests: start a pull and exit the process as soon as the READ is posted (mid-transfer)."""
        transfer = self.pull(request, grants)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            load = self.role._loads.get(transfer)
            if load is None or load.handles:
                break
            time.sleep(0)
        os._exit(9)

    def wait(self, timeout_s: float = 30.0) -> bool:
        return bool(self.role.wait_idle(timeout_s))

    def abandoned(self) -> dict[str, str]:
        return dict(self.role.abandoned)

    def finish(self, request: str) -> None:
        self.ledger.finish(request)

    def state(self) -> dict[str, Any]:
        led = self.ledger
        out = {"counts": led.counts(), "stats": dict(led.stats), "refusals": dict(led.refusals)}
        if self.cfg.side == "producer":
            out["leases"] = sorted(led.leases)
            out["refused_side"] = dict(self.role.server.refused)
        else:
            out["loads"] = sorted(led.loads)
        return out

    def request_state(self, request: str) -> str | None:
        req = self.ledger.requests.get(request)
        if req is None:
            return None
        names = set(self.ledger.counts())  # state names
        del names
        from kvlifecycle.machines import SourceState, TargetState

        enum = SourceState if self.cfg.side == "producer" else TargetState
        return enum(int(self.ledger.state[req.blocks[0]])).name

    def idle_cpu(self, seconds: float = 2.0) -> float:
        """CPU seconds this process burns per wall second while idle (all threads)."""
        c0, w0 = time.process_time(), time.monotonic()
        time.sleep(seconds)
        return (time.process_time() - c0) / (time.monotonic() - w0)

    def bench_one(self, request: str, address: str, grant: dict, blocks: list[int]) -> dict[str, Any]:
        """Benchmarks: reserve + pull + wait until the load settled, timed in this process."""
        from kvlifecycle import events as ev
        from kvlifecycle.handoff import GrantReply

        seen: list[Any] = []

        def listen(event: Any) -> None:
            if isinstance(event, ev.TransferObserved):
                seen.append(event)

        self.ledger.listeners.append(listen)
        g = msgspec.convert(grant, GrantReply)
        t0 = time.perf_counter()
        self.ledger.reserve(request, blocks)
        self.role.pull(request, [(address, g)])
        self.role.wait_idle(60.0)
        wall = time.perf_counter() - t0
        self.ledger.listeners.remove(listen)
        ok = self.request_state(request) == "READY_FOR_ATTENTION"
        self.ledger.finish(request)
        obs = seen[0] if seen else None
        return {"wall_s": wall, "ok": ok, "t_post_s": obs.t_post_s if obs else None,
                "t_xfer_s": obs.t_xfer_s if obs else None, "bytes": obs.nbytes if obs else 0,
                "descs": obs.descriptors if obs else 0, "backend": obs.backend if obs else ""}

    def sweep(self) -> list[str]:
        return self.ledger.sweep()

    def stop(self) -> dict[str, Any]:
        self.role.close()
        self.transport.close()
        if self.ledger.log is not None:
            self.ledger.log.close()
        return {"registered": self.transport.registered_regions()}


def worker_main(cfg_raw: bytes, conn: Connection, worker_type: type | None = None) -> None:
    """Entry point of a worker process: build the side, answer commands until ``stop`` or the pipe closes.
    ``worker_type``: a subclass of the worker with more commands (the multi-host tests add membership)."""
    cfg = WorkerConfig(**msgspec.msgpack.decode(cfg_raw))
    try:
        if worker_type is not None:
            worker: Any = worker_type(cfg)
        elif cfg.side.startswith("raw"):
            from kvlifecycle.tools.bench_transport import RawWorker

            worker = RawWorker(cfg)
        elif cfg.side.startswith("load-"):
            from kvlifecycle.tools.bench_load import LoadWorker

            worker = LoadWorker(cfg)
        else:
            worker = _Worker(cfg)
    except BaseException as exc:
        conn.send_bytes(msgspec.msgpack.encode({"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                                "trace": traceback.format_exc()}))
        return
    conn.send_bytes(msgspec.msgpack.encode({"ok": True, "value": worker.hello()}))
    deadline = time.monotonic() + cfg.max_lifetime_s
    while time.monotonic() < deadline:
        if not conn.poll(1.0):
            continue
        try:
            name, args, kwargs = msgspec.msgpack.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break
        try:
            value = getattr(worker, name)(*args, **kwargs)
            reply = {"ok": True, "value": value}
        except BaseException as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        conn.send_bytes(msgspec.msgpack.encode(reply))
        if name == "stop":
            break


class WorkerError(RuntimeError):
    pass


class WorkerProcess:
    """A worker in its own (spawned) process; :meth:`call` runs a command there with a bounded wait."""

    def __init__(self, cfg: WorkerConfig, *, start_timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(msgspec.msgpack.encode(asdict(cfg)), child),
                                name=cfg.name, daemon=True)
        self.proc.start()
        child.close()
        self.hello = self._reply(start_timeout_s, "start")

    def _reply(self, timeout_s: float, what: str) -> Any:
        if not self.conn.poll(timeout_s):
            raise WorkerError(f"{self.cfg.name}: no answer to {what} in {timeout_s}s")
        try:
            reply = msgspec.msgpack.decode(self.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            raise WorkerError(f"{self.cfg.name}: process gone during {what} (exit code {self.proc.exitcode})") from exc
        if not reply["ok"]:
            raise WorkerError(f"{self.cfg.name}: {what} failed: {reply['error']}\n{reply.get('trace', '')}")
        return reply["value"]

    def call(self, name: str, *args: Any, timeout_s: float = COMMAND_TIMEOUT_S, **kwargs: Any) -> Any:
        self.conn.send_bytes(msgspec.msgpack.encode([name, list(args), kwargs]))
        return self._reply(timeout_s, name)

    def stop(self, timeout_s: float = 30.0) -> Any:
        try:
            return self.call("stop", timeout_s=timeout_s) if self.proc.is_alive() else None
        finally:
            self.proc.join(timeout_s)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


# --- the demo ---------------------------------------------------------------------------------------------------------


MAX_DEMO_POOL_BYTES = 4 << 30  # per side: the demo registers regions × blocks × block bytes of DRAM on each
DEMO_BLOCKS_PER_REQUEST = 8
RECLAIM_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=None, help="directory for the two event logs (default: a temp dir)")
    parser.add_argument("--requests", type=int, default=4, help="requests per mode (pull and push)")
    parser.add_argument("--regions", type=int, default=8, help="KV regions (layers × K/V)")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per region")
    parser.add_argument("--block-bytes", type=int, default=16384, help="bytes per block per region")
    parser.add_argument("--transport", choices=["nixl"], default="nixl")


def _not_installed(*modules: str) -> list[str]:
    """Which of ``modules`` cannot be imported here (looked up, not imported: the parent process needs neither)."""
    import importlib.util

    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def refuse_arguments(args: argparse.Namespace) -> str:
    """Why the demo cannot run with these arguments (one line), or ""."""
    for name in ("requests", "regions", "blocks", "block_bytes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    pool = args.regions * args.blocks * args.block_bytes
    if pool > MAX_DEMO_POOL_BYTES:
        return (f"--regions × --blocks × --block-bytes = {pool / 2**30:.1f} GiB per side, more than the demo's "
                f"{MAX_DEMO_POOL_BYTES >> 30} GiB")
    return ""


class BlockPool:
    """The demo's allocator for one side: blocks go out per request and come back when the side frees them, so any
    number of requests runs through a pool of any size (one request in flight needs ``per`` blocks)."""

    def __init__(self, num_blocks: int) -> None:
        self.free: list[int] = list(range(num_blocks))
        self.held: dict[str, list[int]] = {}

    def take(self, request: str, n: int) -> list[int] | None:
        if len(self.free) < n:
            return None
        blocks, self.free = self.free[:n], self.free[n:]
        self.held[request] = blocks
        return blocks

    def give_back(self, request: str) -> None:
        self.free += self.held.pop(request, [])


def _reclaim(p: WorkerProcess, pool: BlockPool, released: list[Any], *, until_free: int, until_all: int = 0) -> None:
    """Free P's released requests and return their blocks to ``pool`` (bounded wait) until ``until_free`` blocks
    are free, or ``until_all`` releases were seen in total."""
    deadline = time.monotonic() + RECLAIM_TIMEOUT_S
    while time.monotonic() < deadline:
        for request, *_ in (fresh := p.call("free_released")):
            pool.give_back(request)
        released += fresh
        if len(pool.free) >= until_free and len(released) >= until_all:
            return
        if not fresh:
            time.sleep(0.005)


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.replay import check, check_pair, replay, summary

    missing = _not_installed("nixl", "torch")  # both worker processes need them: say so here, not in a traceback
    if missing:
        print(f"kvlifecycle demo moves KV over NIXL and needs {' and '.join(missing)}, not installed here: "
              "pip install 'kvlifecycle[transports]' torch (pin torch's CPU wheel, see README)", file=sys.stderr)
        return 2

    refused = refuse_arguments(args)
    if refused:
        print(f"kvlifecycle demo: {refused}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvl-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    p_log, d_log = out / "p0", out / "d0"
    total = 2 * args.requests
    common = {"regions": args.regions, "blocks": args.blocks, "block_bytes": args.block_bytes,
              "max_lifetime_s": WORKER_MAX_LIFETIME_S + WORKER_SECONDS_PER_REQUEST * total}
    t0 = time.monotonic()
    p = WorkerProcess(WorkerConfig("producer", "p0", log_dir=str(p_log), seed=7, **common))
    d = WorkerProcess(WorkerConfig("consumer", "d0", log_dir=str(d_log), **common))
    verbose = total <= 16  # one line per request for a short demo; progress lines for a long one
    ok = True
    moved = granted = 0
    released: list[Any] = []
    try:
        addr = p.hello["address"]
        link = d.call("connect", addr)
        if link["probe_gbps"] is not None:
            print(f"  connected d0 -> p0 (agent epoch {link['epoch']}), probe {link['probe_gbps']:.2f} GB/s "
                  f"over {link['probe_backend']}")
        per = max(1, min(args.blocks // 4, DEMO_BLOCKS_PER_REQUEST))
        src_pool, dst_pool = BlockPool(args.blocks), BlockPool(args.blocks)
        for i in range(total):
            mode = "pull" if i < args.requests else "push"
            request = f"req-{mode}-{i}"
            src = src_pool.take(request, per)
            if src is None:  # P's blocks come back once their lease is released and P freed them
                _reclaim(p, src_pool, released, until_free=per)
                src = src_pool.take(request, per)
            dst = dst_pool.take(request, per)
            if src is None or dst is None:
                print(f"{request}: no free blocks after {RECLAIM_TIMEOUT_S:.0f} s (earlier requests never "
                      "released theirs)", file=sys.stderr)
                ok = False
                break
            grant = p.call("alloc_grant", request, src)
            granted += 1
            d.call("reserve", request, dst)
            if mode == "pull":
                d.call("pull", request, [[addr, grant]])
            else:
                d.call("push", request, grant, addr)
            if not d.call("wait", 30.0):
                print(f"{request}: load did not settle in 30 s", file=sys.stderr)
                ok = False
                continue
            same = p.call("digest", src) == d.call("digest", dst)
            ok &= same
            moved += per * args.regions * args.block_bytes
            state = d.call("request_state", request)
            if verbose or not same or state != "READY_FOR_ATTENTION":
                print(f"  {request:<14} {mode:<4} {per} blocks × {args.regions} regions: bytes "
                      f"{'match' if same else 'DIFFER'}, D blocks {state}")
            elif (i + 1) % max(1, total // 10) == 0:
                print(f"  {i + 1}/{total} requests handed off, bytes match")
            if state is not None:
                d.call("finish", request)
            dst_pool.give_back(request)
        _reclaim(p, src_pool, released, until_free=0, until_all=granted)
        ok &= not src_pool.held and len(released) == granted == total
    finally:
        d.stop()
        p.stop()
    results = [replay(p_log), replay(d_log)]
    problems = [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]
    for r in results:
        s = summary(r)
        print(f"  log {r.header.get('worker')} ({s['side']}): {s['events']} events, stats {s['stats']}, "
              f"refusals {s['refusals'] or 'none'}")
    ok &= not problems
    for line in problems:
        print(f"  VIOLATION {line}")
    print(f"demo {'OK' if ok else 'FAILED'}: {total} requests ({args.requests} pull, "
          f"{args.requests} push), {moved / 2**20:.1f} MiB moved, logs in {out}, {time.monotonic() - t0:.1f}s")
    return 0 if ok else 1
