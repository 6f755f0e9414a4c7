"""``kvlifecycle replay``: summaries, checks, filters, and clear errors on bad logs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlifecycle.cli import main
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import segment_paths
from kvlifecycle.ledger import open_ledger


def handoff_logs(tmp_path: Path, *, leave_pinned: bool = False, release_under_reader: bool = False) -> tuple[str, str]:
    clock, hlc = ManualClock(), HybridLogicalClock()
    p = open_ledger("source", 16, str(tmp_path / "p"), clock=clock, hlc=hlc, worker="p0")
    d = open_ledger("target", 16, str(tmp_path / "d"), clock=clock, hlc=hlc, worker="d0")
    p.allocate("r", [1, 2])
    p.prefill_done("r")
    g = p.grant("r")
    d.reserve("r", [3, 4])
    if not release_under_reader:
        p.heartbeat(g.transfer, g.generation)
    d.start_load("r", g.transfer, generation=g.generation)
    if release_under_reader:
        p.cancel("r")  # no claim, so P releases at once: D is reading blocks P may reuse
        p.free("r")
    if not leave_pinned:
        d.part_done(g.transfer, 0)
        if not release_under_reader:
            p.consumer_done(g.transfer, g.generation)
            p.free("r")
        d.finish("r")
    p.log.close()
    d.log.close()
    return str(tmp_path / "p"), str(tmp_path / "d")


def test_replay_check_json_clean(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, d = handoff_logs(tmp_path)
    assert main(["replay", p, d, "--check", "--quiescent", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is True and out["violations"] == []
    assert [s["side"] for s in out["logs"]] == ["source", "target"]
    assert out["logs"][0]["stats"]["completed"] == 1


def test_replay_reports_leftover_pins_at_quiescence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, _d = handoff_logs(tmp_path, leave_pinned=True)
    assert main(["replay", p, "--check"]) == 0  # mid-flight is fine ...
    assert main(["replay", p, "--check", "--quiescent"]) == 1  # ... but not at quiescence
    out = capsys.readouterr().out
    assert "quiescent-leases" in out and "live leases: 1" in out


def test_replay_check_catches_a_release_under_a_reader(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, d = handoff_logs(tmp_path, release_under_reader=True)
    assert main(["replay", p, d, "--check"]) == 1
    assert "released-under-reader" in capsys.readouterr().out


def test_replay_until_index_and_request_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p, _ = handoff_logs(tmp_path)
    assert main(["replay", p, "--until-index", "3", "--json", "--events"]) == 0
    out = json.loads(capsys.readouterr().out)
    kinds = [e["kind"] for e in out["logs"][0]["event_list"]]
    assert kinds == ["SrcAllocated", "SrcPrefillDone", "SrcGranted"]
    assert out["logs"][0]["blocks"]["PINNED_FOR_TRANSFER"] == 2
    assert out["logs"][0]["event_list"][0]["blocks"] == [1, 2]


def test_corrupt_log_is_a_clear_error_and_nothing_is_modified(tmp_path: Path) -> None:
    p, _ = handoff_logs(tmp_path)
    seg = segment_paths(Path(p))[0]
    data = bytearray(seg.read_bytes())
    data[40] ^= 0xFF  # inside the first record, good records follow
    seg.write_bytes(bytes(data))
    proc = subprocess.run(
        [sys.executable, "-m", "kvlifecycle", "replay", p, "--check"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "corrupt event log" in proc.stderr and seg.name in proc.stderr and "offset" in proc.stderr
    assert seg.read_bytes() == bytes(data)


def test_replay_of_a_missing_log(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path / "nope")]) == 2
    assert "no event log" in capsys.readouterr().err


def test_restarted_worker_log_replays_each_incarnation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    first = open_ledger("source", 8, str(tmp_path / "p"), worker="p0")
    first.allocate("r", [1])
    first.prefill_done("r")
    first.grant("r")
    first.log.close()  # "crash" with a pin held
    second = open_ledger("source", 8, str(tmp_path / "p"), worker="p0")
    second.allocate("s", [1])  # the restarted engine reuses block 1
    second.log.close()
    assert main(["replay", str(tmp_path / "p"), "--check", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["logs"][0]
    assert out["restarts"][0]["leases"] == 1 and out["restarts"][0]["pinned_blocks"] == 1
    assert out["blocks"]["ALLOCATED"] == 1


@pytest.mark.parametrize(("mode", "violations"), [("pull", ["released-under-reader"]), ("push", [])])
def test_failed_release_under_a_load_is_a_violation_only_when_d_reads(tmp_path: Path, mode: str, violations) -> None:
    from kvlifecycle.invariants import check_merged
    from kvlifecycle.replay import replay

    clock, hlc = ManualClock(), HybridLogicalClock()
    p = open_ledger("source", 8, str(tmp_path / "p"), clock=clock, hlc=hlc, worker="p0")
    d = open_ledger("target", 8, str(tmp_path / "d"), clock=clock, hlc=hlc, worker="d0")
    p.allocate("r", [1])
    p.prefill_done("r")
    g = p.grant("r")
    p.heartbeat(g.transfer, g.generation)
    d.reserve("r", [2])
    d.start_load("r", g.transfer, generation=g.generation, mode=mode)
    p.fail(g.transfer, g.generation, "write failed" if mode == "push" else "P gave up")  # D still loading
    d.fail(g.transfer, "told by P")
    for ledger in (p, d):
        ledger.log.close()
    found = check_merged(replay(tmp_path / "p").events, replay(tmp_path / "d").events)
    assert [v.rule for v in found] == violations
