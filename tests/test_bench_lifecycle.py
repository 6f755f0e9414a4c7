"""The lifecycle benchmark runs, reports every key the issue names, and its logs replay clean (no speed asserted)."""

from __future__ import annotations

import json

import pytest

from kvlifecycle.cli import main


def test_bench_lifecycle_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lifecycle", "--json", "--requests", "300", "--blocks", "16", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("us_per_request_p", "us_per_request_d", "append_events_per_s", "replay_events_per_s", "peak_rss_mb"):
        assert out[key] > 0
    assert out["replay_clean"] is True
    assert out["events_p"] == 300 * 7 and out["events_d"] == 300 * 4
