"""Copies a release cannot stop, in the simulation: a seed whose transports say ``cancels_in_flight = False``
(CUDA IPC's rule: a copy is a kernel that runs to its end, whatever its handle says) leaves a released or orphaned
copy in flight (:mod:`kvlifecycle.sim.transport`), and the real Producer and Consumer must hold its blocks (LOADING,
pinned, or the stream's) until it ended; the step checks flag any block freed or reused under it.

Such a copy is bounded in time, as a device copy of milliseconds is: the scheduler's ``complete`` steps may end it
at any moment, and time never moves past its latest end (:func:`stops`): a fraction of a TTL after its post, or
after the instant the runtime must stop it if that is later (a D read's bound, a push's lease expiry on P, a stream
write's window end), within the margin each bound leaves before the other side may free the blocks.
"""

from __future__ import annotations

from typing import Any

from kvlifecycle.sim.world import World


def stops(world: World, limit_s: float) -> list[tuple[float, float, Any]]:
    """``(global time, 0, transfer)`` of the latest end of every copy in flight that its transport cannot cancel,
    ``limit_s`` after its post or after the instant the runtime must stop it, whichever is later."""
    if world.cancels:
        return []
    out: list[tuple[float, float, Any]] = []
    for x in world.fabric.in_flight:
        if x.owner.cancels_in_flight:
            continue
        stop = must_stop_at(world, x)
        out.append((max(x.posted_at, x.posted_at if stop is None else stop) + limit_s, 0.0, x))
    return out


def must_stop_at(world: World, x: Any) -> float | None:
    """The global time at which the runtime must stop the copy ``x`` (None: none known)."""
    transfer = x.handle.transfer
    d, p = world.d_by_name.get(x.owner.agent), world.p_by_name.get(x.owner.agent)
    if d is not None:
        bound = d.consumer.read_bound()
        return d.clock.global_at(bound) if bound < float("inf") else None
    if p is None:
        return None
    if transfer.startswith("stream:"):
        ends = [s.window.deadline for s in p.streams._streams.values() if s.ask.transfer == transfer]
        return p.clock.global_at(ends[0]) if ends else None
    lease = p.ledger.leases.get(transfer)
    return None if lease is None else p.clock.global_at(lease.expires_at)


def ended(world: World, x: Any) -> None:
    """The fabric just ended ``x`` (or None): one its transport cannot cancel that ended after the runtime stopped
    wanting it (a failing load's read, a write P must stop, a stopping stream's write) or after its peer was removed
    is counted: the runtime waited for it instead of freeing its blocks."""
    if x is not None and not x.owner.cancels_in_flight and (x.doomed is not None or unwanted(world, x)):
        world.exercise("uncancellable_copy_waited")


def unwanted(world: World, x: Any) -> bool:
    """The runtime no longer wants the copy ``x`` (it would have released it, had its transport cancelled)."""
    transfer = x.handle.transfer
    d, p = world.d_by_name.get(x.owner.agent), world.p_by_name.get(x.owner.agent)
    if d is not None:
        load = d.consumer._loads.get(d.consumer._by_p_transfer.get(transfer, ""))
        return load is not None and bool(load.failing)
    if p is None:
        return False
    if transfer.startswith("stream:"):
        return any(s.ask.transfer == transfer and s.stopping for s in p.streams._streams.values())
    return x.notification is not None and bool(p.producer._must_stop(transfer, x.notification.generation))
