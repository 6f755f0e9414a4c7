"""``kvlifecycle bench load``, small: the real Producer and Consumer over NIXL (two processes, DRAM) under a bounded
in-flight load with cancels and expiries among the requests. No timing is asserted: that every request ended on
both sides, how, and that both logs replay clean at quiescence."""

from __future__ import annotations

import argparse
import json

import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.cli import bench

pytestmark = [pytest.mark.nixl, pytest.mark.slow]


def test_a_small_load_run_ends_every_request_and_leaves_clean_logs(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["load", "--requests", "300", "--inflight", "16", "--cancel-every", "50",
                              "--expire-every", "70", "--json"])
    code = bench.run(args)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])  # --json: one object, the last line
    assert result["violations"] == []
    assert code == 0 and result["ok"] and result["all_ended"]
    assert result["started"] == result["settled"] == result["released"] == 300
    assert sum(result["d_outcomes"].values()) == 300 and sum(result["p_releases"].values()) == 300
    assert result["p_leases_left"] == 0 and result["d_loads_left"] == 0
    # the twists happened: P cancelled unclaimed leases, zero-TTL leases expired, D abandoned those loads
    assert result["p_releases"]["cancelled"] >= 1 and result["p_releases"]["expired"] >= 3
    assert result["d_outcomes"]["abandoned"] >= 4
    assert 0 < result["d_outcomes"]["loaded"] <= result["p_releases"]["completed"]  # D may drop a completed load
    assert result["log_events"]["p0"] > 300 * 5 and result["log_events"]["d0"] > 300 * 3
    rss = result["rss_kib"]
    for side in ("p", "d"):  # memory flat: nothing kept per request (a loose bound, not a measurement)
        assert rss["end"][side]["peak_rss_kib"] - rss["middle"][side]["peak_rss_kib"] < 64 * 1024
