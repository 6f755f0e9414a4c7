"""P's host staging tier in the simulation: which seeds stage, a P's pool (its ledger and log, a simulated transport
over host memory of its own, the real :class:`~kvlifecycle.handoff.staging_tier.StagingTier` the real Producer
drives), what it exercises, and what must hold while copies and reads of the pool are in flight.

Half the seeds give every P a small pool (fewer slots than P has blocks) under the ``after`` policy with a short
``stage_after_ms``, so an unclaimed grant is staged within the scheduler's first time steps. Nothing is scripted:
the faults come from the scheduler's own choices —

- ``staging_copy_races_claim``: D's claim reached P while the copy was in flight (the copy is not completed until
  the scheduler completes its transfer); the hand-over is refused and the GPU copy stays pinned;
- ``staging_crash_mid_copy``: P crashed with a copy in flight (nothing is ever served from its slots);
- ``staging_pool_full``: a lease due for staging found no free slots (it waits);
- ``staging_lease_expired``: a staged copy's lease ran out (released by the pool's sweep or a late claim);
- ``staging_read_host``: D read a staged copy from the pool;
- ``staging_push_host``: P wrote a staged copy from the pool into a D that pushes;
- ``staging``: a copy was posted.

Checks, beside the core's: no GPU lease is released as ``staged`` while its copy is in flight (the hand-over waits
for the copy; D's tag check then shows the bytes it read from the pool are the granted ones); a read of the pool in
flight reads slots its copy holds SERVING; the pool's ledger agrees with itself every step and is empty at
quiescence; its log joins P's and D's in ``replay --check``.
"""

from __future__ import annotations

import zlib
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.handoff.staging_tier import StagingTier
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.machines import HostSlotState
from kvlifecycle.sim import storage
from kvlifecycle.sim.transport import SimFabric, SimTransport, sim_layout
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_checks import check_staging, check_staging_quiescent
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StageWhen, StagingPolicy
from kvlifecycle.transport import XferOp

if TYPE_CHECKING:
    from kvlifecycle.sim.world import SimConfig

HOST = "~host"  # a P's pool agent and log directory: P0~host
POOL_SLOTS = 4  # fewer than a P's blocks: a full pool is common
_SERVING = int(HostSlotState.SERVING)


def staging_policy(config: SimConfig, seed: int) -> StagingPolicy | None:
    """Seed ``seed``'s staging policy: half the seeds stage (drawn from the seed alone, as the decode shape)."""
    if zlib.crc32(f"{seed}/staging".encode()) % 2:
        return None
    return StagingPolicy(when=StageWhen.AFTER, stage_after_ms=config.ttl_s * 100, pool_blocks=POOL_SLOTS)


class SimPool:
    """One boot of a P's host staging pool: its ledger, log, memory, transport and tier."""

    def __init__(self, name: str, directory: Path, fabric: SimFabric, policy: StagingPolicy, source: SourceLedger,
                 *, regions: int, block_bytes: int, incarnation: int, boots: int, coverage: Counter[str]) -> None:
        self.name, self.dir, self.coverage = f"{name}{HOST}", directory, coverage
        self.layout, self.regions = sim_layout(fabric, regions=regions, blocks=policy.pool_blocks,
                                               block_bytes=block_bytes)
        pool = StagingLedger(policy.pool_blocks, worker=self.name, source_worker=name, clock=source.clock,
                             hlc=source.hlc)
        pool.incarnation = incarnation
        self.log, _torn = storage.reopen(directory, pool.header())
        pool.log = self.log
        self.ledger = pool
        self.events: list[ev.Event] = []
        self.dirty = True
        pool.listeners.append(self._on_event)
        self.handed: set[str] = set()  # leases P released as ``staged``: their GPU blocks may be reused
        source.listeners.append(self._on_source_event)
        self.transport = SimTransport(self.name, fabric, epoch=boots)
        self.transport.register(self.layout)
        self.tier = StagingTier(HostStaging(source, pool, policy), self.transport)

    def _on_event(self, event: ev.Event) -> None:
        self.dirty = True
        self.events.append(event)
        if isinstance(event, ev.StgStarted):
            self.coverage["fault: staging"] += 1
        elif isinstance(event, ev.StgServed):
            self.coverage["fault: staging_read_host"] += 1
        elif isinstance(event, ev.StgReleased) and event.reason == "expired":
            self.coverage["fault: staging_lease_expired"] += 1

    def _on_source_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.SrcLeaseReleased) and event.reason == "staged":
            self.handed.add(event.transfer)

    def after_service(self) -> None:
        """P's service step ran: a lease still due but not staged found the pool full."""
        staging = self.tier.staging
        if self.ledger.occupancy() and any(t not in self.ledger.requests for t in staging.due()):
            self.coverage["fault: staging_pool_full"] += 1
        if self.tier.pushes_in_flight:
            self.coverage["fault: staging_push_host"] += 1

    def crash(self, fabric: SimFabric, tear: float | None) -> None:
        """P crashed: copies and reads of the pool fail, its memory is lost, its log torn as P's."""
        if self.tier.copies_in_flight:
            self.coverage["fault: staging_crash_mid_copy"] += 1
        fabric.fail_to(self.name, f"{self.name} crashed")
        self.ledger.listeners.remove(self._on_event)
        storage.crash(self.log, tear)
        self.transport.close()
        for region in self.regions:
            region[:] = 0

    def checks(self) -> list[str]:
        """The pool's ledger agrees with itself (after an event), and every transfer in flight that touches the
        pool or reads P's blocks for a copy is one the ledgers allow."""
        out: list[str] = []
        if self.dirty:
            self.dirty = False
            out += [f"{self.name}: {v}" for v in check_staging(self.ledger)]
        return out

    def in_flight_check(self, x_owner: str, x_remote: str, transfer: str, local: np.ndarray,
                        remote: np.ndarray, op: XferOp, source: SourceLedger) -> list[str]:
        """A transfer in flight: a copy (this pool reads P's KV) reads blocks pinned at the copy's epoch; a read of
        this pool (D reads from it) reads slots its copy holds SERVING."""
        copy = self.ledger.requests.get(transfer)
        if x_owner == self.name and op is XferOp.READ:  # the staging copy
            # A lease that ended otherwise (expired, cancelled) under its copy frees blocks the copy may still read:
            # harmless, since the hand-over is then refused and the copy never served (the tags would show it).
            # Handed over while the copy is in flight, the blocks are the engine's to reuse under it.
            if copy is not None and transfer in self.handed:
                states, epochs = source.block_states(remote), source.epoch[remote]
                return [f"{source.worker}: the GPU lease of {transfer} was released as staged while its copy to "
                        f"host reads the blocks {remote.tolist()} (states {states.tolist()}, epochs "
                        f"{epochs.tolist()}, lease epoch {copy.gpu_epoch})"]
            return []
        if x_remote == self.name:  # D reads the pool
            slots = remote
            states = self.ledger.block_states(slots)
            if copy is None or (states != _SERVING).any() or not np.isin(slots, copy.blocks).all():
                return [f"{self.name}: slot(s) {slots.tolist()} read by {x_owner} for {transfer} are not that "
                        f"copy's SERVING slots (states {states.tolist()})"]
        return []

    def quiescence_checks(self) -> list[str]:
        out = [f"{self.name}: {v}" for v in check_staging_quiescent(self.ledger)]
        if self.transport.open_handles():
            out.append(f"{self.name}: {self.transport.open_handles()} transfer handle(s) left open")
        if self.tier.copies_in_flight:
            out.append(f"{self.name}: {self.tier.copies_in_flight} staging copies never settled")
        return out

    def close(self) -> None:
        self.ledger.commit()
        self.log.close()


__all__ = ["HOST", "POOL_SLOTS", "SimPool", "staging_policy"]
