"""A ledger handed a log opened as ``EventLog(dir)`` writes the header replay needs: the log replays through the real
``kvlifecycle replay --check``; a log that cannot take the header is refused in words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvlifecycle import ManualClock, SourceLedger, TargetLedger
from kvlifecycle.eventlog import EventLog, LogError


def _one_handoff(p: SourceLedger, d: TargetLedger) -> None:
    p.allocate("r", [1, 2])
    p.prefill_done("r")
    grant = p.grant("r")
    d.reserve("r", [3, 4])
    p.heartbeat(grant.transfer, grant.generation)
    d.start_load("r", grant.transfer, generation=grant.generation)
    d.part_done(grant.transfer)
    p.consumer_done(grant.transfer, grant.generation)
    p.free("r")
    d.finish("r")


def _replay_check(*dirs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", *map(str, dirs), "--check"],
                          capture_output=True, text=True, timeout=120)


def _write_pair(tmp_path: Path) -> tuple[Path, Path]:
    clock = ManualClock()
    p = SourceLedger(8, log=EventLog(tmp_path / "p", fsync="never"), clock=clock, worker="p0")
    d = TargetLedger(8, log=EventLog(tmp_path / "d", fsync="never"), clock=clock, worker="d0")
    _one_handoff(p, d)
    assert p.log is not None and d.log is not None
    p.log.close()
    d.log.close()
    return tmp_path / "p", tmp_path / "d"


def test_a_ledger_given_a_headerless_log_writes_a_log_that_replays(tmp_path: Path) -> None:
    p_dir, d_dir = _write_pair(tmp_path)
    done = _replay_check(p_dir, d_dir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "side=source worker=p0" in done.stdout and "side=target worker=d0" in done.stdout
    assert "invariants: OK" in done.stdout


def test_the_log_keeps_the_ledgers_header_across_a_reopen(tmp_path: Path) -> None:
    p_dir, _ = _write_pair(tmp_path)
    again = SourceLedger(8, log=EventLog(p_dir, fsync="never"), worker="p0")
    assert again.log is not None and again.log.header["side"] == "source"
    again.log.close()
    with pytest.raises(LogError, match="belongs to worker='p0'"):
        SourceLedger(8, log=EventLog(p_dir, fsync="never"), worker="other")


def test_a_log_that_already_holds_records_is_refused_in_words(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "p", fsync="never")
    source = SourceLedger(8, worker="p0")
    source.log = log  # attached after construction: nothing adopts a header here
    source.allocate("r", [1])
    with pytest.raises(LogError, match="open_ledger"):
        TargetLedger(8, log=log)
    log.close()


def test_a_log_opened_for_another_side_is_refused(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "d", header={"side": "target", "worker": "d0", "num_blocks": 8}, fsync="never")
    with pytest.raises(LogError, match="opened for side='target'"):
        SourceLedger(8, log=log, worker="d0")
    log.close()


@pytest.mark.mutants
def test_without_the_adopted_header_the_replay_check_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: a ledger leaves a headerless log as it found it. The real replay then cannot rebuild it."""
    monkeypatch.setattr(EventLog, "adopt_header", lambda self, header: None)
    p_dir, d_dir = _write_pair(tmp_path)
    done = _replay_check(p_dir, d_dir)
    assert done.returncode != 0
    assert "names no known side" in done.stdout + done.stderr
