"""P's host staging pool on real NIXL (DRAM, UCX): P's KV cache and its host pool each registered with an agent of
their own, D's KV cache with a third. A lease staged and handed over is read by D from the pool — the right bytes,
though P's engine reused the blocks the moment the lease let them go; a lease claimed before the hand-over is read
from the KV cache. The ledgers' logs replay clean through the real ``kvlifecycle replay --check --quiescent``; a
mutant that hands the GPU blocks over before the copy completed gives D the reused blocks' bytes, and the check
names it. Every wait is bounded."""

from __future__ import annotations

import gc
import itertools
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.host_pool import HostPool
from kvlifecycle.transports.nixl import NixlTransport

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import EventLog
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.staging import HostStaging, Where
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StagingPolicy
from kvlifecycle.testing.transport_conformance import HostBuffers, wait_status
from kvlifecycle.transport import XferOp, XferStatus

REGIONS, BLOCKS, BLOCK_BYTES, SLOTS = 4, 32, 512, 8
_names = itertools.count()


class Deployment:
    """P (KV cache + host pool, two agents, one HLC), D (one agent), their ledgers logging under ``logs``."""

    def __init__(self, logs: Path) -> None:
        run = f"{next(_names)}-{time.monotonic_ns()}"
        self.clock, hlc = ManualClock(), HybridLogicalClock()
        self.p_kv = HostBuffers("random", seed=3, regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
        self.d_kv = HostBuffers("zeros", regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
        self.pool = HostPool(self.p_kv.layout, SLOTS)
        self.t_kv, self.t_host, self.t_d = (NixlTransport(f"{who}-{run}") for who in ("p-kv", "p-host", "d"))
        self.t_kv.register(self.p_kv.layout)
        self.t_host.register(self.pool.layout)  # the pool beside the KV cache, as DRAM
        self.t_d.register(self.d_kv.layout)
        # D knows both of P's agents; which one a read goes to is the claim's answer
        self.peer_of = {Where.GPU: self.t_d.add_peer(self.t_kv.local_metadata()),
                        Where.HOST: self.t_d.add_peer(self.t_host.local_metadata())}
        self.p = SourceLedger(BLOCKS, clock=self.clock, hlc=hlc, worker="P", log=EventLog(logs / "p", fsync="never"))
        self.pool_ledger = StagingLedger(SLOTS, clock=self.clock, hlc=hlc, source_worker="P",
                                         log=EventLog(logs / "staging", fsync="never"))
        self.d = TargetLedger(BLOCKS, clock=self.clock, hlc=hlc, worker="D", log=EventLog(logs / "d", fsync="never"))
        self.staging = HostStaging(self.p, self.pool_ledger, StagingPolicy(when="after", pool_blocks=SLOTS))

    def engine_reuses_released_blocks(self) -> None:
        """P's engine frees what a lease let go and writes a new request's KV into those blocks at once."""
        for released in self.p.take_released():
            blocks = self.p.requests[released.request].blocks.copy()
            self.p.free(released.request)
            for region in self.p_kv.arrays:
                region[blocks] = 0xEE

    def d_pulls(self, request: str, transfer: str, generation: int, d_blocks: list[int]) -> tuple[Where, bool]:
        """D claims, reads from where the claim says, and ends its read; (where, bytes landed)."""
        self.d.reserve(request, d_blocks)
        where = self.staging.claim(transfer, generation, "D")
        assert where is not Where.NOWHERE
        remote = (self.pool_ledger.requests[transfer].blocks if where is Where.HOST
                  else self.p.leases[transfer].blocks)
        self.d.start_load(request, transfer, generation=generation)
        plan = self.t_d.prepare(self.peer_of[where])
        handle = self.t_d.post(XferOp.READ, plan, np.asarray(d_blocks), remote, transfer=transfer)
        ok = wait_status(self.t_d, handle) is XferStatus.DONE
        self.t_d.release(handle)
        if ok:
            self.d.part_done(transfer)
        else:
            self.d.fail(transfer, "read failed")
        self.staging.read_done(where, transfer, generation, ok=ok)
        return where, ok

    def close(self) -> None:
        for ledger in (self.p, self.pool_ledger, self.d):
            assert ledger.log is not None
            ledger.log.close()
        for transport in (self.t_d, self.t_host, self.t_kv):
            transport.close()


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[Deployment]:
    made = Deployment(tmp_path)
    try:
        yield made
    finally:
        made.close()


def _granted(dep: Deployment, request: str, blocks: list[int]) -> tuple[str, int, list[np.ndarray]]:
    dep.p.allocate(request, blocks)
    dep.p.prefill_done(request)
    grant = dep.p.grant(request)
    expected = [region[blocks].copy() for region in dep.p_kv.arrays]
    return grant.transfer, grant.generation, expected


def _landed(dep: Deployment, d_blocks: list[int], expected: list[np.ndarray]) -> bool:
    return all(np.array_equal(dep.d_kv.arrays[r][d_blocks], expected[r]) for r in range(REGIONS))


def _stage(dep: Deployment, transfer: str) -> bool:
    plan = dep.staging.begin(transfer)
    assert plan is not None
    dep.engine_reuses_released_blocks()  # whatever the ledger let go by now is fair game for the engine
    dep.pool.copy_in(plan.gpu_blocks, plan.slots)
    handed = dep.staging.copy_done(transfer)
    dep.engine_reuses_released_blocks()
    return handed


def _replay_check(logs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", *(str(logs / n) for n in
                           ("p", "staging", "d")), "--check", "--quiescent"], capture_output=True, text=True,
                          timeout=120)


def test_d_reads_a_staged_lease_from_the_host_pool_after_p_reused_its_blocks(deployment: Deployment,
                                                                               tmp_path: Path) -> None:
    dep = deployment
    transfer, generation, expected = _granted(dep, "r0", [3, 9, 4])
    assert _stage(dep, transfer)
    assert all((region[[3, 9, 4]] == 0xEE).all() for region in dep.p_kv.arrays)  # P took its blocks back
    assert dep.d_pulls("r0", transfer, generation, [0, 1, 2]) == (Where.HOST, True)
    assert _landed(dep, [0, 1, 2], expected)
    dep.d.finish("r0")
    # claimed before any staging: read from the KV cache's agent, the GPU copy pinned until the read ended
    transfer, generation, expected = _granted(dep, "r1", [10, 11])
    assert dep.d_pulls("r1", transfer, generation, [5, 6]) == (Where.GPU, True)
    assert _landed(dep, [5, 6], expected)
    dep.engine_reuses_released_blocks()
    dep.d.finish("r1")
    dep.close()
    out = _replay_check(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_claim_during_the_copy_reads_the_pinned_kv_cache(deployment: Deployment, tmp_path: Path) -> None:
    dep = deployment
    transfer, generation, expected = _granted(dep, "r0", [7, 8])
    plan = dep.staging.begin(transfer)
    assert plan is not None
    dep.d.reserve("r0", [1, 2])
    assert dep.staging.claim(transfer, generation, "D") is Where.GPU
    dep.pool.copy_in(plan.gpu_blocks, plan.slots)
    assert not dep.staging.copy_done(transfer)  # the copy is dropped: D may be reading the KV cache
    dep.engine_reuses_released_blocks()
    assert (dep.p_kv.arrays[0][[7, 8]] != 0xEE).any()  # still pinned, still P's request's bytes
    dep.d.start_load("r0", transfer, generation=generation)
    handle = dep.t_d.post(XferOp.READ, dep.t_d.prepare(dep.peer_of[Where.GPU]), np.array([1, 2]), plan.gpu_blocks)
    assert wait_status(dep.t_d, handle) is XferStatus.DONE
    dep.t_d.release(handle)
    dep.d.part_done(transfer)
    dep.staging.read_done(Where.GPU, transfer, generation)
    assert _landed(dep, [1, 2], expected)
    dep.engine_reuses_released_blocks()
    dep.d.finish("r0")
    dep.close()
    out = _replay_check(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.mutants
def test_mutant_handing_over_before_the_copy_gives_d_reused_bytes_and_the_check_names_it(
        deployment: Deployment, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_begin = HostStaging.begin

    def begin_and_hand_over(self: HostStaging, transfer: str):  # type: ignore[no-untyped-def]
        plan = real_begin(self, transfer)
        if plan is not None:  # the mutant: the GPU blocks go back when the copy starts, not when it completed
            self.source.hand_over_staged(transfer, self.pool.requests[transfer].generation)
        return plan

    def completed(self: HostStaging, transfer: str, ok: bool = True, reason: str = "") -> bool:
        return self.pool.copy_completed(transfer)  # (the lease was handed over already)

    monkeypatch.setattr(HostStaging, "begin", begin_and_hand_over)
    monkeypatch.setattr(HostStaging, "copy_done", completed)
    dep = deployment
    transfer, generation, expected = _granted(dep, "r0", [3, 4])
    _stage(dep, transfer)
    assert dep.d_pulls("r0", transfer, generation, [0, 1]) == (Where.HOST, True)
    assert not _landed(dep, [0, 1], expected)  # D got the engine's new request's bytes
    dep.d.finish("r0")
    dep.close()
    out = _replay_check(tmp_path)
    assert out.returncode == 1 and "staged-before-copy" in out.stdout, out.stdout + out.stderr


def test_a_registered_pool_lives_as_long_as_the_agent_holds_its_layout() -> None:
    """NIXL is handed addresses only: the layout names the pool as its owner, so the agent that registered it keeps
    the pool's pages alive after the caller dropped the pool (a pool collected under the agent gave D reused pages).
    Mutant: a layout without its owner lets the pool go."""
    p_kv = HostBuffers("random", seed=3, regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    agent = NixlTransport(f"pool-owner-{next(_names)}-{time.monotonic_ns()}")
    try:
        pool = HostPool(p_kv.layout, SLOTS)
        agent.register(pool.layout)
        alive = weakref.ref(pool)
        del pool
        gc.collect()
        assert alive() is not None
        # the mutant: the same pool whose layout forgets its owner is freed at its last reference
        orphan = HostPool(p_kv.layout, SLOTS)
        orphan.layout = attrs.evolve(orphan.layout, owner=None)
        layout, gone = orphan.layout, weakref.ref(orphan)
        del orphan
        gc.collect()
        assert gone() is None and layout.owner is None
    finally:
        agent.close()
    del agent
    gc.collect()
    assert alive() is None  # the agent was the last holder
