"""What must hold: after every step, whenever a target block becomes READY_FOR_ATTENTION, and at quiescence.

- Every step: the core invariants (:mod:`kvlifecycle.invariants`) on each ledger an event touched; no transfer in
  flight reads or writes a source block that is no longer pinned at the granted epoch, nor lands in a target block
  that is no longer LOADING for the request it was posted for.
- READY: the block's bytes are the granted source blocks' bytes of the granted epoch, slice by slice and head by
  head (the tags); each block that differs counts as a corrupted read.
- Quiescence: no pinned block, no live lease or load, no open handle or transfer; every request lived once and
  ended once on each side; ``replay`` + ``check`` (quiescent) + ``check_pair`` clean on every log.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.eventlog import LogReader
from kvlifecycle.invariants import check_quiescent, check_source, check_target
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.sim.memory import TAG_BYTES, read_tags, who
from kvlifecycle.sim.messages import GrantInfo
from kvlifecycle.sim.staging import HOST
from kvlifecycle.sim.world import HEADS, DWorker, World
from kvlifecycle.transport import BlockView, XferOp

_PINNED, _LOADING = int(SourceState.PINNED_FOR_TRANSFER), int(TargetState.LOADING)
_HELD = np.array([int(SourceState.ALLOCATED), int(SourceState.READY)])  # a streamed request's blocks, computing


def rank_view(rank: int, ranks: int, block_bytes: int, d_ranks: int = 1) -> BlockView:
    """The slice of every block of a D rank (of a ``d_ranks``-wide TP group, ``block_bytes`` per block) that P rank
    ``rank`` of a ``ranks``-wide TP group fills: its heads when P is wider, else the whole block (a D rank that
    shares a P rank with its siblings reads its own head slice of P's block into the whole of its own)."""
    if ranks <= d_ranks:
        return BlockView()
    share = ranks // d_ranks  # the P ranks one D rank reads
    width = block_bytes // share
    return BlockView(rank % share * width, width)


def step_checks(world: World) -> list[str]:
    out: list[str] = []
    for watch in world.watches:
        if not watch.dirty or watch not in watch.ledger.listeners:
            continue
        watch.dirty = False
        ledger = watch.ledger
        found = check_source(ledger) if isinstance(ledger, SourceLedger) else check_target(ledger)
        out += [f"{ledger.worker}: {v}" for v in found]
    for pool in world.pools():
        out += pool.checks()
    out += in_flight_checks(world)
    return out


def _grant_of(world: World, transfer: str) -> tuple[DWorker, GrantInfo] | tuple[None, None]:
    for d in world.d:
        for _request, grants, _epoch in d.expect.values():
            for g in grants:
                if g.transfer == transfer:
                    return d, g
    return None, None


def in_flight_checks(world: World) -> list[str]:
    out: list[str] = []
    for x in world.fabric.in_flight:
        owner, remote = x.owner, x.remote
        if owner.closed or remote.closed:
            continue  # a crashed end: the transfer fails when next touched
        pool = world.pool(owner.agent) or world.pool(remote.agent)
        if pool is not None:  # a staging copy into P's host pool, or D's read of a staged copy
            source = world.p_by_name[pool.name.removesuffix(HOST)].ledger
            out += pool.in_flight_check(owner.agent, remote.agent, x.handle.transfer, x.local, x.remote_ids,
                                        x.handle.op, source)
            if world.pool(owner.agent) is not None:
                continue
            d = world.d_by_name.get(owner.agent)
            if d is not None and (d.ledger.block_states(x.local) != _LOADING).any():
                out.append(f"{d.name}: target block(s) {x.local.tolist()} not LOADING while transfer "
                           f"{x.handle.transfer} writes them")
            continue
        if x.handle.op is XferOp.READ:
            p, p_ids, d_name, d_ids = world.p_by_name.get(remote.agent), x.remote_ids, owner.agent, x.local
        else:
            p, p_ids, d_name, d_ids = world.p_by_name.get(owner.agent), x.local, remote.agent, x.remote_ids
        d = world.d_by_name.get(d_name)
        if p is None or d is None:
            continue
        _, grant = _grant_of(world, x.handle.transfer)
        if grant is not None and grant.stream and grant.agent_epoch == p.transport.epoch:
            # no lease: P's request holds the blocks until its writes settled (StreamProducer.release)
            states, epochs = p.ledger.block_states(p_ids), p.ledger.epoch[p_ids]
            if np.isin(states, _HELD, invert=True).any() or (epochs != grant.epoch).any():
                out.append(f"{p.name}: source block(s) {p_ids.tolist()} freed or reused while stream "
                           f"{x.handle.transfer} writes from them (states {states.tolist()}, epochs "
                           f"{epochs.tolist()}, computed at epoch {grant.epoch})")
        elif grant is not None and grant.agent_epoch == p.transport.epoch:
            states = p.ledger.block_states(p_ids)
            epochs = p.ledger.epoch[p_ids]
            if (states != _PINNED).any() or (epochs != grant.epoch).any():
                out.append(f"{p.name}: source block(s) {p_ids.tolist()} reused or freed while transfer "
                           f"{x.handle.transfer} reads them (states {states.tolist()}, epochs {epochs.tolist()}, "
                           f"granted epoch {grant.epoch})")
        if d.transport is owner or d.transport is remote:
            states = d.ledger.block_states(d_ids)
            if (states != _LOADING).any():
                out.append(f"{d.name}: target block(s) {d_ids.tolist()} not LOADING while transfer "
                           f"{x.handle.transfer} writes them (states {states.tolist()})")
    return out


def tag_check(world: World, d: DWorker, request: str) -> list[str]:
    """``request`` just became READY_FOR_ATTENTION on ``d``: its bytes must be exactly the granted ones, each KV
    head where D's plan puts it; every block that differs is counted in ``world.corrupted_reads``."""
    found = [(t, e) for t, e in d.expect.items() if e[0] == request]
    if not found:
        return [f"{d.name}: {request} READY without a load the simulation started"]
    transfer, (_req, grants, _epoch) = found[-1]
    req = d.ledger.requests[request]
    bb = d.block_bytes
    per_head = bb // (HEADS // d.ranks)  # D's block holds its rank's heads, in order
    out: list[str] = []
    corrupted = np.zeros(req.blocks.size, dtype=bool)
    for k, g in enumerate(grants):
        p = world.p_by_name[g.agent]
        view = rank_view(g.rank, g.ranks, bb, d.ranks)
        width = (bb - view.offset) if view.length == 0 else view.length
        heads = d.rank * (HEADS // d.ranks) + (view.offset + np.arange(0, width, TAG_BYTES)) // per_head
        for r, region in enumerate(d.regions):
            tags = read_tags(region[req.blocks, view.offset : view.offset + width].reshape(-1))
            tags = tags.reshape(req.blocks.size, -1)
            want_block = np.asarray(g.block_ids, dtype=np.uint32)[:, None]
            ok = ((tags["who"] == who(p.index, 0, r) + (heads << 8)) & (tags["agent_epoch"] == g.agent_epoch)
                  & (tags["block"] == want_block) & (tags["epoch"] == g.epoch))
            corrupted |= ~ok.all(axis=1)
            if not ok.all() and not out:
                i = int(np.argmax(~ok.all(axis=1)))
                t = tags[i, int(np.argmax(~ok[i]))]
                out.append(f"{d.name}: {request} READY but block {int(req.blocks[i])} region {r} part {k} holds "
                           f"(who={int(t['who'])}, agent_epoch={int(t['agent_epoch'])}, block={int(t['block'])}, "
                           f"epoch={int(t['epoch'])}), granted {g.agent} block {g.block_ids[i]} epoch {g.epoch} "
                           f"agent_epoch {g.agent_epoch} ({transfer})")
    world.corrupted_reads += int(corrupted.sum())
    return out


def quiescence_checks(world: World) -> list[str]:
    out: list[str] = []
    for ledger in world.ledgers():
        out += [f"{ledger.worker}: {v}" for v in check_quiescent(ledger)]
        if ledger.requests:
            out.append(f"{ledger.worker}: request(s) never ended: {sorted(ledger.requests)[:5]}")
    for w in world.workers():
        if w.transport.open_handles():
            out.append(f"{w.name}: {w.transport.open_handles()} transfer handle(s) left open")
        if w.busy():
            out.append(f"{w.name}: protocol core still busy (loads, pushes, streams or calls pending)")
    if world.fabric.in_flight:
        out.append(f"{len(world.fabric.in_flight)} transfer(s) still in flight")
    for pool in world.pools():
        out += pool.quiescence_checks()
    for watch in world.watches:
        worker = watch.ledger.worker
        out += [f"{worker}: {r} lived {n} times" for r, n in watch.lives.items() if n > 1]
        out += [f"{worker}: {r} ended {n} times" for r, n in watch.ends.items() if n > 1]
    return out


def log_checks(dirs: Iterable[tuple[Path, bool]]) -> list[str]:
    """Replay each log and check it; ``(directory, quiescent)``: quiescent is False for a log whose last
    incarnation recorded nothing (replay then ends in the crashed incarnation, which may have left leases)."""
    pairs = [(replay(d), quiescent) for d, quiescent in dirs]
    results = [r for r, _ in pairs]
    out = [f"{r.path}: {v}" for r, quiescent in pairs for v in check(r, quiescent=quiescent)]
    out += [str(v) for v in check_pair(results)]
    return out


def acknowledged_checks(workers: Iterable[tuple[Path, int, list[ev.Event]]]) -> list[str]:
    """The log on disk holds exactly what each worker's live ledger recorded in its last incarnation, in order:
    whatever its disk did (ENOSPC, EIO, short writes, failed fsyncs), no event is missing, repeated or out of place.
    ``(directory, incarnation, recorded events)``."""
    out: list[str] = []
    for directory, incarnation, recorded in workers:
        logged = [r.event for r in LogReader(directory).records() if r.incarnation == incarnation]
        if logged != recorded:
            first = next((i for i, (a, b) in enumerate(zip(logged, recorded, strict=False)) if a != b),
                         min(len(logged), len(recorded)))
            out.append(f"{directory}: the log holds {len(logged)} event(s) of incarnation {incarnation}, the ledger "
                       f"recorded {len(recorded)}; they differ from event {first} on")
    return out


# Findings of the simulation that the checks would report on every affected seed until they are fixed where they
# live, each with a strict-xfail regression test under tests/sim/ named after it. None is open: each one found so
# far is fixed and its seed is a passing regression test (tests/sim/test_sim_findings.py).
KNOWN_FINDINGS: dict[str, str] = {}


def known_finding(world: World, violation: str) -> str | None:
    """The KNOWN_FINDINGS key ``violation`` is an instance of, or None."""
    return None
