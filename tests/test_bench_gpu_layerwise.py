"""``kvlifecycle bench gpu-layerwise`` runs its whole flow in a tiny shape without a GPU (``--cpu``: P here, D in a
spawned process, NIXL on DRAM): every mode at every prompt length, the poisoned and checked runs byte-exact, the
one JSON line of ``--json`` with the keys the dated records quote. No figure is asserted; the structure and the byte
checks are."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.nixl]

TINY = ["--cpu", "--json", "--tokens", "8,20", "--layers", "3", "--kv-heads", "2", "--head-size", "16",
        "--block-size", "4", "--hidden", "64", "--ffn", "96", "--reps", "2", "--check-reps", "2", "--profile"]


@pytest.fixture(autouse=True)
def _nixl() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (nixl==1.5.1): the harness's CPU transport")


def test_layerwise_harness_runs_every_mode_byte_exact_and_prints_one_json_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvlifecycle", "bench", "gpu-layerwise", *TINY],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 1
    res = json.loads(lines[0])
    assert (res["transport"], res["tokens"], res["byte_exact"]) == ("nixl", [8, 20], True)
    assert res["shape"]["layers"] == 3 and res["shape"]["pool_blocks"] == 2 * 5
    for tokens, blocks in (("8", 2), ("20", 5)):
        per = res["per_tokens"][tokens]
        assert per["blocks"] == blocks and per["bytes"] == blocks * 4 * 2 * 16 * 2 * 2 * 3
        assert per["byte_exact"] is True and per["checked_runs"] == 4  # 2 checked runs of stream and of post
        for mode in ("stream", "post"):
            assert set(per[mode]) == {"prefill_ms", "issue_ms", "post_host_us", "forward_post_us", "t_visible_ms",
                                      "t_visible_wall_ms", "t_visible_d_ms", "hop_after_ms", "e2e_ms"}
            assert per[mode]["t_visible_d_ms"] is not None  # D saw the last copy's notification
        assert set(per["compute"]) == {"prefill_ms", "issue_ms"}
        assert {"t_visible_ratio", "e2e_ratio", "prefill_slowdown_stream"} <= set(per)
        assert per["contiguous_copy_ms"] is None  # a device copy: GPU only
    assert res["t_visible_ratio"] == res["per_tokens"]["20"]["t_visible_ratio"]
    assert set(res["goal"]) == {"t_visible_ratio_max", "at_tokens", "met", "met_per_tokens"}
    assert res["notification_hop_ms"] is not None and "profile_stream" in res
