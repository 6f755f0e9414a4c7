"""The host staging tier through the real handoff on real NIXL (DRAM, UCX): a Producer whose KV cache and host pool
are two NIXL agents (the pool's agent copies the staged lease from the KV cache's, a local READ), and a Consumer
whose agent reads the staged copy from the pool's agent once the claim reply names its slots — the bytes of the
prefill though P's engine reused the blocks — while a lease claimed before staging is read from the KV cache. The
three logs replay clean with ``replay --check --quiescent``. Every wait is bounded."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.host_pool import HostPool
from kvlifecycle.transports.nixl import NixlTransport
from waiting import until

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import EventLog
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handoff.staging_tier import StagingTier
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StagingPolicy
from kvlifecycle.testing.transport_conformance import HostBuffers

REGIONS, BLOCKS, BLOCK_BYTES, SLOTS = 2, 16, 256, 6
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=64, block_size=1,
                    kv_layout="NHD")
_names = itertools.count()


def test_d_reads_a_staged_lease_from_p_host_pool_over_nixl_and_a_claimed_one_from_the_kv_cache(
        tmp_path: Path) -> None:
    run = f"{next(_names)}-{time.monotonic_ns()}"
    clock, hlc = ManualClock(), HybridLogicalClock()
    p_kv = HostBuffers("random", seed=5, regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    d_kv = HostBuffers("zeros", regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
    pool = HostPool(p_kv.layout, SLOTS)
    t_kv, t_host, t_d = (NixlTransport(f"{who}-{run}") for who in ("p-kv", "p-host", "d"))
    t_kv.register(p_kv.layout)
    t_host.register(pool.layout)
    t_d.register(d_kv.layout)
    logs = {n: EventLog(tmp_path / n, fsync="never") for n in ("p", "staging", "d")}
    p = SourceLedger(BLOCKS, clock=clock, hlc=hlc, worker="P", default_ttl_s=30.0, log=logs["p"])
    pool_ledger = StagingLedger(SLOTS, clock=clock, hlc=hlc, source_worker="P", log=logs["staging"])
    d = TargetLedger(BLOCKS, worker="D", log=logs["d"])
    tier = StagingTier(HostStaging(p, pool_ledger, StagingPolicy(when="after", stage_after_ms=100,
                                                                 pool_blocks=SLOTS)), t_host)
    prod = Producer(p, t_kv, COMPAT, staging=tier, thread=False)
    cons = Consumer(d, t_d, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05))
    try:
        cons.connect(prod.address)

        def p_until(done) -> bool:
            return until(lambda: (prod.step_once(), done())[1], timeout_s=20)

        # a D that claims first: the lease is never staged, and D reads the KV cache
        for request, blocks in (("early", [1, 2]), ("slow", [3, 4, 5])):
            p.allocate(request, blocks)
            p.prefill_done(request)
        early, slow = prod.grant("early"), prod.grant("slow")
        d.reserve("early", [0, 1])
        cons.pull("early", early, address=prod.address)
        assert cons.wait_idle(20) and d.stats["loaded"] == 1
        expected_early = [a[[1, 2]].copy() for a in p_kv.arrays]
        # the other lease goes unclaimed past stage_after_ms: staged, and its GPU blocks reused
        clock.advance(0.2)
        assert p_until(lambda: pool_ledger.counts()["STAGED"] == 3)
        assert p_until(lambda: "early" not in {r.request for r in p.leases.values()})
        released = {r.request: r.reason for r in p.take_released()}
        assert released == {"early": "completed", "slow": "staged"}
        expected_slow = [a[[3, 4, 5]].copy() for a in p_kv.arrays]
        p.free("slow")
        p.free("early")
        for a in p_kv.arrays:
            a[[1, 2, 3, 4, 5]] = 0xEE
        d.reserve("slow", [5, 6, 7])
        cons.pull("slow", slow, address=prod.address)
        assert cons.wait_idle(20) and d.stats["loaded"] == 2
        for r in range(REGIONS):
            assert np.array_equal(d_kv.arrays[r][[0, 1]], expected_early[r])
            assert np.array_equal(d_kv.arrays[r][[5, 6, 7]], expected_slow[r])
        assert p_until(lambda: pool_ledger.stats["completed"] == 1)
        d.finish("early")
        d.finish("slow")
    finally:
        cons.close()
        prod.close()
        for t in (t_d, t_host, t_kv):
            t.close()
        for log in logs.values():
            log.close()
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay",
                          *(str(tmp_path / n) for n in ("p", "staging", "d")), "--check", "--quiescent"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
