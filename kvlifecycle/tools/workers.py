"""The two-process harness: a P or D worker in a process of its own (:class:`WorkerProcess`), answering commands
from the parent over a multiprocessing pipe as msgpack (:func:`worker_main`). The demo, ``kvlifecycle bench
transport`` and ``kvlifecycle bench load``, and the two-process and multi-host tests run their sides through it.

The worker class is handed in (:class:`HandoffWorker`, a ledger tied to the handoff over real NIXL in DRAM, or a
subclass with more commands: the load benchmark's batches, the streaming tests' layers, the multi-host tests'
membership); the harness never picks one by name.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec

COMMAND_TIMEOUT_S = 60.0
WORKER_MAX_LIFETIME_S = 600.0  # a backstop for a worker whose parent vanished without closing the pipe


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
    verify: str = "none"  # per-block digests (kvlifecycle.digest): none | sample | all
    max_lifetime_s: float = WORKER_MAX_LIFETIME_S


def default_compat(**over: Any) -> dict[str, Any]:
    base = {"model_id": "tiny-random-llama", "dtype": "bfloat16", "num_layers": 4, "num_kv_heads": 4,
            "head_size": 64, "block_size": 16, "kv_layout": "NHD", "tp_size": 1}
    base.update(over)
    return base


# --- the worker process ---------------------------------------------------------------------------------------------


class HandoffWorker:
    """One side (``cfg.side``: "producer" or "consumer") over real NIXL (or loopback) in DRAM: its KV tensors, its
    ledger and event log, and the handoff's Producer or Consumer; each public method is a command."""

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
                                 load_timeout_s=cfg.load_timeout_s, on_connect=on_connect, verify=cfg.verify)
        from kvlifecycle.transports.digest_host import HostDigester

        digester = HostDigester(layout) if options.verify != "none" else None
        side: SideName = "source" if cfg.side == "producer" else "target"
        extra = {"default_ttl_s": cfg.ttl_s} if side == "source" else {}
        self.ledger: Any = open_ledger(side, cfg.blocks, cfg.log_dir, fsync=cfg.fsync, worker=cfg.name, **extra)
        from kvlifecycle import logs, telemetry

        # OTel spans/metrics (to files when $KVL_OTEL_DIR is set; no-ops otherwise) and debug-level event logs
        self.telemetry = telemetry.instrument_from_env(self.ledger)
        logs.log_events(self.ledger)
        if isinstance(self.ledger, SourceLedger):
            self.role: Any = Producer(self.ledger, self.transport, compat, tp_rank=cfg.tp_rank, options=options,
                                      digester=digester)
        else:
            self.role = Consumer(self.ledger, self.transport, compat, tp_rank=cfg.tp_rank, options=options,
                                 digester=digester)

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
        if self.cfg.verify != "none":  # P's digests come with the grant D asks P for
            g = self.role.fetch_grant(address, g.request)
        self.ledger.reserve(request, blocks)
        self.role.pull(request, [(address, g)])
        self.role.wait_idle(60.0)
        wall = time.perf_counter() - t0
        self.ledger.listeners.remove(listen)
        ok = self.request_state(request) == "READY_FOR_ATTENTION"
        self.ledger.finish(request)
        obs = seen[0] if seen else None
        return {"wall_s": wall, "ok": ok, "verified": self.role.verified_parts,
                "t_post_s": obs.t_post_s if obs else None,
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


WorkerType = Callable[[WorkerConfig], Any]  # a class built from the config whose public methods are the commands


def worker_main(cfg_raw: bytes, conn: Connection, worker_type: WorkerType) -> None:
    """Entry point of a worker process: build ``worker_type(cfg)``, answer commands until ``stop`` or the pipe
    closes. ``worker_type`` must be importable by name in the child (a module-level class)."""
    cfg = WorkerConfig(**msgspec.msgpack.decode(cfg_raw))
    try:
        worker: Any = worker_type(cfg)
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
    """A ``worker_type`` worker in its own (spawned) process; :meth:`call` runs a command there with a bounded
    wait."""

    def __init__(self, cfg: WorkerConfig, worker_type: WorkerType = HandoffWorker, *,
                 start_timeout_s: float = COMMAND_TIMEOUT_S) -> None:
        ctx = mp.get_context("spawn")
        self.cfg = cfg
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(msgspec.msgpack.encode(asdict(cfg)), child, worker_type),
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


class BlockPool:
    """A parent's allocator for one side's blocks: blocks go out per request and come back when the side frees them,
    so any number of requests runs through a pool of any size."""

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
