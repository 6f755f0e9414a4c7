"""``kvlifecycle bench gpu``'s arithmetic, without a GPU: the ratios and goals it prints come from the timings."""

from __future__ import annotations

from typing import Any

import pytest

from kvlifecycle.eventlog import read_events
from kvlifecycle.tools.bench_gpu import Shape, ledger_hot_us, print_table, summarise

MIB = 1 << 20
SHAPES = {"large": Shape(64, 256, 32 * 1024), "small": Shape(64, 16, 32 * 1024)}


def _in_process(ceiling_wall_s: float) -> dict[str, Any]:
    return {"ceiling_event_s": ceiling_wall_s * 0.9, "ceiling_wall_s": ceiling_wall_s,
            "ceiling_pipelined_wall_s": 8 * ceiling_wall_s, "torch_event_s": 10 * ceiling_wall_s,
            "kernel_event_s": ceiling_wall_s, "kernel_variants": {}, "ceiling_exact": True, "torch_exact": True,
            "kernel_exact": True}


def _result() -> dict[str, Any]:
    e2e: dict[str, Any] = {"connect_s": 0.01, "connect": {}, "replay_events": {"p": 10, "d": 8},
                           "replay_violations": [], "large_roundtrip_s": 1e-3, "small_roundtrip_s": 5e-4}
    for label, wall, in_loop, raw in (("large", 300e-6, 330e-6, 250e-6), ("small", 80e-6, 100e-6, 40e-6)):
        e2e |= {f"{label}_wall_s": wall, f"{label}_kernel_s": wall * 0.8, f"{label}_pipelined_wall_s": 8 * wall,
                f"{label}_batched_wall_s": 8 * wall, f"{label}_ceiling_in_loop_wall_s": in_loop,
                f"{label}_ceiling_in_loop_driver_wall_s": raw, f"{label}_exact": True, f"{label}_post_us": 30.0,
                f"{label}_batched_split_us": {"start_loads": 30.0, "issue": 120.0, "part_dones": 25.0},
                f"{label}_steps_us": {"start_load": 10.0, "post": 40.0, "wait_event": 5.0, "part_done": 8.0,
                                      "after_ready": 20.0, "event_seen": 4.0, "complete": 1.0}}
    return {"device": "test", "torch": "x", "triton": "y", "pool_blocks": 2048,
            "shape": {k: {"regions": s.regions, "blocks": s.blocks, "block_bytes": s.block_bytes, "bytes": s.nbytes}
                      for k, s in SHAPES.items()},
            "large": _in_process(270e-6), "small": _in_process(36e-6), "e2e": e2e}


def test_ratios_compare_the_request_with_each_way_of_timing_the_copy(capsys: pytest.CaptureFixture[str]) -> None:
    res = summarise(_result(), SHAPES, pipeline=8)
    assert res["ratio_to_ceiling"] == pytest.approx(270 / 300)
    assert res["ratio_small"] == pytest.approx(36 / 80)
    assert res["ratio_to_ceiling_in_loop"] == pytest.approx(330 / 300)
    assert res["ratio_small_to_ceiling_in_loop_driver"] == pytest.approx(40 / 80)
    assert res["goals"] == {"copy_hot_loop": {"large": True, "small": False},
                            "copy_in_loop": {"large": True, "small": True},
                            "raw_copy_in_loop": {"large": False, "small": False}}
    assert res["goal_large_met"] and not res["goal_small_met"]  # the headline stays the hot-loop copy
    assert res["host_us"]["small"]["raw_copy_in_loop_wall_us"] == pytest.approx(40.0)
    assert res["byte_exact"]
    print_table(res)
    out = capsys.readouterr().out
    assert "timed in D's loop" in out and "raw_copy_in_loop" in out
    assert "as one step, where the wall goes" in out and "'part_dones': 25.0" in out


def test_the_host_budget_is_what_the_goal_leaves_above_the_raw_launch_floor(
        capsys: pytest.CaptureFixture[str]) -> None:
    res = summarise(_result(), SHAPES, pipeline=8)
    small = res["host_budget_us"]["small"]
    # floor = raw copy in D's loop (40) + the kernel's device time beyond the copy's (36 - 32.4)
    assert small["floor_wall_us"] == pytest.approx(43.6)
    assert small["goal_wall_us"] == pytest.approx(36 / 0.6)
    assert small["budget_us"] == pytest.approx(60 - 43.6)
    assert small["spent_us"] == pytest.approx(80 - 43.6)
    assert small["ledger_us"] == pytest.approx(18.0)
    assert small["ratio_at_floor"] == pytest.approx(36 / 43.6, abs=1e-3)
    assert res["host_budget_us"]["large"]["budget_us"] == pytest.approx(300 - 277)
    print_table(res)
    assert "kvl's own host work may take 16.4 us: it takes 36.4 us" in capsys.readouterr().out


def test_the_ledgers_hot_cost_is_timed_on_a_logged_ledger(tmp_path: Any) -> None:
    hot = ledger_hot_us(16, 200, str(tmp_path / "hot"))
    assert set(hot) == {"start_load", "part_done"} and all(v > 0 for v in hot.values())
    # every timed command was logged, as on a request's path (200 timed + 50 warm-up rounds)
    logged = [type(e).__name__ for e in read_events(tmp_path / "hot")]
    assert logged.count("TgtLoadStarted") == logged.count("TgtPartDone") == 250
    raw = _result()
    raw["ledger_hot_us"] = hot
    assert summarise(raw, SHAPES, pipeline=8)["host_budget_us"]["small"]["ledger_hot_us"] == pytest.approx(
        hot["start_load"] + hot["part_done"], abs=0.1)


def test_two_gpu_runs_have_no_one_gpu_budget() -> None:
    raw = _result()
    raw["large"] |= {"peer_ceiling_event_s": 250e-6}
    assert "large" not in summarise(raw, SHAPES, pipeline=8)["host_budget_us"]


def test_a_path_that_was_not_byte_exact_fails_the_run() -> None:
    raw = _result()
    raw["e2e"]["small_exact"] = False
    assert summarise(raw, SHAPES, pipeline=8)["byte_exact"] is False


def test_two_gpu_runs_report_every_path_against_the_peer_copy(capsys: pytest.CaptureFixture[str]) -> None:
    raw = _result()
    for label, peer_s, nixl_s in (("large", 250e-6, 1.0), ("small", 30e-6, 0.1)):
        raw[label] |= {"peer_ceiling_event_s": peer_s, "peer_ceiling_wall_s": 1.1 * peer_s, "nixl_wall_s": nixl_s,
                       "nixl_exact": True}
    gbps = SHAPES["large"].nbytes / 500e-6 / 1e9  # a kernel variant at half the peer copy's rate
    raw["large"]["peer_kernel_variants"] = {"pull": {"8192B/8w": {"event_s": 500e-6, "gbps": gbps, "exact": True}},
                                            "push": {"4096B/4w": {"event_s": 250e-6, "gbps": 2 * gbps,
                                                                  "exact": False}}}
    res = summarise(raw, SHAPES, pipeline=8)
    assert res["large"]["ratio_kvl_to_peer_ceiling"] == pytest.approx(250 / 300)
    assert res["large"]["ratio_nixl_to_peer_ceiling"] == pytest.approx(250e-6 / 1.0)
    assert res["large"]["ratio_kvl_to_peer_ceiling_wall"] == pytest.approx(1.1 * 250 / 300)
    variants = res["large"]["peer_kernel_variants"]
    assert variants["pull"]["8192B/8w"]["ratio_to_peer_ceiling"] == pytest.approx(0.5)
    assert variants["push"]["4096B/4w"]["ratio_to_peer_ceiling"] == pytest.approx(1.0)
    print_table(res)
    out = capsys.readouterr().out
    assert "two GPUs: torch peer copy" in out
    assert "across the peer link, pull" in out and "4096B/4w" in out and "NOT EXACT" in out
