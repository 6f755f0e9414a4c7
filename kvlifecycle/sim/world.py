"""The simulated cluster: P workers (in TP groups) and D workers, each a real ledger with its event log in a
directory, a simulated transport over tagged memory, an engine (allocator, prefill, frees, finishes) and the
protocol core of :mod:`kvlifecycle.sim.protocol_driver`; one network, one fabric, one global clock.

Crashes: a worker's log loses its unwritten batch and its last segment may be torn at a seeded byte; the worker
comes back on the same name with a fresh ledger (a new incarnation) appending to the same log, a new agent epoch,
and its KV memory wiped.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvlifecycle.clock import ManualClock
from kvlifecycle.ledger import BlockBusyError, SourceLedger, TargetLedger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.sim import storage
from kvlifecycle.sim.clock import NodeClock
from kvlifecycle.sim.coverage import LedgerWatch
from kvlifecycle.sim.memory import tag_bytes
from kvlifecycle.sim.messages import GrantArrived, GrantInfo, NoteMsg
from kvlifecycle.sim.network import Network
from kvlifecycle.sim.protocol_driver import ConsumerCore, ProducerCore, deliver
from kvlifecycle.sim.transport import SimFabric, SimTransport, sim_layout


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The shape of a simulated cluster and run."""

    p_groups: tuple[int, ...] = (2, 1)  # TP width of each prefill instance: (2, 1) = P0+P1 (TP 2) and P2
    d_workers: int = 2
    p_blocks: int = 12
    d_blocks: int = 12
    regions: int = 2
    block_bytes: int = 64  # a multiple of 16 x the widest TP group
    ttl_s: float = 2.0
    max_requests: int = 10
    steps: int = 140
    # The lease protocol assumes a transfer settles within its lease: a transfer older than this fails (the data
    # plane's per-transfer timeout). None: no bound, and a read can outlive its lease (see docs/simulation.md).
    transfer_deadline_s: float | None = 1.0
    # P's service thread runs a queued push before time moves on (it polls every ms); False lets a lease expire
    # between the push request and the write's post (see docs/simulation.md)
    prompt_jobs: bool = True
    faults: frozenset[str] = frozenset()  # empty: every injectable fault (see faults.INJECTABLE)
    drain_rounds: int = 60

    def allows(self, fault: str) -> bool:
        return not self.faults or fault in self.faults


@dataclass(slots=True)
class PRequest:
    blocks: np.ndarray
    phase: str  # allocated | prefilled | granted
    d: str = ""
    mode: str = "pull"
    grants: int = 0


class PWorker:
    def __init__(self, world: World, name: str, index: int, rank: int, ranks: int, group: int) -> None:
        self.world, self.name, self.index, self.rank, self.ranks, self.group = world, name, index, rank, ranks, group
        cfg = world.config
        self.clock = NodeClock(world.clock, drift=world.drift(name))
        self.dir = world.root / name
        self.layout, self.regions = sim_layout(world.fabric, regions=cfg.regions, blocks=cfg.p_blocks,
                                               block_bytes=cfg.block_bytes)
        self.boots = 0
        self.requests: dict[str, PRequest] = {}
        self.free_list: list[int] = list(range(cfg.p_blocks - 1, -1, -1))
        self.boot()

    def boot(self) -> None:
        self.boots += 1
        cfg = self.world.config
        ledger = SourceLedger(cfg.p_blocks, worker=self.name, clock=self.clock, hlc=self.clock.hlc(self.clock.drift),
                              default_ttl_s=cfg.ttl_s)
        ledger.incarnation = self.world.incarnation(self.name, self.boots)
        ledger.log, torn = storage.reopen(self.dir, ledger.header())
        if torn:
            self.world.exercise("torn_tail")
        self.ledger = ledger
        self.watch = LedgerWatch(ledger, self.world.coverage)
        self.world.watches.append(self.watch)
        self.transport = SimTransport(self.name, self.world.fabric, epoch=self.boots)
        self.transport.register(self.layout)
        self.core = ProducerCore(ledger, self.transport, self.world.sender(self.name))

    def crash(self, tear: float | None) -> None:
        self.world.fabric.fail_to(self.name, f"{self.name} crashed")
        storage.crash(self.ledger.log)
        if tear is not None:
            storage.tear_tail(self.dir, tear)
        self.transport.close()
        self.world.network.forget_node(self.name, keep=lambda payload: isinstance(payload, NoteMsg))
        self.watch.detach()
        self.world.crashed_requests += len(self.ledger.requests)
        for region in self.regions:
            region[:] = 0
        self.requests.clear()
        self.free_list = list(range(self.world.config.p_blocks - 1, -1, -1))
        self.boot()

    # -- engine -----------------------------------------------------------------------------------------------------
    def allocate(self, request: str, n: int) -> bool:
        if len(self.free_list) < n:
            return False
        blocks = np.array(self.free_list[-n:][::-1], dtype=np.int32)
        try:
            self.ledger.allocate(request, blocks)
        except BlockBusyError:  # the eager allocator offered a block a lease still pins: the ledger refused it
            self.world.exercise("allocator_reuse")
            return False
        del self.free_list[-n:]
        if any(int(b) in self.world.recently_freed.get(self.name, set()) for b in blocks):
            self.world.exercise("allocator_reuse")
        self.requests[request] = PRequest(blocks, "allocated")
        return True

    def release_eagerly(self, request: str) -> None:
        """The engine aborted ``request`` and hands its blocks to the allocator at once (vLLM frees on abort):
        the ledger must refuse them while a lease still pins them."""
        req = self.requests.get(request)
        if req is not None:
            self._give_back(req.blocks.tolist())

    def _give_back(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self.free_list:
                self.free_list.append(b)  # LIFO: the allocator hands these out next, at once
        self.world.recently_freed.setdefault(self.name, set()).update(blocks)

    def prefill(self, request: str) -> None:
        req = self.requests[request]
        ledger = self.ledger
        epoch = ledger.requests[request].epoch
        for r, region in enumerate(self.regions):
            for b in req.blocks.tolist():
                region[b] = tag_bytes(self.index, r, self.transport.epoch, b, epoch, self.world.config.block_bytes)
        ledger.prefill_done(request)
        req.phase = "prefilled"

    def grant(self, request: str, d: str, mode: str) -> GrantInfo:
        req = self.requests[request]
        g = self.ledger.grant(request, consumers=1, ttl_s=self.world.config.ttl_s)
        info = GrantInfo(g.request, g.transfer, g.generation, g.worker, tuple(g.block_ids.tolist()), g.consumers,
                         g.ttl_s, self.transport.agent, self.transport.epoch, g.epoch, self.rank, self.ranks)
        self.core.publish(info)
        req.phase, req.d, req.mode = "granted", d, mode
        req.grants += 1
        self.world.network.send(self.name, d, GrantArrived(info, mode), self.world.clock.now())
        return info

    def service(self, cache: bool = False) -> None:
        self.core.service()
        for released in self.ledger.take_released():
            req = self.ledger.requests.get(released.request)
            if req is not None and not req.leases:
                self.ledger.free(released.request, cache=cache)
        self.ledger.commit()

    def reconcile(self) -> None:
        for request in [r for r in self.requests if r not in self.ledger.requests]:
            self._give_back(self.requests.pop(request).blocks.tolist())


@dataclass(slots=True)
class Arrival:
    grants: dict[int, GrantInfo] = field(default_factory=dict)
    ranks: int = 1
    mode: str = "pull"
    since: float = 0.0


class DWorker:
    def __init__(self, world: World, name: str, policy: str) -> None:
        self.world, self.name, self.policy = world, name, policy
        cfg = world.config
        self.clock = NodeClock(world.clock, drift=world.drift(name))
        self.dir = world.root / name
        self.layout, self.regions = sim_layout(world.fabric, regions=cfg.regions, blocks=cfg.d_blocks,
                                               block_bytes=cfg.block_bytes)
        self.boots = 0
        self.arrivals: dict[str, Arrival] = {}
        self.expect: dict[str, tuple[str, list[GrantInfo], int]] = {}  # D transfer -> (request, grants, epoch)
        self.blocks: dict[str, np.ndarray] = {}
        self.free_list: list[int] = list(range(cfg.d_blocks - 1, -1, -1))
        self.boot()

    def boot(self) -> None:
        self.boots += 1
        cfg = self.world.config
        ledger = TargetLedger(cfg.d_blocks, worker=self.name, clock=self.clock, hlc=self.clock.hlc(self.clock.drift),
                              failure_policy=self.policy)
        ledger.incarnation = zlib.crc32(f"{self.name}/{self.boots}".encode())
        ledger.log, torn = storage.reopen(self.dir, ledger.header())
        if torn:
            self.world.exercise("torn_tail")
        self.ledger = ledger
        self.watch = LedgerWatch(ledger, self.world.coverage, on_ready=self._on_ready)
        self.world.watches.append(self.watch)
        self.transport = SimTransport(self.name, self.world.fabric, epoch=self.boots)
        self.transport.register(self.layout)
        cfg = self.world.config
        self.core = ConsumerCore(ledger, self.transport, self.world.sender(self.name), block_bytes=cfg.block_bytes,
                                 request_timeout_s=cfg.ttl_s / 4, load_timeout_s=cfg.ttl_s * 5)

    def crash(self, tear: float | None) -> None:
        known = [(link.agent, self.world.p_by_name[link.agent]) for link in self.core.links.values()]
        self.world.fabric.fail_to(self.name, f"{self.name} crashed")
        storage.crash(self.ledger.log)
        if tear is not None:
            storage.tear_tail(self.dir, tear)
        self.transport.close()
        self.world.network.forget_node(self.name, keep=lambda payload: isinstance(payload, NoteMsg))
        self.watch.detach()
        self.world.crashed_requests += len(self.ledger.requests)
        self.arrivals.clear()
        self.blocks.clear()
        self.expect.clear()
        self.free_list = list(range(self.world.config.d_blocks - 1, -1, -1))
        for region in self.regions:
            region[:] = 0
        self.boot()
        for agent, p in known:  # a restarted D handshakes again: P releases the leases its old self claimed
            self.core.connect(agent, p.rank, p.ranks, push=True)

    def _on_ready(self, request: str) -> None:
        self.world.on_ready(self, request)

    # -- engine -----------------------------------------------------------------------------------------------------
    def on_grant(self, msg: GrantArrived) -> None:
        g = msg.grant
        if g.request in self.ledger.requests or g.request in self.world.d_ended.get(self.name, set()):
            return  # a duplicate of a grant already admitted (or of a request already gone)
        arrival = self.arrivals.setdefault(g.request, Arrival(ranks=g.ranks, mode=msg.mode,
                                                              since=self.world.clock.now()))
        arrival.grants[g.rank] = g

    def admit(self, request: str) -> bool:
        arrival = self.arrivals.get(request)
        if arrival is None or len(arrival.grants) < arrival.ranks:
            return False
        n = len(arrival.grants[0].block_ids)
        if len(self.free_list) < n:
            return False
        del self.arrivals[request]
        blocks = np.array([self.free_list.pop() for _ in range(n)], dtype=np.int32)
        epoch = self.ledger.reserve(request, blocks)
        self.blocks[request] = blocks
        grants = [arrival.grants[r] for r in range(arrival.ranks)]
        self.world.exercise(arrival.mode)
        if len(grants) > 1:
            self.world.exercise("tp_handles")
        transfer = grants[0].transfer if len(grants) == 1 else f"{request}<-" + "+".join(g.transfer for g in grants)
        self.expect[transfer] = (request, grants, epoch)
        self.core.start(request, grants, arrival.mode)
        return True

    def give_up(self, request: str) -> None:
        """The engine stops waiting for a request whose grants did not all arrive (never reserved here)."""
        self.arrivals.pop(request, None)
        self.world.d_ended.setdefault(self.name, set()).add(request)

    def reconcile(self) -> None:
        for request in [r for r in self.blocks if r not in self.ledger.requests]:
            self.free_list.extend(self.blocks.pop(request).tolist())
            self.world.d_ended.setdefault(self.name, set()).add(request)

    def waiting_reserved(self) -> list[str]:
        """Requests RESERVED with no load in flight (a load failed under policy recompute, or was abandoned)."""
        loading = {load.request for load in self.core.loads.values()}
        return [r for r, req in self.ledger.requests.items()
                if req.state == TargetState.RESERVED and r not in loading]


class World:
    def __init__(self, config: SimConfig, root: Path, seed: int, drift: bool = True) -> None:
        self.config, self.root, self.seed = config, root, seed
        self.clock = ManualClock(1000.0)
        self.network = Network()
        self.fabric = SimFabric(note_sink=self._note, now=self.clock.now)
        self.coverage: Counter[str] = Counter()
        self.watches: list[LedgerWatch] = []
        self.crashed_requests = 0
        self.recently_freed: dict[str, set[int]] = {}
        self.d_ended: dict[str, set[str]] = {}
        self.violations: list[str] = []
        self.ready_checked = 0
        self._drift = drift
        self.on_ready_hook: Callable[[DWorker, str], None] | None = None
        self.p: list[PWorker] = []
        index = 0
        for g, width in enumerate(config.p_groups):
            for rank in range(width):
                self.p.append(PWorker(self, f"P{index}", index, rank, width, g))
                index += 1
        self.p_by_name = {w.name: w for w in self.p}
        self.groups = [[w for w in self.p if w.group == g] for g in range(len(config.p_groups))]
        self.d = [DWorker(self, f"D{i}", "fail" if i % 2 == 0 else "recompute") for i in range(config.d_workers)]
        self.d_by_name = {w.name: w for w in self.d}
        if drift:
            self.exercise("clock_drift")

    def incarnation(self, name: str, boots: int) -> int:
        """A worker's incarnation (in its transfer ids): new on every start, reproducible from the seed."""
        return zlib.crc32(f"{name}/{boots}".encode())

    def drift(self, name: str) -> float:
        if not self._drift:
            return 0.0
        return ((zlib.crc32(f"{self.seed}/{name}".encode()) % 2001) - 1000) * 1e-6  # within ±1000 ppm

    def exercise(self, fault: str) -> None:
        self.coverage[f"fault: {fault}"] += 1

    def sender(self, node: str) -> Callable[[str, object], None]:
        return lambda dst, payload: self.network.send(node, dst, payload, self.clock.now())

    def _note(self, sender: str, receiver: str, note) -> None:
        self.network.send(sender, receiver, NoteMsg(note), self.clock.now())

    def node(self, name: str) -> PWorker | DWorker | None:
        return self.p_by_name.get(name) or self.d_by_name.get(name)

    def deliver(self, msg) -> None:
        node = self.node(msg.dst)
        if node is None:
            return
        if isinstance(msg.payload, GrantArrived):
            assert isinstance(node, DWorker)
            node.on_grant(msg.payload)
            return
        deliver(node.core, msg.src, msg.payload)

    def on_ready(self, d: DWorker, request: str) -> None:
        if self.on_ready_hook is not None:
            self.on_ready_hook(d, request)

    def reconcile(self) -> None:
        for w in self.p:
            w.reconcile()
        for d in self.d:
            d.reconcile()

    def ledgers(self) -> list[SourceLedger | TargetLedger]:
        return [w.ledger for w in self.p] + [d.ledger for d in self.d]

    def close(self) -> None:
        for w in [*self.p, *self.d]:
            w.ledger.commit()
            w.ledger.log.close()


def p_phase(w: PWorker, request: str) -> str:
    """Where a P request is, for the cancel fault's label."""
    req = w.ledger.requests.get(request)
    if req is None:
        return "after"
    if not req.leases:
        return "after" if w.requests.get(request) and w.requests[request].phase == "granted" else "before_grant"
    lease = w.ledger.leases[req.leases[0]]
    if not lease.claimed:
        return "granted"
    reading = any(x.handle.transfer == lease.transfer for x in w.world.fabric.in_flight)
    if reading:
        return "in_flight"
    done_in_flight = any(getattr(m.payload, "note", None) is not None and m.payload.note.transfer == lease.transfer
                         for m in w.world.network.in_flight)
    return "racing_completion" if done_in_flight else "claimed"


def d_phase(d: DWorker, request: str) -> str:
    req = d.ledger.requests.get(request)
    if req is None:
        return ""
    return {TargetState.RESERVED: "reserved", TargetState.LOADING: "loading",
            TargetState.READY_FOR_ATTENTION: "ready"}.get(TargetState(req.state), "")


__all__ = ["DWorker", "PWorker", "SimConfig", "SourceState", "World", "d_phase", "p_phase"]
