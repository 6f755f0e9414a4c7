"""The host staging tier through the real handoff on real NIXL (DRAM, UCX): a Producer whose KV cache and host pool
are two NIXL agents (the pool's agent copies the staged lease from the KV cache's, a local READ), and a Consumer
whose agent reads the staged copy from the pool's agent once the claim reply names its slots — the bytes of the
prefill though P's engine reused the blocks — while a lease claimed before staging is read from the KV cache; a D
that pushes gets the staged copy written by the pool's agent. The three logs replay clean with ``replay --check
--quiescent``. Every wait is bounded."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from collections.abc import Callable
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


class Site:
    """P (KV cache and host pool: two NIXL agents, a manual clock, its loop turned by the test) and a threaded D,
    each with its log under ``log_dir``."""

    def __init__(self, log_dir: Path, *, push: bool = False) -> None:
        run = f"{next(_names)}-{time.monotonic_ns()}"
        self.log_dir, self.clock, hlc = log_dir, ManualClock(), HybridLogicalClock()
        self.p_kv = HostBuffers("random", seed=5, regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
        self.d_kv = HostBuffers("zeros", regions=REGIONS, blocks=BLOCKS, block_bytes=BLOCK_BYTES)
        # kept on the site: NIXL holds only the pool's addresses, and a pool collected at the end of __init__ gives
        # its pages back to the allocator while the agent still reads and writes them
        self.host_pool = pool = HostPool(self.p_kv.layout, SLOTS)
        self.transports = [NixlTransport(f"{who}-{run}") for who in ("p-kv", "p-host", "d")]
        t_kv, t_host, t_d = self.transports
        t_kv.register(self.p_kv.layout)
        t_host.register(pool.layout)
        t_d.register(self.d_kv.layout)
        self.logs = {n: EventLog(log_dir / n, fsync="never") for n in ("p", "staging", "d")}
        self.p = SourceLedger(BLOCKS, clock=self.clock, hlc=hlc, worker="P", default_ttl_s=30.0, log=self.logs["p"])
        self.pool = StagingLedger(SLOTS, clock=self.clock, hlc=hlc, source_worker="P", log=self.logs["staging"])
        self.d = TargetLedger(BLOCKS, worker="D", log=self.logs["d"])
        tier = StagingTier(HostStaging(self.p, self.pool, StagingPolicy(when="after", stage_after_ms=100,
                                                                          pool_blocks=SLOTS)), t_host)
        self.prod = Producer(self.p, t_kv, COMPAT, staging=tier, thread=False)
        self.cons = Consumer(self.d, t_d, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05))
        self.cons.connect(self.prod.address, push=push)

    def p_until(self, done: Callable[[], bool]) -> bool:
        return until(lambda: (self.prod.step_once(), done())[1], timeout_s=20)

    def close_and_replay_check(self) -> None:
        self.cons.close()
        self.prod.close()
        for t in reversed(self.transports):
            t.close()
        for log in self.logs.values():
            log.close()
        out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay",
                              *(str(self.log_dir / n) for n in ("p", "staging", "d")), "--check", "--quiescent"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def make_site(tmp_path: Path):
    sites: list[Site] = []

    def make(**kwargs: bool) -> Site:
        sites.append(Site(tmp_path, **kwargs))
        return sites[-1]

    yield make
    for site in sites:  # closed already by a test that passed; a failed one's threads end here
        site.cons.close()
        site.prod.close()
        for t in site.transports:
            t.close()


def test_d_reads_a_staged_lease_from_p_host_pool_over_nixl_and_a_claimed_one_from_the_kv_cache(make_site) -> None:
    site = make_site()
    p, d, pool_ledger, cons, prod, clock = site.p, site.d, site.pool, site.cons, site.prod, site.clock
    # a D that claims first: the lease is never staged, and D reads the KV cache
    for request, blocks in (("early", [1, 2]), ("slow", [3, 4, 5])):
        p.allocate(request, blocks)
        p.prefill_done(request)
    early, slow = prod.grant("early"), prod.grant("slow")
    d.reserve("early", [0, 1])
    cons.pull("early", early, address=prod.address)
    assert cons.wait_idle(20) and d.stats["loaded"] == 1
    expected_early = [a[[1, 2]].copy() for a in site.p_kv.arrays]
    # the other lease goes unclaimed past stage_after_ms: staged, and its GPU blocks reused
    clock.advance(0.2)
    assert site.p_until(lambda: pool_ledger.counts()["STAGED"] == 3)
    assert site.p_until(lambda: "early" not in {r.request for r in p.leases.values()})
    released = {r.request: r.reason for r in p.take_released()}
    assert released == {"early": "completed", "slow": "staged"}
    expected_slow = [a[[3, 4, 5]].copy() for a in site.p_kv.arrays]
    p.free("slow")
    p.free("early")
    for a in site.p_kv.arrays:
        a[[1, 2, 3, 4, 5]] = 0xEE
    d.reserve("slow", [5, 6, 7])
    cons.pull("slow", slow, address=prod.address)
    assert cons.wait_idle(20) and d.stats["loaded"] == 2
    for r in range(REGIONS):
        assert np.array_equal(site.d_kv.arrays[r][[0, 1]], expected_early[r])
        assert np.array_equal(site.d_kv.arrays[r][[5, 6, 7]], expected_slow[r])
    assert site.p_until(lambda: pool_ledger.stats["completed"] == 1)
    d.finish("early")
    d.finish("slow")
    site.close_and_replay_check()


def test_a_push_of_a_staged_lease_is_written_from_p_host_pool_over_nixl(make_site) -> None:
    """D in push mode asks for a lease P staged and whose blocks P's engine reused: the pool's NIXL agent writes
    the slots into D's blocks (the prefill's bytes), and the write's completion ends the copy."""
    site = make_site(push=True)
    site.p.allocate("slow", [3, 4, 5])
    site.p.prefill_done("slow")
    site.prod.grant("slow")
    expected = [a[[3, 4, 5]].copy() for a in site.p_kv.arrays]
    site.clock.advance(0.2)
    assert site.p_until(lambda: site.pool.counts()["STAGED"] == 3)
    assert [r.reason for r in site.p.take_released()] == ["staged"]
    site.p.free("slow")
    for a in site.p_kv.arrays:
        a[[3, 4, 5]] = 0xEE
    site.d.reserve("slow", [5, 6, 7])
    assert site.cons.load("slow", "slow", [site.prod.address], push=True) is not None
    assert site.p_until(lambda: site.d.stats["loaded"] == 1 and site.pool.stats["completed"] == 1)
    for r in range(REGIONS):
        assert np.array_equal(site.d_kv.arrays[r][[5, 6, 7]], expected[r])
    site.d.finish("slow")
    site.close_and_replay_check()
