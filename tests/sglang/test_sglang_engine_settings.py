"""SGLang's own disaggregation settings are the backend's settings: an operator's ``SGLANG_DISAGGREGATION_*``
timeouts and heartbeat reach the kvlifecycle backend (a ``KVL_SGLANG_*`` variable only refines them). Real SGLang
processes (the driver in the SGLang environment)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import sglang_harness as h
from test_sglang_backend import _ledgers_quiescent, _room

SETTINGS = """
import json
from kvlifecycle.adapters.sglang.manager import Settings
s = Settings.from_env()
print(json.dumps({"serve": s.serve_timeout_s, "claim": s.claim_timeout_s, "heartbeat": s.heartbeat_s,
                  "peer": s.peer_timeout_s}))
"""


def _settings(env_extra: dict[str, str]) -> dict[str, float]:
    h.require_sglang()
    env = {k: v for k, v in h.base_env().items()
           if not k.startswith(("KVL_SGLANG_", "SGLANG_DISAGGREGATION_"))}
    done = subprocess.run([str(h.SGLANG_PY), "-c", SETTINGS], capture_output=True, text=True, timeout=300,
                          env={**env, **env_extra})
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_sglang_timeouts_and_heartbeat_become_the_backends_bounds() -> None:
    assert _settings({}) == {"serve": 300.0, "claim": 120.0, "heartbeat": 1.0, "peer": 10.0}
    engine = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "20", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "600",
              "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "3", "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "4"}
    assert _settings(engine) == {"serve": 20.0, "claim": 600.0, "heartbeat": 3.0, "peer": 12.0}
    refined = {**engine, "KVL_SGLANG_SERVE_TIMEOUT_S": "15", "KVL_SGLANG_PEER_TIMEOUT_S": "7"}
    assert _settings(refined) == {"serve": 15.0, "claim": 600.0, "heartbeat": 3.0, "peer": 7.0}


def test_a_room_a_live_prefill_never_serves_fails_after_sglangs_waiting_timeout(tmp_path: Path) -> None:
    """SGLang's NIXL backend fails such a room after SGLANG_DISAGGREGATION_WAITING_TIMEOUT; so does this one."""
    run = h.run_pair(tmp_path, "silent", env_extra={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3"})
    d, p = run.results["decode"], run.results["prefill"]
    assert _room(d, 0)["status"] == "success" and _room(p, 0)["status"] == "success"
    for side in (d, p):
        assert _room(side, 600)["status"] == "failed", _room(side, 600)
        assert "did not serve room" in _room(side, 600)["reason"] and "3 s" in _room(side, 600)["reason"]
    _ledgers_quiescent(run)
