"""The simulated cluster: P workers (in TP groups) and D workers, each a real ledger with its event log in a
directory, a simulated transport over tagged memory, an engine (allocator, prefill, frees, finishes, prefix-cache
hits) and the real runtime: P runs :class:`~kvlifecycle.handoff.Producer` and D runs
:class:`~kvlifecycle.handoff.Consumer` (the simulated clock, side channel and transport injected through their
constructors' seams, their service loops turned by the scheduler), plus the real layer-wise stream code of
:mod:`kvlifecycle.sim.streams` (D reserves before P computes; P's chunked prefill posts each layer); one network,
one fabric, one global clock.

Crashes: a worker's log loses its unwritten batch and its last segment may be torn at a seeded byte; the worker
comes back on the same name with a fresh ledger (a new incarnation) appending to the same log, a new agent epoch,
and its KV memory wiped.

One concept, longer than most: the simulated cluster's state and its engine steps, which share the workers,
the network and the clock; faults, checks, streams and the peers' seams live beside it.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvlifecycle.choices import Choice, LoadFailurePolicy, TransferMode
from kvlifecycle.clock import ManualClock
from kvlifecycle.control import GetGrant, GrantReply, Heartbeat, PushRequest
from kvlifecycle.digest import VerifyMode
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.layout import tp_source_ranks
from kvlifecycle.ledger import BlockBusyError, SourceLedger, TargetLedger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.sidechannel import SideChannelError
from kvlifecycle.sim import storage
from kvlifecycle.sim.clock import NodeClock
from kvlifecycle.sim.corruption import SimDigester, verify_mode
from kvlifecycle.sim.coverage import LedgerWatch
from kvlifecycle.sim.memory import tag_bytes
from kvlifecycle.sim.messages import GrantArrived, GrantInfo, NoteMsg
from kvlifecycle.sim.network import Message, Network
from kvlifecycle.sim.peers import PeerReply, PeerRequest, SideChannels, SimPeerCalls, serve
from kvlifecycle.sim.staging import HOST, SimPool, staging_policy
from kvlifecycle.sim.streams import Loss, SimStreamConsumer, SimStreamProducer, reset_stream_ids
from kvlifecycle.sim.transport import SimFabric, SimTransport, sim_layout
from kvlifecycle.streaming import StreamOptions
from kvlifecycle.transport import Notification

HEADS = 2  # KV heads of the simulated model: a TP-2 group's ranks hold one each
RESTART_S = 0.05  # a crashed D's process is up again this long after (its first handshakes follow)


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The shape of a simulated cluster and run."""

    p_groups: tuple[int, ...] = (2, 1)  # TP width of each prefill instance: (2, 1) = P0+P1 (TP 2) and P2
    # TP width of each decode instance: (1, 1) = D0 and D1; (2, 1) = D0+D1 (TP 2: a TP-1 P rank's lease counts two
    # consumers, each reading its head slice) and D2. None: each seed draws one of those two (:func:`d_shape`)
    d_groups: tuple[int, ...] | None = None
    p_blocks: int = 12
    d_blocks: int = 12
    regions: int = 2
    block_bytes: int = 64  # a multiple of 16 x the widest TP group
    ttl_s: float = 2.0
    max_requests: int = 10
    steps: int = 140
    # A data-plane per-transfer timeout: a transfer older than this fails on its own. None (the default): no such
    # timeout, as with NIXL; the protocol itself bounds every transfer by its lease (kvlifecycle.protocol).
    transfer_deadline_s: float | None = None
    # P's service thread runs a queued push before time moves on (it polls every ms); False lets a lease expire
    # between the push request and the write's post (see docs/simulation.md)
    prompt_jobs: bool = True
    faults: frozenset[str] = frozenset()  # empty: every injectable fault (see faults.INJECTABLE)
    # P's digests and D's checks (kvlifecycle.digest). None: each seed draws (sim/corruption.py, verify_mode); a
    # mode set here is corrupted in flight whatever it is (with none, the READY tag check sees what lands wrong)
    verify: VerifyMode | None = None
    # whether releasing a running transfer stops it (NIXL) or not (CUDA IPC: the kernel runs to its end). None: each
    # seed draws (:func:`transports_cancel`)
    cancels_in_flight: bool | None = None
    drain_rounds: int = 60

    def allows(self, fault: str) -> bool:
        return not self.faults or fault in self.faults


D_SHAPES = ((1, 1), (2, 1))  # what a seed's decode side is when the config leaves it to the seed


def d_shape(config: SimConfig, seed: int) -> tuple[int, ...]:
    """The TP widths of the decode instances seed ``seed`` runs: the config's, else drawn from the seed alone (not
    from the scheduler's RNG: a replayed step list runs on the same shape)."""
    if config.d_groups is not None:
        return config.d_groups
    return D_SHAPES[zlib.crc32(f"{seed}/d-shape".encode()) % len(D_SHAPES)]


UNCANCELLABLE_EVERY = 8  # one seed in this many runs transports that cannot cancel a running copy


def transports_cancel(config: SimConfig, seed: int) -> bool:
    """Whether seed ``seed``'s KV transports stop a released copy: the config's, else drawn from the seed alone (one
    seed in :data:`UNCANCELLABLE_EVERY` runs CUDA IPC's rule), unless ``--faults`` left ``uncancellable`` out."""
    if config.cancels_in_flight is not None:
        return config.cancels_in_flight
    return not config.allows("uncancellable") or zlib.crc32(f"{seed}/cancel".encode()) % UNCANCELLABLE_EVERY != 0


class RequestMode(Choice):
    """How a simulated request's KV reaches D."""

    PULL = "pull"
    PUSH = "push"
    STREAM = "stream"  # layer-wise if D's reservation is here when the prefill begins, else the post-prefill push

    def granted_as(self) -> TransferMode:
        """The grant's mode: a stream-mode request that took the post-prefill path is granted for a push (its D may
        hold a declined stream's reservation for it)."""
        return TransferMode.PUSH if self is RequestMode.STREAM else TransferMode(self.value)


class PPhase(Choice):
    """Where a simulated P request is: allocated, prefilled, granted; a stream: allocated, streaming, streamed
    (or aborted)."""

    ALLOCATED = "allocated"
    PREFILLED = "prefilled"
    GRANTED = "granted"
    STREAMING = "streaming"
    STREAMED = "streamed"
    ABORTED = "aborted"


@dataclass(slots=True)
class PRequest:
    blocks: np.ndarray
    phase: PPhase
    d: str = ""  # the D rank(s) it was granted to
    mode: RequestMode = RequestMode.PULL
    grants: int = 0
    cursor: int = 0  # a stream: the (chunk, layer) passes computed so far


class PWorker:
    def __init__(self, world: World, name: str, index: int, rank: int, ranks: int, group: int) -> None:
        self.world, self.name, self.index, self.rank, self.ranks, self.group = world, name, index, rank, ranks, group
        cfg = world.config
        self.clock = NodeClock(world.clock, drift=world.drift(name))
        self.dir = world.root / name
        # a rank of a TP group holds its heads of every block: block_bytes / ranks
        self.block_bytes = cfg.block_bytes // ranks
        self.layout, self.regions = sim_layout(world.fabric, regions=cfg.regions, blocks=cfg.p_blocks,
                                               block_bytes=self.block_bytes)
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
        self.log, torn = storage.reopen(self.dir, ledger.header(), self.world.disk(self.name, self.boots))
        ledger.log = self.log
        if torn:
            self.world.exercise("torn_tail")
        self.ledger = ledger
        self.watch = LedgerWatch(ledger, self.world.coverage)
        self.world.watches.append(self.watch)
        self.transport = SimTransport(self.name, self.world.fabric, epoch=self.boots,
                                      cancels_in_flight=self.world.cancels)
        self.transport.register(self.layout)
        policy, world = self.world.staging, self.world
        self.pool = None if policy is None else SimPool(
            self.name, world.root / f"{self.name}{HOST}", world.fabric, policy, ledger, regions=cfg.regions,
            block_bytes=self.block_bytes, incarnation=world.incarnation(f"{self.name}{HOST}", self.boots),
            boots=self.boots, coverage=world.coverage)
        self.producer = Producer(ledger, self.transport, self.world.compat(self.ranks), tp_rank=self.rank,
                                 options=self.world.handoff_options,
                                 side_channel=self.world.channels.server_for(self.name), thread=False,
                                 staging=None if self.pool is None else self.pool.tier,
                                 digester=SimDigester(self.regions), slice_bytes=self.block_bytes)
        self.streams = SimStreamProducer(self.producer, layers=cfg.regions, options=self.world.stream_options)

    def crash(self, tear: float | None) -> None:
        if self.streams.busy():
            self.world.exercise("stream_p_crash")
        self.world.fabric.fail_to(self.name, f"{self.name} crashed")
        assert self.ledger.log is not None  # boot() opened it
        storage.crash(self.ledger.log, tear)
        self.transport.close()
        if self.pool is not None:  # its copies and reads fail, its memory is lost
            self.pool.crash(self.world.fabric, tear)
        self.world.network.forget_node(self.name, keep=lambda payload: isinstance(payload, NoteMsg))
        self.watch.detach()
        self.world.crashed_requests += len(self.ledger.requests)
        for region in self.regions:
            region[:] = 0
        self.requests.clear()
        self.free_list = list(range(self.world.config.p_blocks - 1, -1, -1))
        self.boot()

    # -- engine -----------------------------------------------------------------------------------------------------
    def allocate(self, request: str, n: int, mode: RequestMode = RequestMode.PULL) -> bool:
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
        self.requests[request] = PRequest(blocks, PPhase.ALLOCATED, mode=mode)
        return True

    def share_cached(self, request: str, n: int) -> bool:
        """A prefix-cache hit: ``request`` takes up to ``n`` PREFIX_CACHED blocks of one earlier allocation
        (``SourceLedger.share``: no new epoch, the bytes are already there)."""
        cached = [b for b in self.free_list if int(self.ledger.block_states([b])[0]) == int(SourceState.PREFIX_CACHED)]
        if not cached:
            return False
        epoch = int(self.ledger.epoch[cached[-1]])
        blocks = [b for b in reversed(cached) if int(self.ledger.epoch[b]) == epoch][:n]
        self.ledger.share(request, np.array(blocks, dtype=np.int32))
        for b in blocks:
            self.free_list.remove(b)
        self.world.exercise("prefix_share")
        self.requests[request] = PRequest(np.array(blocks, dtype=np.int32), PPhase.ALLOCATED)
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
        if req.mode is RequestMode.STREAM:
            if self.streams.begin(request):  # D's reservation is here: each layer leaves as computed
                req.phase = PPhase.STREAMING
                self.world.exercise("stream")
                return
            # the simulated prefill that does not stream is one step: it ends here, so a reservation arriving
            # later is declined (a reservation joining a prefill under way is not simulated)
            self.streams.prefill_ended(request)
            req.mode = RequestMode.PUSH  # the post-prefill path
        for r in range(len(self.regions)):
            self._compute(req, request, r, req.blocks)
        self.ledger.prefill_done(request)
        req.phase = PPhase.PREFILLED

    def _compute(self, req: PRequest, request: str, region: int, blocks: np.ndarray) -> None:
        epoch = self.ledger.requests[request].epoch
        share = HEADS // self.ranks  # this rank's heads of every block
        heads = range(self.rank * share, (self.rank + 1) * share)
        for b in blocks.tolist():
            self.regions[region][b] = tag_bytes(self.index, region, self.transport.epoch, b, epoch,
                                                self.block_bytes, heads)

    def stream_passes(self, req: PRequest) -> list[tuple[int, int]]:
        """A streaming prefill's (blocks complete, layer) passes: chunked in two for more than one block (the
        first chunk's layers post a prefix of the blocks, the last chunk's the rest), one layer (region) each."""
        n = req.blocks.size
        chunks = [(n + 1) // 2, n] if n > 1 else [n]
        return [(upto, layer) for upto in chunks for layer in range(len(self.regions))]

    def stream_layer(self, request: str) -> None:
        """The forward computed the next layer of a streaming prefill: its K/V written, ``layer_done`` queues the
        post; after the last layer of the last chunk the prefill is done and the engine releases the request
        (``StreamProducer.release``: P's blocks are freed once no write of them is in flight)."""
        req = self.requests[request]
        passes = self.stream_passes(req)
        upto, layer = passes[req.cursor]
        self._compute(req, request, layer, req.blocks[:upto])
        self.streams.layer_done(request, layer, req.blocks[:upto])
        req.cursor += 1
        if req.cursor == len(passes):
            self.ledger.prefill_done(request)
            req.phase = PPhase.STREAMED
            self.streams.release(request, lambda: self._free_streamed(request))

    def _free_streamed(self, request: str) -> None:
        if request in self.ledger.requests:
            self.ledger.free(request)

    def abort_stream(self, request: str) -> None:
        """The engine aborts a stream-mode request: no further layer; P's ledger drops it once its writes settled."""
        req = self.requests[request]
        if req.phase in (PPhase.STREAMING, PPhase.STREAMED):
            self.world.exercise("stream_cancel_p")
        req.phase = PPhase.ABORTED  # the engine computes no further layer of it
        self.streams.cancel(request)
        self.streams.release(request, lambda: self._cancel_settled(request))

    def _cancel_settled(self, request: str) -> None:
        if request in self.ledger.requests:
            self.ledger.cancel(request)

    def grant(self, request: str, ds: list[DWorker], mode: TransferMode) -> GrantInfo:
        """Grant ``request`` to the D instance of ranks ``ds``: the lease counts every D rank that reads this P rank
        (D TP > P TP: each reads its head slice of the same blocks), and the proxy carries the grant to each."""
        req = self.requests[request]
        readers = [d for d in ds if self.rank in tp_source_ranks(p_tp=self.ranks, d_tp=len(ds), d_rank=d.rank)]
        reply = self.producer.grant(request, consumers=len(readers), ttl_s=self.world.config.ttl_s)
        if self.world.verify is not VerifyMode.NONE:  # the grant as D fetches it (GetGrant): with P's digests
            fetched = self.world.channels.servers[self.name].handle(GetGrant(request))
            reply = fetched if isinstance(fetched, GrantReply) else reply
        lease = self.ledger.leases[reply.transfer]
        info = GrantInfo(reply.request, reply.transfer, reply.generation, reply.worker, tuple(reply.block_ids),
                         reply.consumers, reply.ttl_s, self.transport.agent, self.transport.epoch,
                         lease.epoch, self.rank, self.ranks)
        req.phase, req.d, req.mode = PPhase.GRANTED, "+".join(d.name for d in readers), RequestMode(mode.value)
        req.grants += 1
        if len(readers) > 1:
            self.world.exercise("two_consumer_lease")
        for d in readers:
            self.world.network.send(self.name, d.name, GrantArrived(info, mode, reply), self.world.clock.now())
        return info

    def service(self, cache: bool = False) -> None:
        if self.streams.step():
            self.world.exercise("stream_d_silent")
        with self.log.runtime_loop():
            self.producer.step_once()
        if self.pool is not None:
            self.pool.after_service()
        for released in self.ledger.take_released():
            req = self.ledger.requests.get(released.request)
            if req is not None and not req.leases:
                self.ledger.free(released.request, cache=cache)
        self.ledger.commit()

    def reconcile(self) -> None:
        for request in [r for r in self.requests if r not in self.ledger.requests]:
            self._give_back(self.requests.pop(request).blocks.tolist())

    def run_jobs(self) -> None:
        """P's service thread starts its queued pushes (it polls every ms)."""
        while not self.producer._jobs.empty():
            self.producer._jobs.get_nowait()()

    def busy(self) -> bool:
        staged = self.pool is not None and bool(self.pool.ledger.requests)  # a staged copy ends at its read or expiry
        return bool(self.producer._pushes) or not self.producer._jobs.empty() or self.streams.busy() or staged


@dataclass(slots=True)
class Arrival:
    grants: dict[int, GrantInfo] = field(default_factory=dict)
    replies: dict[int, GrantReply] = field(default_factory=dict)
    ranks: int = 1
    mode: TransferMode = TransferMode.PULL
    since: float = 0.0
    reserved: bool = False  # into a declined stream's reservation (no new one)


class DWorker:
    def __init__(self, world: World, name: str, policy: LoadFailurePolicy, *, rank: int = 0, ranks: int = 1,
                 group: int = 0) -> None:
        self.world, self.name, self.policy = world, name, policy
        self.rank, self.ranks, self.group = rank, ranks, group  # its place in its decode instance's TP group
        cfg = world.config
        self.clock = NodeClock(world.clock, drift=world.drift(name))
        self.dir = world.root / name
        self.block_bytes = cfg.block_bytes // ranks  # a rank of a TP group holds its heads of every block
        self.layout, self.regions = sim_layout(world.fabric, regions=cfg.regions, blocks=cfg.d_blocks,
                                               block_bytes=self.block_bytes)
        self.boots = 0
        self.arrivals: dict[str, Arrival] = {}
        self.expect: dict[str, tuple[str, list[GrantInfo], int]] = {}  # D transfer -> (request, grants, epoch)
        self.blocks: dict[str, np.ndarray] = {}
        self.stream_wanted: dict[str, str] = {}  # request -> the P that computes it (D may ask it to stream)
        self.fallback: set[str] = set()  # declined streams: the post-prefill path fills the same reservation
        self.free_list: list[int] = list(range(cfg.d_blocks - 1, -1, -1))
        self.reconnect: list[PWorker] = []  # the P ranks a restarted D handshakes with once it is up
        self.up_at = 0.0
        self.boot()

    def boot(self) -> None:
        self.boots += 1
        cfg = self.world.config
        ledger = TargetLedger(cfg.d_blocks, worker=self.name, clock=self.clock, hlc=self.clock.hlc(self.clock.drift),
                              failure_policy=self.policy)
        ledger.incarnation = zlib.crc32(f"{self.name}/{self.boots}".encode())
        self.log, torn = storage.reopen(self.dir, ledger.header(), self.world.disk(self.name, self.boots))
        ledger.log = self.log
        if torn:
            self.world.exercise("torn_tail")
        self.ledger = ledger
        self.watch = LedgerWatch(ledger, self.world.coverage, on_ready=self._on_ready)
        self.world.watches.append(self.watch)
        self.transport = SimTransport(self.name, self.world.fabric, epoch=self.boots,
                                      cancels_in_flight=self.world.cancels)
        self.transport.register(self.layout)
        world, options = self.world, self.world.handoff_options

        def peer_calls(post: Any) -> SimPeerCalls:
            self.calls = SimPeerCalls(post, node=self.name, channels=world.channels, now=self.clock.now)
            return self.calls

        self.consumer = Consumer(ledger, self.transport, world.compat(self.ranks), tp_rank=self.rank,
                                 options=options, clock=self.clock.now, peer_calls=peer_calls,
                                 digester=SimDigester(self.regions),
                                 side_channel=world.channels.client_for(self.name, options.request_timeout_s),
                                 thread=False)
        self.streams = SimStreamConsumer(self.consumer, options=world.stream_options)

    def connect(self, p: PWorker) -> bool:
        """The engine's thread handshakes with ``p`` (a blocking call: partitioned or lost, it fails)."""
        try:
            self.consumer.connect(p.name, push=True)
        except SideChannelError:
            return False
        return True

    def linked(self, p: PWorker, epoch: int = 0) -> bool:
        link = self.consumer.links.get(p.name)
        return link is not None and link.epoch >= epoch

    def crash(self, tear: float | None) -> None:
        known = [self.world.p_by_name[address] for address in self.consumer.links]
        self.calls.close()
        self.world.fabric.fail_to(self.name, f"{self.name} crashed")
        assert self.ledger.log is not None  # boot() opened it
        storage.crash(self.ledger.log, tear)
        self.transport.close()
        self.world.network.forget_node(self.name, keep=lambda payload: isinstance(payload, NoteMsg))
        self.watch.detach()
        self.world.crashed_requests += len(self.ledger.requests)
        self.arrivals.clear()
        self.blocks.clear()
        self.expect.clear()
        self.stream_wanted.clear()
        self.fallback.clear()
        self.free_list = list(range(self.world.config.d_blocks - 1, -1, -1))
        for region in self.regions:
            region[:] = 0
        self.boot()
        # a restarted D handshakes again once its process is up (P then releases the leases its old self claimed)
        self.reconnect, self.up_at = known, self.world.clock.now() + RESTART_S

    def _on_ready(self, request: str) -> None:
        self.world.on_ready(self, request)

    # -- engine -----------------------------------------------------------------------------------------------------
    def on_grant(self, msg: GrantArrived) -> None:
        g = msg.grant
        self.stream_wanted.pop(g.request, None)  # P took the post-prefill path: too late to stream
        if g.request in self.fallback and self.ledger.requests.get(g.request) is not None \
                and self.ledger.requests[g.request].state == TargetState.RESERVED:
            self.fallback.discard(g.request)  # a declined stream: the grant fills the same reservation
            self.arrivals[g.request] = Arrival({g.rank: g}, {g.rank: msg.reply}, g.ranks, msg.mode,
                                               self.world.clock.now(), reserved=True)
            return
        if g.request in self.ledger.requests or g.request in self.world.d_ended.get(self.name, set()):
            return  # a duplicate of a grant already admitted (or of a request already gone)
        sources = tp_source_ranks(p_tp=g.ranks, d_tp=self.ranks, d_rank=self.rank)  # the P ranks this rank reads
        if g.rank not in sources:
            return
        arrival = self.arrivals.setdefault(g.request, Arrival(ranks=len(sources), mode=msg.mode,
                                                              since=self.world.clock.now()))
        arrival.grants[g.rank] = g
        arrival.replies[g.rank] = msg.reply

    def up(self) -> bool:
        """The process is up (a restarted D's engine acts only once it is)."""
        return self.world.clock.now() >= self.up_at

    def admit(self, request: str) -> bool:
        arrival = self.arrivals.get(request)
        if arrival is None or len(arrival.grants) < arrival.ranks or not self.up():
            return False
        grants = [arrival.grants[r] for r in sorted(arrival.grants)]
        n = len(grants[0].block_ids)
        peers = [self.world.p_by_name[g.agent] for g in grants]
        if not all(self.linked(p, g.agent_epoch) or self.connect(p) for p, g in zip(peers, grants, strict=True)):
            return False  # the engine tries again later (a handshake failed)
        if not all(self.linked(p, g.agent_epoch) for p, g in zip(peers, grants, strict=True)):
            return False
        if arrival.reserved:  # a declined stream's reservation, if it still waits
            del self.arrivals[request]
            reserved = self.ledger.requests.get(request)
            if reserved is None or reserved.blocks.size != n or reserved.state != TargetState.RESERVED:
                return False
            epoch = reserved.epoch
        else:
            blocks = self.take_blocks(n)
            if blocks is None:
                return False
            del self.arrivals[request]
            epoch = self.ledger.reserve(request, blocks)
            self.blocks[request] = blocks
        self.world.exercise(arrival.mode)
        if len(grants) > 1:
            self.world.exercise("tp_handles")
        replies = [(p.name, arrival.replies[g.rank]) for g, p in zip(grants, peers, strict=True)]
        if arrival.mode is TransferMode.PUSH:
            transfer = self.consumer.request_push(request, replies[0][1], address=replies[0][0])
        else:
            transfer = self.consumer.pull(request, replies)
        self.expect[transfer] = (request, grants, epoch)
        return True

    def ask_stream(self, request: str) -> None:
        """Reserve blocks for ``request`` before P computes it and ask P to stream into them (the real
        ``StreamConsumer.request_stream``: the load starts, layers=n, before the ask). Declined: RESERVED again,
        for the post-prefill path."""
        agent = self.stream_wanted.get(request)
        p = self.world.p_by_name.get(agent or "")
        if (p is None or request in self.ledger.requests or request not in p.requests
                or request not in p.ledger.requests):  # P's ledger freed it already (its lease expired): no stream
            self.stream_wanted.pop(request, None)
            return
        if not self.up():
            return
        if p.name not in self.consumer.links:
            self.connect(p)
            return
        pr = p.requests[request]
        blocks = self.take_blocks(pr.blocks.size)
        if blocks is None:
            return
        del self.stream_wanted[request]
        epoch = self.ledger.reserve(request, blocks)
        self.blocks[request] = blocks
        computed = (tuple(pr.blocks.tolist()), p.transport.epoch, p.ledger.requests[request].epoch)
        transfer = self.streams.request_stream(request, p.name, layers=self.world.config.regions)
        if transfer is None:
            self.world.exercise("stream_declined")
            self.fallback.add(request)
            return
        # what the checks expect of it: P's blocks of the request, as computed by this incarnation of P
        source = GrantInfo(request, transfer, 0, p.name, computed[0], 1, 0.0, p.name, computed[1], computed[2], 0, 1,
                           stream=True)
        self.expect[transfer] = (request, [source], epoch)

    def take_blocks(self, n: int) -> np.ndarray | None:
        """``n`` free blocks for a reservation, the last freed first, none the ledger quarantined (their bytes
        failed a digest: the engine keeps them out until the hold ends); None if there are not enough."""
        held = self.ledger.quarantined() if self.ledger.quarantine else {}
        usable = [b for b in reversed(self.free_list) if b not in held][:n]
        if len(usable) < n:
            return None
        for b in usable:
            self.free_list.remove(b)
        return np.array(usable, dtype=np.int32)

    def cancel(self, request: str) -> None:
        """The engine cancels ``request``: a stream's cancel also asks P to stop (freed once it settled)."""
        if self.streams.streaming(request):
            self.world.exercise("stream_cancel_d")
            self.streams.cancel(request)
        else:
            self.ledger.cancel(request)

    def service(self) -> None:
        if self.reconnect and self.world.clock.now() >= self.up_at:
            known, self.reconnect = self.reconnect, []
            for p in known:
                self.connect(p)
        self.calls.expire()
        with self.log.runtime_loop():
            self.consumer.step_once()
        self.streams.step()  # its heartbeats; a P silent for the peer timeout ends D's streams (rare: not counted)
        world = self.world

        def held(stream: Any) -> bool:  # P still holds it: only its write window keeps a write out of the blocks
            held_by_p = world.p_by_name[stream.link.agent].streams.held(stream.source, self.streams.transport.agent)
            return bool(held_by_p == stream.transfer)

        timed_out, still_held = self.streams.time_out(held)
        if timed_out:
            world.exercise("stream_timeout")
        if still_held:
            world.exercise("stream_timeout_held")
        self.ledger.commit()

    def busy(self) -> bool:
        return bool(self.consumer.pending()) or not self.consumer._jobs.empty() or self.calls.busy() \
            or self.streams.busy()

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
        loading = {load.request for load in self.consumer._loads.values()}
        return [r for r, req in self.ledger.requests.items()
                if req.state == TargetState.RESERVED and r not in loading]


class World:
    def __init__(self, config: SimConfig, root: Path, seed: int, drift: bool = True) -> None:
        self.config, self.root, self.seed = config, root, seed
        # the window (0.8 of the timeout) fits the TTL for any config.ttl_s (P's reservation sweep is not simulated)
        self.stream_options = StreamOptions(stream_timeout_s=3 * config.ttl_s, reservation_ttl_s=3 * config.ttl_s,
                                            heartbeat_interval_s=config.ttl_s / 4, peer_timeout_s=config.ttl_s)
        self.rpc_loss: Loss = ""  # what the current step loses of a blocking side-channel call
        self.verify = verify_mode(config.verify, seed)
        self.cancels = transports_cancel(config, seed)
        self.corrupted_reads = 0  # blocks READY_FOR_ATTENTION whose bytes are not the granted ones
        reset_stream_ids()
        self.clock = ManualClock(1000.0)
        self.network = Network()
        self.channels = SideChannels(self.network, self.clock.now,
                                     reachable=lambda a, b: not self.network.cut(a, b), loss=lambda: self.rpc_loss)
        self.handoff_options = HandoffOptions(request_timeout_s=config.ttl_s / 4, load_timeout_s=config.ttl_s * 5,
                                              unit_bytes=config.block_bytes // HEADS, probe=False,
                                              verify=self.verify, quarantine_s=config.ttl_s)
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
        self.staging = staging_policy(config, seed)  # None: this seed's P workers stage nothing
        self.p: list[PWorker] = []
        index = 0
        for g, width in enumerate(config.p_groups):
            for rank in range(width):
                self.p.append(PWorker(self, f"P{index}", index, rank, width, g))
                index += 1
        self.p_by_name = {w.name: w for w in self.p}
        self.groups = [[w for w in self.p if w.group == g] for g in range(len(config.p_groups))]
        self.d: list[DWorker] = []
        for g, width in enumerate(d_shape(config, seed)):  # instance g: policy fail if g is even, else recompute
            policy = LoadFailurePolicy.FAIL if g % 2 == 0 else LoadFailurePolicy.RECOMPUTE
            for rank in range(width):
                self.d.append(DWorker(self, f"D{len(self.d)}", policy, rank=rank, ranks=width, group=g))
        self.d_by_name = {w.name: w for w in self.d}
        self.d_groups = [[d for d in self.d if d.group == g] for g in range(len(d_shape(config, seed)))]
        if drift:
            self.exercise("clock_drift")

    def compat(self, tp_size: int) -> CompatInfo:
        """What every worker runs: one model of :data:`HEADS` KV heads, one token per block; ``tp_size`` ranks."""
        return CompatInfo(model_id="sim", dtype="bfloat16", num_layers=self.config.regions, num_kv_heads=HEADS,
                          head_size=16, block_size=1, kv_layout="HND", tp_size=tp_size)

    def incarnation(self, name: str, boots: int) -> int:
        """A worker's incarnation (in its transfer ids): new on every start, reproducible from the seed."""
        return zlib.crc32(f"{name}/{boots}".encode())

    def drift(self, name: str) -> float:
        if not self._drift:
            return 0.0
        return ((zlib.crc32(f"{self.seed}/{name}".encode()) % 2001) - 1000) * 1e-6  # within ±1000 ppm

    def disk(self, name: str, boots: int) -> storage.FaultyDisk | None:
        """A worker's disk for one boot: seeded storage faults, unless the run switched them off."""
        if not self.config.allows("disk"):
            return None
        return storage.FaultyDisk(f"{self.seed}/{name}/{boots}", self.exercise)

    def exercise(self, fault: str) -> None:
        self.coverage[f"fault: {fault}"] += 1

    def sender(self, node: str) -> Callable[[str, object], None]:
        return lambda dst, payload: self.network.send(node, dst, payload, self.clock.now())

    def _note(self, sender: str, receiver: str, note: Notification) -> None:
        self.network.send(sender, receiver, NoteMsg(note), self.clock.now())

    def node(self, name: str) -> PWorker | DWorker | None:
        return self.p_by_name.get(name) or self.d_by_name.get(name)

    def deliver(self, msg: Message) -> None:
        node = self.node(msg.dst)
        payload = msg.payload
        if node is None:
            pool = self.pool(msg.dst)
            if pool is not None and isinstance(payload, NoteMsg):  # D's read of a staged copy ended
                pool.transport.inbox.append((msg.src, payload.note))
            return
        if isinstance(payload, GrantArrived):
            assert isinstance(node, DWorker)
            node.on_grant(payload)
        elif isinstance(payload, NoteMsg):
            node.transport.inbox.append((msg.src, payload.note))
            self.network.remember(msg)
        elif isinstance(payload, PeerRequest):
            if isinstance(payload.message, PushRequest):
                self.network.remember(msg)
            elif isinstance(payload.message, Heartbeat) and payload.message.token:
                self.network.remember_renewal(msg)
            reply = serve(payload, self.channels.servers.get(msg.dst))
            if reply is not None:
                self.network.send(msg.dst, msg.src, reply, self.clock.now())
        elif isinstance(payload, PeerReply):
            payload.calls.arrived(payload.call, payload.outcome, msg.src)
        else:  # pragma: no cover - the world sends nothing else
            raise TypeError(f"unexpected message {payload!r}")

    def on_ready(self, d: DWorker, request: str) -> None:
        if self.on_ready_hook is not None:
            self.on_ready_hook(d, request)

    def reconcile(self) -> None:
        for w in self.p:
            w.reconcile()
        for d in self.d:
            d.reconcile()

    def workers(self) -> list[PWorker | DWorker]:
        return [*self.p, *self.d]

    def pool(self, agent: str) -> SimPool | None:
        """The host staging pool whose agent is ``agent`` (``P0~host``), if its P stages."""
        w = self.p_by_name.get(agent.removesuffix(HOST)) if agent.endswith(HOST) else None
        return None if w is None else w.pool

    def pools(self) -> list[SimPool]:
        return [w.pool for w in self.p if w.pool is not None]

    def ledgers(self) -> list[SourceLedger | TargetLedger]:
        return [w.ledger for w in self.p] + [d.ledger for d in self.d]

    def close(self) -> None:
        for w in self.workers():
            w.ledger.commit()
            assert w.ledger.log is not None  # boot() opened it
            w.ledger.log.close()
        for pool in self.pools():
            pool.close()


def p_phase(w: PWorker, request: str) -> str:
    """Where a P request is, for the cancel fault's label."""
    req = w.ledger.requests.get(request)
    if req is None:
        return "after"
    if not req.leases:
        return "after" if w.requests.get(request) and w.requests[request].phase is PPhase.GRANTED else "before_grant"
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


__all__ = [
    "D_SHAPES",
    "UNCANCELLABLE_EVERY",
    "DWorker",
    "PPhase",
    "PWorker",
    "RequestMode",
    "SimConfig",
    "SourceState",
    "World",
    "d_phase",
    "d_shape",
    "p_phase",
    "transports_cancel",
]
