"""An NTP step of a host's wall clock (seconds, forward or back) mid-run: the HLC's stamps follow the monotonic clock
from the wall time read at start, so a step neither moves this process's stamps against its peers' nor makes
``replay --check`` order events no message links (P's lease expiry, D's end of its read) by the step. Found by the
simulator's clock-jump fault: D's wall clock stepped 5 s forward, D cancelled its read at its bound before P's
expiry, and the merged logs said the read ended 0.2 s after the expiry."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from kvlifecycle.clock import LOGICAL_BITS, HybridLogicalClock, ManualClock
from kvlifecycle.invariants import READ_OUTLIVED_LEASE
from kvlifecycle.ledger import open_ledger
from kvlifecycle.replay import check_pair, replay

START_S = 1_800_000_000.0


def test_a_wall_clock_step_does_not_move_the_stamps_of_a_running_clock() -> None:
    clock, step = ManualClock(START_S), [0.0]
    hlc = HybridLogicalClock(wall_ms=lambda: int((clock.now() + step[0]) * 1000),
                             steady_ms=lambda: int(clock.now() * 1000))
    before = hlc.tick()
    step[0] = 5.0  # NTP steps the wall clock 5 s forward
    clock.advance(0.010)
    assert (hlc.tick() - before) >> LOGICAL_BITS == 10  # 10 ms later by the monotonic clock, not 5.01 s
    step[0] = -30.0  # and 30 s back
    clock.advance(0.010)
    assert (hlc.tick() - before) >> LOGICAL_BITS == 20
    restarted = HybridLogicalClock(wall_ms=lambda: int((clock.now() + step[0]) * 1000),
                                   steady_ms=lambda: int(clock.now() * 1000))
    assert restarted.tick() >> LOGICAL_BITS == int((clock.now() - 30.0) * 1000)  # the next start reads the step


def test_the_system_clock_hlc_ignores_a_step_of_the_wall_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    hlc = HybridLogicalClock()
    before = hlc.tick()
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 5_000_000_000)  # the wall clock stepped 5 s forward
    after = hlc.tick()
    assert (after - before) >> LOGICAL_BITS < 1000  # stamps moved with the monotonic clock only
    assert after > before


def test_a_read_cancelled_before_the_expiry_checks_clean_across_a_step_of_ds_wall_clock(tmp_path: Path) -> None:
    """D claims a 2 s lease, its wall clock steps 5 s forward, D cancels its read at its bound (1.8 s after the
    claim) and P expires the lease at 2 s: the merged logs must not say the read outlived the lease."""
    clock, d_step = ManualClock(START_S), [0.0]
    p_hlc = HybridLogicalClock(wall_ms=lambda: int(clock.now() * 1000), steady_ms=lambda: int(clock.now() * 1000))
    d_hlc = HybridLogicalClock(wall_ms=lambda: int((clock.now() + d_step[0]) * 1000),
                               steady_ms=lambda: int(clock.now() * 1000))
    p = open_ledger("source", 8, str(tmp_path / "p0"), worker="p0", clock=clock, hlc=p_hlc, fsync="never")
    d = open_ledger("target", 8, str(tmp_path / "d0"), worker="d0", clock=clock, hlc=d_hlc, fsync="never")
    p.allocate("r", [1, 2])
    p.prefill_done("r")
    g = p.grant("r", ttl_s=2.0)
    d.reserve("r", [3, 4])
    assert p.heartbeat(g.transfer, g.generation, peer="d0")  # the claim
    d.hlc.observe(p.hlc.last)  # its answer carries P's stamp
    d.start_load("r", g.transfer, generation=g.generation, peer="p0")
    clock.advance(0.5)
    d_step[0] = 5.0  # NTP steps D's wall clock
    clock.advance(1.3)
    d.fail(g.transfer, "read outlived its lease: read cancelled at its lease's bound")
    clock.advance(0.3)
    assert p.sweep() == [g.transfer]
    p.take_released()
    p.free("r")
    p.allocate("s", [1, 2])
    p.log.close()
    d.log.close()
    found = check_pair([replay(tmp_path / "p0"), replay(tmp_path / "d0")])
    assert not [v for v in found if v.rule == READ_OUTLIVED_LEASE], found
