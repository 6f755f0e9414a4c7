"""Per-block digests inside real SGLang (0.5.23, CPU, DRAM KV over NIXL/UCX loopback): with ``KVL_SGLANG_VERIFY``
(or SGLang's own ``--disaggregation-enable-kv-checksum``) each room's layer batch carries P's digest and the
decode checks what landed before the room is ``Success``; a byte flipped after landing fails that room before
SGLang reads it, and the decode's log says which blocks and why. How the setting is read: the backend's
``Settings.verification``, in the SGLang environment."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import sglang_harness as h
from test_sglang_backend import _replay_all

from kvlifecycle import events as ev
from kvlifecycle.replay import check, check_pair

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

VERIFICATION = """
import json, types
import numpy as np
from kvlifecycle.adapters.sglang.manager import Settings
from kvlifecycle.layout import grouped_layout, rows_layout
pages, aux = np.zeros((4, 64), np.uint8), np.zeros((2, 16), np.uint8)
host = grouped_layout(rows_layout("DRAM", 0, [pages.ctypes.data], [pages.nbytes], [64]),
                      rows_layout("DRAM", 0, [aux.ctypes.data], [aux.nbytes], [16]))
gpu = grouped_layout(rows_layout("VRAM", 0, [1 << 40], [256], [64]), rows_layout("DRAM", 0, [aux.ctypes.data],
                     [aux.nbytes], [16]))
checksum = types.SimpleNamespace(disaggregation_enable_kv_checksum=True)
plain = types.SimpleNamespace(disaggregation_enable_kv_checksum=False)
out = {}
for name, settings, args, layout in [("default", Settings(), plain, host),
                                      ("sglang_checksum", Settings(), checksum, host),
                                      ("sglang_checksum_gpu", Settings(), checksum, gpu),
                                      ("own_sample", Settings(verify="sample"), checksum, host),
                                      ("own_none", Settings(verify="none"), checksum, host)]:
    mode, digester = settings.verification(args, layout)
    out[name] = [mode.value, type(digester).__name__]
try:
    Settings(verify="all").verification(plain, gpu)
except ValueError as exc:
    out["own_all_gpu"] = str(exc)
try:
    Settings(verify="every").verification(plain, host)
except ValueError as exc:
    out["bad"] = str(exc)
print(json.dumps(out))
"""


def test_the_verify_setting_follows_sglangs_checksum_and_refuses_vram_in_words() -> None:
    h.require_sglang()
    done = subprocess.run([str(h.SGLANG_PY), "-c", VERIFICATION], capture_output=True, text=True, timeout=300,
                          env=h.base_env())
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["default"] == ["none", "NoneType"]
    assert out["sglang_checksum"] == ["all", "HostDigester"]  # the operator's own switch turns it on
    assert out["sglang_checksum_gpu"] == ["none", "NoneType"]  # pages in VRAM: SGLang's own checksum only
    assert out["own_sample"] == ["sample", "HostDigester"] and out["own_none"] == ["none", "NoneType"]
    assert "VRAM" in out["own_all_gpu"] and "KVL_SGLANG_VERIFY" in out["own_all_gpu"]
    assert "every" in out["bad"]


def test_rooms_are_verified_and_a_byte_flipped_on_the_way_fails_its_room_before_success(tmp_path: Path) -> None:
    run = h.run_pair(tmp_path, "transfer", env_extra={"KVL_SGLANG_VERIFY": "all"},
                     decode_extra=["--corrupt-landed", "1"])
    d = run.results["decode"]
    statuses = {room: r["status"] for room, r in d["rooms"].items()}
    failed = [room for room, status in statuses.items() if status == "failed"]
    assert len(failed) == 1 and all(s == "success" for r, s in statuses.items() if r not in failed), statuses
    assert "digest mismatch" in d["rooms"][failed[0]]["reason"], d["rooms"][failed[0]]
    results = _replay_all(run.log_dir)
    target = next(r for r in results if r.side == "target")
    mismatches = [e for e in target.events if isinstance(e, ev.TgtDigestMismatch)]
    assert len(mismatches) == 1
    done = [e for e in target.events if isinstance(e, ev.TgtPartDone)]
    assert len(done) == len(statuses) - 1 and all(e.verified > 0 for e in done)  # every room that landed: checked
    for r in results:
        assert check(r, quiescent=True) == []
    assert check_pair(results) == []
