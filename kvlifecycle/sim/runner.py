"""The scheduler: one ``random.Random(seed)`` picks every next step among those enabled; each step is recorded as
a plain tuple, so a run is also a step list that :func:`run_steps` replays (the shrinker drops steps and replays the
rest; a step that no longer applies is a no-op). After the steps a fixed drain (no faults, no randomness) brings the
cluster to quiescence; the checks run after every step and at the end.

One concept, longer than most: the step menu and each step's enactment read one RNG and one world, so a step and
its weight stay side by side (splitting them would spread a seed's one sequence of draws over several files).
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import tempfile
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlifecycle.choices import LoadFailurePolicy
from kvlifecycle.control import Heartbeat, PushRequest
from kvlifecycle.digest import VerifyMode
from kvlifecycle.machines import TargetState
from kvlifecycle.sim import checks, device_copies
from kvlifecycle.sim.corruption import Corruption
from kvlifecycle.sim.network import Message
from kvlifecycle.sim.peers import PeerRequest
from kvlifecycle.sim.streams import Loss
from kvlifecycle.sim.world import DWorker, PPhase, PWorker, RequestMode, SimConfig, World, d_phase, p_phase
from kvlifecycle.transport import XferStatus

Step = tuple[Any, ...]
CORRUPT_CHANCE = 0.2  # of a completion, in a seed that verifies
STREAM_STALL_CHANCE = 0.2  # of a step while a stream's write is in flight
INVALIDATE_CHANCE = 0.05  # of a step while a P writes into a D, or (a seed that cannot cancel) a D reads from a P
RECENT_TTL_FRACTION = 0.45  # a "settled push" echo sent this share of a TTL ago or less (P's transit bound: 0.5)
DEVICE_COPY_TTL_FRACTION = 0.05  # the longest a copy that cannot be cancelled runs (CUDA IPC: a kernel's ms)


@dataclass
class RunResult:
    seed: int
    steps: list[Step]
    violations: list[str]
    leaks: list[str]
    coverage: Counter[str]
    trace: list[tuple[int, Step, tuple[Any, ...]]] = field(default_factory=list)
    log_dirs: list[Path] = field(default_factory=list)
    failed_at: int | None = None  # index of the step after which the first violation showed (None: the drain/end)
    known: list[str] = field(default_factory=list)  # instances of checks.KNOWN_FINDINGS (the run stopped there)
    corrupted_reads: int = 0  # blocks READY_FOR_ATTENTION whose bytes were not the granted ones

    @property
    def ok(self) -> bool:
        return not self.violations and not self.leaks


def _tmp_root() -> Path:
    shm = Path("/dev/shm")
    return Path(tempfile.mkdtemp(prefix="kvl-sim-", dir=shm if shm.is_dir() else None))


class Simulation:
    def __init__(self, config: SimConfig, seed: int, root: Path, *, keep_trace: bool = False) -> None:
        self.config, self.seed, self.root = config, seed, root
        self.rng = random.Random(seed)
        self.late_rng = random.Random(f"{seed}/late")  # clock jumps and late re-deliveries (:meth:`_late_fault`)
        self.corrupt_rng = random.Random(f"{seed}/corrupt")  # what a completion lands wrong (:meth:`_corruption`)
        self.device_rng = random.Random(f"{seed}/device")  # a peer lost under a device copy (:meth:`_device_fault`)
        self.stall_rng = random.Random(f"{seed}/stall")  # a stall under a stream's write (:meth:`_stream_stall`)
        self.world = World(config, root, seed, drift=config.allows("drift"))
        self.world.on_ready_hook = self._on_ready
        self.violations: list[str] = []
        self.known: list[str] = []
        self._post_failures = 0
        # request -> (P group, D instance, blocks, mode)
        self.requests: dict[str, tuple[int, int, int, RequestMode]] = {}
        self.keep_trace = keep_trace
        self.trace: list[tuple[int, Step, tuple[Any, ...]]] = []
        self._seen = {id(w): 0 for w in self.world.watches}

    def classify(self) -> None:
        """Move violations that are instances of a known finding to ``known``."""
        still = []
        for v in self.violations:
            key = checks.known_finding(self.world, v)
            if key is None:
                still.append(v)
            else:
                self.known.append(f"{key}: {v}")
        self.violations = still

    def _on_ready(self, d: DWorker, request: str) -> None:
        self.world.ready_checked += 1
        self.violations += checks.tag_check(self.world, d, request)

    # -- choosing ---------------------------------------------------------------------------------------------------
    def _p_requests(self, phase: PPhase) -> list[str]:
        out = []
        for request, (group, *_rest) in self.requests.items():
            for w in self.world.groups[group]:
                pr = w.requests.get(request)
                if pr is not None and pr.phase == phase:
                    out.append(request)
                    break
        return out

    def choose(self) -> Step:
        late = self._late_fault() or self._device_fault() or self._stream_stall()
        if late is not None:
            return late
        rng, cfg, world = self.rng, self.config, self.world
        menu: list[tuple[str, float]] = []
        if len(self.requests) < cfg.max_requests:
            menu.append(("arrive", 3))
        phases = {pr.phase for w in world.p for pr in w.requests.values()}  # every P request is one of ours
        if PPhase.ALLOCATED in phases:
            menu.append(("prefill", 3))
        if PPhase.PREFILLED in phases:
            menu.append(("grant", 3))
        if PPhase.GRANTED in phases:
            menu.append(("regrant", 0.3))
        if PPhase.PREFILLED in phases:
            menu.append(("p_local", 0.3))
        if PPhase.STREAMING in phases:
            menu.append(("layer", 5))
        if any(d.arrivals for d in world.d):
            menu.append(("admit", 4))
        if any(d.stream_wanted for d in world.d):
            menu.append(("stream_ask", 3))
        if world.network.in_flight:
            menu += [("deliver", 30)]
            if cfg.allows("drop"):
                menu.append(("drop", 0.6))
            if cfg.allows("duplicate"):
                menu.append(("dup", 0.6))
        if world.fabric.in_flight:
            menu.append(("complete", 10))
            if cfg.allows("handle_fail"):
                menu.append(("fail_xfer", 1.0))
        menu += [("service", 6), ("advance", 1.5 if cfg.allows("expiry") else 0.3)]
        if cfg.allows("cancel"):
            menu += [("cancel_p", 1.0), ("cancel_d", 0.6)]
        if any(req.state == TargetState.READY_FOR_ATTENTION for d in world.d for req in d.ledger.requests.values()):
            menu.append(("finish", 3))
        if any(d.waiting_reserved() for d in world.d):
            menu.append(("local_fill", 1))
        menu.append(("evict", 0.3))
        if cfg.allows("p_restart"):
            menu.append(("crash_p", 0.25))
        if cfg.allows("d_crash"):
            menu.append(("crash_d", 0.2))
        if cfg.allows("partition"):
            menu += [("partition", 0.3), ("heal", 0.4)]
        if cfg.allows("post_fail"):
            menu.append(("post_fail", 0.4))
        kinds, weights = zip(*menu, strict=True)
        kind = rng.choices(kinds, weights)[0]
        pick = rng.randrange(1 << 16)
        if kind == "arrive":
            push = rng.random() < 0.35
            how = "stream" if push and rng.random() < 0.5 else "share" if rng.random() < 0.5 else ""
            return (kind, rng.randrange(len(world.groups)), rng.randrange(len(world.d)), rng.randint(1, 3), push, how)
        if kind == "stream_ask":
            loss = rng.choices(("", "request", "reply"), (8, 1, 1))[0] if cfg.allows("drop") else ""
            return (kind, pick, loss)
        if kind == "complete":
            return (kind, pick, cfg.allows("duplicate_completion") and rng.random() < 0.15, *self._corruption(pick))
        if kind == "service":
            nodes = [w.name for w in world.p] + [d.name for d in world.d]
            return (kind, nodes[rng.randrange(len(nodes))], rng.random() < 0.2)
        if kind == "advance":
            return (kind, round(rng.choice((0.05, 0.1, 0.2, 0.4, 0.8, 1.5)) * cfg.ttl_s, 6))
        if kind in ("crash_p", "crash_d"):
            tear = round(rng.random(), 4) if rng.random() < 0.7 else -1.0
            return (kind, pick, tear)
        if kind == "partition":
            a = world.p[rng.randrange(len(world.p))].name
            return (kind, a, world.d[rng.randrange(len(world.d))].name)
        if kind == "post_fail":
            nodes = [w.name for w in world.p] + [d.name for d in world.d]
            return (kind, nodes[rng.randrange(len(nodes))])
        if kind == "heal":
            return (kind,)
        return (kind, pick)

    def _late_fault(self) -> Step | None:
        """A clock jump or a late re-delivery, drawn from a stream of their own, so the seed's other steps are drawn
        as they were without them."""
        rng, cfg, world = self.late_rng, self.config, self.world
        echoes = world.network.echoes() if cfg.allows("redeliver") else []
        # a late copy matters most where P's write settled under a live lease: P must not write it again
        if echoes and rng.random() < (0.1 if any(_settled_push(world, m) for m in echoes) else 0.003):
            return ("redeliver", rng.randrange(1 << 16))
        late_renewals = _lost_writer_renewals(world) if cfg.allows("redeliver") else []
        if late_renewals and rng.random() < 0.3:  # only while D waits out a lost P's write: other seeds draw as before
            return ("redeliver_renewal", rng.randrange(1 << 16))
        if cfg.allows("jump") and rng.random() < 0.002:  # NTP steps a wall clock by seconds, either way
            nodes = [w.name for w in world.p] + [d.name for d in world.d]
            return ("clock_jump", nodes[rng.randrange(len(nodes))],
                    rng.choice((0.5, 2.0, 5.0, 30.0)) * rng.choice((1, -1)))
        return None

    def _corruption(self, pick: int) -> tuple[Corruption, int]:
        """What the completion of the transfer ``pick`` names lands wrong (``""``: nothing) and where, drawn from a
        stream of its own (two draws per completion), so a seed's other steps are drawn as they were. Only where
        the seed verifies, or its config set ``verify`` (:mod:`kvlifecycle.sim.corruption`)."""
        rng, world = self.corrupt_rng, self.world
        chance, at = rng.random(), rng.randrange(1 << 16)
        if chance >= CORRUPT_CHANCE or not self.config.allows("corrupt"):
            return "", 0
        if world.verify is VerifyMode.NONE and self.config.verify is None:
            return "", 0
        x = world.fabric.in_flight[pick % len(world.fabric.in_flight)]
        if not (x.owner.agent in world.d_by_name or x.remote.agent in world.d_by_name):
            return "", 0  # a copy into P's host pool: not what D reads directly
        kinds = x.corruptions()
        return kinds[at % len(kinds)], at // len(kinds)

    def _device_fault(self) -> Step | None:
        """The control plane declares a P lost to a D (its etcd lease lapsed while it was cut off from etcd, alive):
        in a seed whose transports cannot cancel a copy, while a read of D's from it runs; in any seed, while a
        write of P's into D runs (a push, a stream's layer). Drawn from a stream of its own and only while such a
        copy runs, so other seeds draw as they did."""
        world = self.world
        pairs: list[tuple[str, str]] = []  # (D, P)
        if not world.cancels and self.config.allows("uncancellable"):
            pairs += [(x.owner.agent, x.remote.agent) for x in world.fabric.in_flight
                      if x.owner.agent in world.d_by_name and x.remote.agent in world.p_by_name and not x.released]
        if self.config.allows("invalidate_writer"):
            pairs += [(x.remote.agent, x.owner.agent) for x in world.fabric.in_flight
                      if x.owner.agent in world.p_by_name and x.remote.agent in world.d_by_name and not x.released]
        if not pairs or self.device_rng.random() >= INVALIDATE_CHANCE:
            return None
        d, p = pairs[self.device_rng.randrange(len(pairs))]
        return ("invalidate", d, p)

    def _stream_stall(self) -> Step | None:
        """While a layer write of a stream is in flight: now and then everything stalls past D's stream timeout (a
        pause of seconds: P's forward, both hosts), so P's write window must close with the write still landing,
        before D frees the blocks. Drawn from a stream of its own, and only while such a write runs."""
        world = self.world
        if not self.config.allows("slow"):
            return None
        if not any(x.handle.transfer.startswith("stream:") for x in world.fabric.in_flight):
            return None
        if self.stall_rng.random() >= STREAM_STALL_CHANCE:
            return None
        return ("stall", round(1.1 * world.stream_options.stream_timeout_s, 6))

    # -- applying ---------------------------------------------------------------------------------------------------
    def apply(self, step: Step) -> None:
        kind, args = step[0], step[1:]
        getattr(self, f"_do_{kind}")(*args)
        self.world.reconcile()
        if self.world.fabric.post_failures > self._post_failures:
            self._post_failures = self.world.fabric.post_failures
            self.world.exercise("post_fail")

    def _do_arrive(self, group: int, d: int, nblocks: int, push: bool, how: str = "") -> None:
        """A request arrives at a P group, for the D instance of D rank ``d`` (a TP-2 instance takes twice the
        requests of a TP-1 one). ``how``: ``stream`` (D may reserve first and have it streamed layer by layer),
        ``share`` (a prefix-cache hit takes cached blocks), or plain. Pushes and streams run between TP-1 instances:
        one meant for a TP-2 D goes to a TP-1 D if there is one (a TP-2 D's ranks pull, each its head slice)."""
        world = self.world
        members = world.groups[group % len(world.groups)]
        d = world.d[d % len(world.d)].group
        if push and len(members) == 1 and len(world.d_groups[d]) > 1:
            d = next((g for g, ds in enumerate(world.d_groups) if len(ds) == 1), d)
        ds = world.d_groups[d]
        mode = RequestMode.PUSH if push and len(members) == 1 and len(ds) == 1 else RequestMode.PULL
        if mode is RequestMode.PUSH and how == "stream":
            mode = RequestMode.STREAM
        request = f"r{len(self.requests)}"
        if how == "share" and len(members) == 1 and members[0].share_cached(request, nblocks):
            self.requests[request] = (group % len(world.groups), d, nblocks, mode)
            return
        if any(len(w.free_list) < nblocks for w in members):
            return  # the engine queues it: no blocks now
        self.requests[request] = (group % len(world.groups), d, nblocks, mode)
        for w in members:
            w.allocate(request, nblocks, mode)
        if mode is RequestMode.STREAM:
            ds[0].stream_wanted[request] = members[0].name

    def _group_of(self, request: str) -> list[PWorker]:
        return self.world.groups[self.requests[request][0]]

    def _do_prefill(self, pick: int) -> None:
        todo = self._p_requests(PPhase.ALLOCATED)
        if todo:
            request = todo[pick % len(todo)]
            for w in self._group_of(request):
                if w.requests.get(request) is not None and w.requests[request].phase is PPhase.ALLOCATED:
                    w.prefill(request)

    def _do_grant(self, pick: int, phase: PPhase = PPhase.PREFILLED) -> None:
        todo = self._p_requests(phase)
        if todo:
            request = todo[pick % len(todo)]
            _, d, _, mode = self.requests[request]
            for w in self._group_of(request):
                if w.requests.get(request) is not None and w.requests[request].phase == phase:
                    w.grant(request, self.world.d_groups[d], mode.granted_as())

    def _do_p_local(self, pick: int) -> None:
        """The request finished on P alone (no handoff): its READY blocks are freed or cached."""
        todo = self._p_requests(PPhase.PREFILLED)
        if todo:
            request = todo[pick % len(todo)]
            for w in self._group_of(request):
                if w.requests.get(request) is not None and w.requests[request].phase is PPhase.PREFILLED:
                    w.ledger.free(request, cache=pick % 2 == 1)

    def _do_regrant(self, pick: int) -> None:
        self._do_grant(pick, PPhase.GRANTED)

    def _do_layer(self, pick: int) -> None:
        todo = [(w, r) for w in self.world.p for r, pr in w.requests.items() if pr.phase is PPhase.STREAMING]
        if todo:
            w, request = todo[pick % len(todo)]
            w.stream_layer(request)

    def _do_stream_ask(self, pick: int, loss: Loss) -> None:
        todo = [(d, r) for d in self.world.d for r in d.stream_wanted]
        if todo:
            d, request = todo[pick % len(todo)]
            self.world.rpc_loss = loss
            try:
                d.ask_stream(request)
            finally:
                self.world.rpc_loss = ""
            if loss:
                self.world.exercise("drop")

    def _do_admit(self, pick: int) -> None:
        """D's engine schedules a request whose grants arrived: on every rank of its instance that has them (one
        scheduler step drives all the TP ranks), so the ranks sharing a P rank's lease read it side by side."""
        ready = [(d, r) for d in self.world.d for r in d.arrivals]
        if ready:
            d, request = ready[pick % len(ready)]
            for rank in self.world.d_groups[d.group]:
                if request in rank.arrivals:
                    rank.admit(request)

    def _do_deliver(self, pick: int) -> None:
        net = self.world.network
        if pick % len(net.in_flight):
            self.world.exercise("reorder")
        msg = net.take(pick)
        if msg is not None:
            if self.world.clock.now() - msg.sent_at > self.config.ttl_s / 2:
                self.world.exercise("slow_link")
            self.world.deliver(msg)

    def _do_drop(self, pick: int) -> None:
        if self.world.network.drop(pick) is not None:
            self.world.exercise("drop")

    def _do_dup(self, pick: int) -> None:
        if self.world.network.duplicate(pick) is not None:
            self.world.exercise("duplicate")

    def _do_complete(self, pick: int, duplicate: bool, corruption: Corruption = "", at: int = 0) -> None:
        fabric = self.world.fabric
        if fabric.in_flight and (pick >> 1) % 2 and _lost_writer_write(self.world, fabric.in_flight[
                pick % len(fabric.in_flight)]):
            return  # half the time a write of a P its D declared lost lands nothing yet (its link is slow too)
        x = self.world.fabric.complete(pick, duplicate_notification=duplicate, corruption=corruption, at=at)
        if x is not None and duplicate and x.notification is not None:
            self.world.exercise("duplicate_completion")
        if x is not None and corruption and x.status is XferStatus.DONE:
            self.world.exercise(f"corrupt_{corruption}")
        device_copies.ended(self.world, x)

    def _do_fail_xfer(self, pick: int) -> None:
        fabric = self.world.fabric
        if not fabric.in_flight:
            return
        x = fabric.in_flight[pick % len(fabric.in_flight)]
        siblings = [y for y in fabric.in_flight if y is not x and y.owner is x.owner
                    and y.handle.op is x.handle.op and _same_load(self.world, x, y)]
        fabric.fail(pick)
        self.world.exercise("handle_fail")
        if x.handle.transfer.startswith("stream:"):
            self.world.exercise("stream_write_fail")
        if siblings:
            self.world.exercise("sibling_fail_in_flight")

    def _do_service(self, node: str, cache: bool) -> None:
        w = self.world.node(node)
        if w is None:
            return
        if isinstance(w, PWorker):
            w.service(cache=cache)
        else:
            w.service()

    def _do_advance(self, dt: float) -> None:
        if self.config.prompt_jobs:  # P's service thread starts a queued push within ms, never a lease later
            for w in self.world.p:
                w.run_jobs()
        for d in self.world.d:  # D's service loop wakes at a job (a call's answer) within ms, never a lease later
            if not d.consumer._jobs.empty():
                d.service()
        self._advance_to(self.world.clock.now() + dt)
        if self.config.transfer_deadline_s is not None and self.world.fabric.expire(self.config.transfer_deadline_s):
            self.world.exercise("handle_fail")
        for w in self.world.p:  # P's service thread cancels the writes of a closed window within ms of its end
            closed, silent = w.streams.deadlines()
            if closed:
                self.world.exercise("stream_window_closed")
            if silent:
                self.world.exercise("stream_d_silent")
        for d in self.world.d:  # D's service loop wakes within ms of the time moving (its idle poll)
            d.service()

    def _advance_to(self, end: float) -> None:
        """Move time to ``end``, stopping at every D read bound on the way to run D's deadline check there: D's
        service thread never sleeps past its nearest read bound (``Consumer.poll_interval``), so a read is
        cancelled at its bound, not when the scheduler next looks (P may expire the lease 10 % of a TTL later)."""
        clock, world = self.world.clock, self.world
        serviced: set[tuple[str, float]] = set()  # each bound is checked once (a bound still there is not moved)
        while True:
            stops: list[tuple[float, float, PWorker | DWorker]] = [
                (d.clock.global_at(bound), bound, d) for d in world.d
                if (bound := min(d.consumer.read_bound(), d.streams.next_beat())) < float("inf")
                and (d.name, bound) not in serviced]
            stops += [(w.clock.global_at(bound), bound, w) for w in world.p
                      if (bound := min(w.streams.next_deadline(), w.producer.write_deadline())) < float("inf")
                      and (w.name, bound) not in serviced]
            stops += device_copies.stops(world, DEVICE_COPY_TTL_FRACTION * self.config.ttl_s)
            at, bound, w = min(stops, key=lambda stop: stop[0], default=(end, 0.0, None))
            if w is None or at >= end:
                break
            if not isinstance(w, PWorker | DWorker):  # a device copy's end: it lands, and its loop polls it within ms
                clock.set(max(clock.now(), at))
                device_copies.ended(world, world.fabric.complete(world.fabric.in_flight.index(w)))
                owner = world.node(w.owner.agent)
                if owner is not None:
                    owner.service()
                continue
            serviced.add((w.name, bound))
            writes_due = isinstance(w, PWorker) and w.producer.write_deadline() <= bound
            clock.set(max(clock.now(), at + 1e-6))  # a µs past the bound, as the real loop polls within a ms
            if isinstance(w, DWorker):
                w.service()
                continue
            if writes_due:  # a push's lease ends under its write: P's loop (no queued job) cancels it
                w.producer._step()
                w.ledger.commit()
            closed, silent = w.streams.deadlines()
            if closed:
                world.exercise("stream_window_closed")
            if silent:
                world.exercise("stream_d_silent")
        clock.set(max(clock.now(), end))

    def _do_stall(self, seconds: float) -> None:
        self.world.exercise("stream_stall")
        self._do_advance(seconds)

    def _do_cancel_p(self, pick: int) -> None:
        live = [r for r in self.requests if any(r in w.requests for w in self._group_of(r))]
        if not live:
            return
        request = live[pick % len(live)]
        for w in self._group_of(request):
            if request in w.ledger.requests and w.requests[request].mode is RequestMode.STREAM:
                self.world.exercise(f"cancel_p:{p_phase(w, request)}")
                w.abort_stream(request)  # the engine frees through the stream's release, never eagerly
            elif request in w.ledger.requests:
                self.world.exercise(f"cancel_p:{p_phase(w, request)}")
                shared = w.ledger.requests[request].shared
                if w.ledger.cancel(request) or not shared:  # a prefix hit's blocks stay the cache's until it ends
                    w.release_eagerly(request)
                req = w.ledger.requests.get(request)
                if req is not None and not req.leases and w.requests[request].phase is PPhase.GRANTED:
                    w.ledger.free(request)  # already released: the engine frees at once

    def _do_cancel_d(self, pick: int) -> None:
        live = [(d, r) for d in self.world.d for r in d.ledger.requests]
        if not live:
            return
        d, request = live[pick % len(live)]
        phase = d_phase(d, request)
        if d.ledger.requests[request].cancel_pending:
            return
        self.world.exercise(f"cancel_d:{phase}")
        d.cancel(request)

    def _do_finish(self, pick: int) -> None:
        ready = [(d, r) for d in self.world.d for r, req in d.ledger.requests.items()
                 if req.state == TargetState.READY_FOR_ATTENTION]
        if ready:
            d, request = ready[pick % len(ready)]
            d.ledger.finish(request)

    def _do_local_fill(self, pick: int) -> None:
        todo = [(d, r) for d in self.world.d for r in d.waiting_reserved()]
        if todo:
            d, request = todo[pick % len(todo)]
            d.ledger.local_fill(request)

    def _do_evict(self, pick: int) -> None:
        w = self.world.p[pick % len(self.world.p)]
        cached = [b for b in w.free_list if int(w.ledger.block_states([b])[0]) == 5]  # PREFIX_CACHED
        if cached:
            w.ledger.evict(cached[:1])

    def _do_crash_p(self, pick: int, tear: float) -> None:
        w = self.world.p[pick % len(self.world.p)]
        w.crash(None if tear < 0 else tear)
        self.world.exercise("p_restart")

    def _do_crash_d(self, pick: int, tear: float) -> None:
        d = self.world.d[pick % len(self.world.d)]
        d.crash(None if tear < 0 else tear)
        self.world.exercise("d_crash")

    def _do_partition(self, a: str, b: str) -> None:
        self.world.network.partition(a, b)
        self.world.exercise("partition")

    def _do_heal(self) -> None:
        if self.world.network.partitions:
            self.world.exercise("heal")
        self.world.network.heal()

    def _do_clock_jump(self, node: str, seconds: float) -> None:
        """NTP steps ``node``'s wall clock (its HLC's source) by ``seconds``; its monotonic clock runs on."""
        w = self.world.node(node)
        if w is not None:
            w.clock.jump(seconds)
            self.world.exercise("clock_jump_forward" if seconds > 0 else "clock_jump_back")

    def _do_redeliver(self, pick: int) -> None:
        """A late copy of a message delivered earlier arrives (a retransmit whose first copy got through): a push
        request whose write settled under a live lease if there is one, else any kept push request or notification.
        A partition between its ends stops it. Being late, it finds P's service loop turned since (one step first)."""
        world = self.world
        echoes = [m for m in world.network.echoes() if not world.network.cut(m.src, m.dst)]
        settled = [m for m in echoes if _settled_push(world, m)]
        choices = settled or echoes
        if not choices:
            return
        world.exercise("late_redelivery")
        if settled:
            world.exercise("late_push_after_settle")
        msg = choices[pick % len(choices)]
        p = world.p_by_name.get(msg.dst)
        if p is not None:  # a late copy: P's service loop has turned since the first one (every ms)
            p.service()
        world.deliver(msg)
        if p is not None and self.config.prompt_jobs:  # P's service thread runs a push it queued within a ms
            p.run_jobs()

    def _do_redeliver_renewal(self, pick: int) -> None:
        """A late copy of a lease renewal of a load whose P its D declared lost while P wrote into it arrives at P
        (a one-way slow link): P must refuse it, else the lease, and the write, outlive the bound D waits out."""
        world = self.world
        choices = [m for m in _lost_writer_renewals(world) if not world.network.cut(m.src, m.dst)]
        if not choices:
            return
        world.exercise("late_renewal")
        world.deliver(choices[pick % len(choices)])

    def _do_invalidate(self, d_name: str, p_name: str) -> None:
        """D's control plane declares ``p_name`` lost (``Consumer.invalidate_peer``, as a membership watch does):
        its loads fail, except that one whose copy a release cannot stop waits for it."""
        world = self.world
        d, p = world.d_by_name.get(d_name), world.p_by_name.get(p_name)
        if d is None or p is None or p_name not in d.consumer.links:
            return
        world.exercise("peer_invalidated_writing" if _p_writes_into(world, p_name, d_name) else "peer_invalidated")
        # queued on D's loop (the simulation has no service thread to wait for): its step below runs it
        with contextlib.suppress(TimeoutError):
            d.consumer.invalidate_peer(p_name, p.transport.epoch, "membership: lease lapsed", timeout_s=0.0)
        d.service()

    def _do_post_fail(self, node: str) -> None:
        w = self.world.node(node)
        if w is not None:
            w.transport.fail_next_posts(1)

    # -- the drain: no faults, no randomness ------------------------------------------------------------------------
    def drain_round(self) -> bool:
        world, cfg = self.world, self.config
        world.network.heal()
        for w in world.workers():
            w.transport._fail_posts = 0
        for _ in range(10_000):
            msg = world.network.take(0)
            if msg is None:
                break
            world.deliver(msg)
            world.reconcile()
        while world.fabric.in_flight:
            device_copies.ended(world, world.fabric.complete(0))
        for w in world.p:
            w.service()
        for d in world.d:
            d.service()
        for d in world.d:
            for request in list(d.stream_wanted):
                d.ask_stream(request)
        for request in list(self.requests):
            for w in self._group_of(request):
                pr = w.requests.get(request)
                if pr is not None and pr.phase is PPhase.ALLOCATED:
                    w.prefill(request)
                elif pr is not None and pr.phase is PPhase.PREFILLED:
                    w.grant(request, world.d_groups[self.requests[request][1]], self.requests[request][3].granted_as())
                while pr is not None and pr.phase is PPhase.STREAMING:
                    w.stream_layer(request)
        for d in world.d:
            for request in list(d.arrivals):
                if (not d.admit(request) and request in d.arrivals
                        and world.clock.now() - d.arrivals[request].since > 2 * cfg.ttl_s):
                    d.give_up(request)
            for request, req in list(d.ledger.requests.items()):
                if req.state == TargetState.READY_FOR_ATTENTION:
                    d.ledger.finish(request)
            for request in d.waiting_reserved():
                if d.policy is LoadFailurePolicy.RECOMPUTE:
                    d.ledger.local_fill(request)
                else:
                    d.ledger.cancel(request)
        world.reconcile()  # what ended above is known ended before a late grant of it arrives
        for _ in range(20):  # every call made above is answered before time moves (its timeout is shorter)
            if not world.network.in_flight and all(d.consumer._jobs.empty() for d in world.d):
                break
            for _ in range(10_000):
                msg = world.network.take(0)
                if msg is None:
                    break
                world.deliver(msg)
                world.reconcile()
            for w in world.p:
                w.service()
            for d in world.d:
                d.service()
            world.reconcile()
        world.reconcile()
        quiet = (not world.network.in_flight and not world.fabric.in_flight
                 and not any(w.ledger.requests or w.busy() for w in world.p)
                 and not any(d.ledger.requests or d.arrivals or d.stream_wanted or d.busy() for d in world.d))
        if not quiet:
            self._do_advance(cfg.ttl_s / 3)
        return quiet

    def record(self, index: int, step: Step) -> None:
        if not self.keep_trace:
            return
        new: list[tuple[str, Any]] = []
        for watch in self.world.watches:
            seen = self._seen.get(id(watch), 0)
            new += [(watch.ledger.worker, e) for e in watch.events[seen:]]
            self._seen[id(watch)] = len(watch.events)
        self.trace.append((index, step, tuple(new)))


def _settled_push(world: World, msg: Message) -> bool:
    """``msg`` is a push request whose lease is still live on its P with no write of it in flight (settled, or
    never accepted), sent recently enough (0.4 TTL) that P's transit bound lets it through: only P's book of the
    writes it accepted stops a second write then."""
    payload = msg.payload
    if not isinstance(payload, PeerRequest) or not isinstance(payload.message, PushRequest):
        return False
    if world.clock.now() - msg.sent_at >= RECENT_TTL_FRACTION * world.config.ttl_s:
        return False
    p = world.p_by_name.get(msg.dst)
    if p is None:
        return False
    push = payload.message
    lease = p.ledger.leases.get(push.transfer)
    return (lease is not None and lease.generation == push.generation
            and not p.producer.protocol.writes.in_flight(push.transfer, push.generation))


def _lost_writer_renewals(world: World) -> list[Message]:
    """The kept renewals (delivered once, sent 0.4 TTL ago or more) of the push loads whose D waits out the write
    bound of a P it declared lost."""
    waiting: set[tuple[str, str]] = set()  # (P's transfer, D)
    for d in world.d:
        now = d.clock.now()
        for load in d.consumer._loads.values():
            if load.writes_until > now:
                waiting.update((grant.transfer, d.name) for _link, grant, _part in load.parts)
    if not waiting:
        return []
    # a copy that matters is late: near or past the transit bound P holds renewals to (half the TTL)
    old = world.clock.now() - 0.4 * world.config.ttl_s
    return [m for m in world.network.renewal_echoes()
            if m.sent_at < old and isinstance(m.payload, PeerRequest)
            and isinstance(beat := m.payload.message, Heartbeat) and (beat.transfer, m.src) in waiting]


def _lost_writer_write(world: World, x: Any) -> bool:
    """``x`` is a write of a P into a D that declared that P lost and waits out its write bound."""
    d = world.d_by_name.get(x.remote.agent)
    if d is None or x.owner.agent not in world.p_by_name:
        return False
    now = d.clock.now()
    return any(load.writes_until > now and any(link.agent == x.owner.agent for link, _, _ in load.parts)
               for load in d.consumer._loads.values())


def _p_writes_into(world: World, p: str, d: str) -> bool:
    """``p`` may write into ``d``: a push or a stream load of ``d``'s from it is open, or a write of it in flight
    (an invalidation then covers ``peer_invalidated_writing``)."""
    consumer, streams = world.d_by_name[d].consumer, world.d_by_name[d].streams
    if any(load.mode != "pull" and any(link.agent == p for link, _, _ in load.parts)
           for load in consumer._loads.values()):
        return True
    if any(stream.link.agent == p for stream in streams._streams.values()):
        return True
    return any(x.owner.agent == p and x.remote.agent == d for x in world.fabric.in_flight)


def _same_load(world: World, x: Any, y: Any) -> bool:
    for d in world.d:
        for _request, grants, _epoch in d.expect.values():
            names = {g.transfer for g in grants}
            if x.handle.transfer in names and y.handle.transfer in names:
                return True
    return False


def _execute(config: SimConfig, seed: int, steps: list[Step] | None, *, keep_trace: bool,
             keep_logs: Path | None) -> RunResult:
    # the runtime logs every fault it meets (warnings): thousands a run; the checks say what matters
    runtime_log = logging.getLogger("kvlifecycle")
    level = runtime_log.level
    runtime_log.setLevel(logging.CRITICAL)
    try:
        return _run(config, seed, steps, keep_trace=keep_trace, keep_logs=keep_logs)
    finally:
        runtime_log.setLevel(level)


def _run(config: SimConfig, seed: int, steps: list[Step] | None, *, keep_trace: bool,
         keep_logs: Path | None) -> RunResult:
    root = _tmp_root()
    sim = Simulation(config, seed, root, keep_trace=keep_trace)
    executed: list[Step] = []
    failed_at: int | None = None
    leaks: list[str] = []
    try:
        plan = steps if steps is not None else None
        count = len(plan) if plan is not None else config.steps
        for i in range(count):
            step = plan[i] if plan is not None else sim.choose()
            executed.append(step)
            try:
                sim.apply(step)
            except Exception as exc:  # a command the ledgers or the core raised on: a finding, not a crash
                sim.violations.append(f"step {i} {step}: {type(exc).__name__}: {exc} "
                                      f"[{traceback.format_exc(limit=-2).splitlines()[-3].strip()}]")
            sim.violations += checks.step_checks(sim.world)
            sim.record(i, step)
            sim.classify()
            if sim.violations or sim.known:
                failed_at = i
                break
        if not sim.violations:
            try:
                for _ in range(config.drain_rounds):
                    quiet = sim.drain_round()
                    sim.violations += checks.step_checks(sim.world)
                    sim.classify()
                    if quiet or sim.violations or sim.known:
                        break
            except Exception as exc:
                sim.violations.append(f"drain: {type(exc).__name__}: {exc}")
            sim.record(len(executed), ("drain",))
            if not sim.violations and not sim.known:
                leaks = checks.quiescence_checks(sim.world)
        sim.world.close()
        dirs = [w.dir for w in sim.world.workers()] + [pool.dir for pool in sim.world.pools()]
        if not sim.violations and not leaks and not sim.known:
            try:
                sim.violations += checks.log_checks([*((w.dir, bool(w.watch.events)) for w in sim.world.workers()),
                                                     *((pool.dir, bool(pool.events)) for pool in sim.world.pools())])
                sim.violations += checks.acknowledged_checks((w.dir, w.ledger.incarnation, w.watch.events)
                                                             for w in sim.world.workers())
            except Exception as exc:  # a log that cannot be read back (corrupt): a finding, not a crash
                sim.violations.append(f"logs: {type(exc).__name__}: {exc}")
        out_dirs: list[Path] = []
        if keep_logs is not None:
            keep_logs.mkdir(parents=True, exist_ok=True)
            for d in dirs:
                target = keep_logs / d.name
                shutil.rmtree(target, ignore_errors=True)
                shutil.copytree(d, target)
                out_dirs.append(target)
        return RunResult(seed, executed, sim.violations, leaks, sim.world.coverage, sim.trace, out_dirs, failed_at,
                         sim.known, sim.world.corrupted_reads)
    finally:
        shutil.rmtree(root, ignore_errors=True)


DEFAULT_CONFIG = SimConfig()


def run_seed(seed: int, config: SimConfig = DEFAULT_CONFIG, *, keep_trace: bool = False,
             keep_logs: Path | None = None) -> RunResult:
    """One seeded run: the RNG picks every step."""
    return _execute(config, seed, None, keep_trace=keep_trace, keep_logs=keep_logs)


def run_steps(steps: list[Step], seed: int = 0, config: SimConfig = DEFAULT_CONFIG, *, keep_trace: bool = False,
              keep_logs: Path | None = None) -> RunResult:
    """Replay a recorded step list (the shrinker's runs)."""
    return _execute(config, seed, list(steps), keep_trace=keep_trace, keep_logs=keep_logs)
