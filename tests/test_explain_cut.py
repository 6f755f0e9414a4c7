"""``explain`` on a log that stops early: a torn tail is the first finding, and what was open where a torn log
tears or where ``--until`` cuts is reported in flight, never as a leak. Logs written by the real ledgers through the
real log writer; the CLI runs as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS, Pair

from kvlifecycle import explain as explain_module
from kvlifecycle.explain import IN_FLIGHT, LOG_TORN, REQUEST_DID_NOT_END, explain_logs, split_in_flight


def _explain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "explain", *args], capture_output=True, text=True,
                          timeout=120)


def _tear(log_dir: Path, nbytes: int = 37) -> None:
    (segment,) = sorted(log_dir.glob("seg-*.kvl"))
    with open(segment, "r+b") as fh:
        fh.truncate(segment.stat().st_size - nbytes)


def _two_handoffs_p_torn_in_the_second(root: Path) -> Path:
    """req-1 ends on both sides; req-2's completion and free on P are in P's last frame, which the tear cuts."""
    pair = Pair(root)
    first = pair.grant("req-1", [0, 1], [30, 31])
    pair.pull("req-1", first)
    pair.complete("req-1", first)
    pair.d.finish("req-1")
    second = pair.grant("req-2", [2, 3], [28, 29])
    pair.pull("req-2", second)
    pair.p.log.flush()
    pair.complete("req-2", second)
    pair.d.finish("req-2")
    p_dir, _ = pair.close()
    _tear(p_dir, 7)
    return root


def test_a_torn_tail_is_the_first_finding_and_open_work_is_in_flight(tmp_path: Path) -> None:
    _two_handoffs_p_torn_in_the_second(tmp_path)
    _, found = explain_logs([tmp_path])
    faults, in_flight = split_in_flight(found)
    assert [f.rule for f in faults] == [LOG_TORN]
    assert "torn at offset" in faults[0].sentence and "everything after the tear is unknown" in faults[0].sentence
    assert [(f.worker, f.request) for f in in_flight] == [("p0", "req-2")]
    assert "log tears at offset" in in_flight[0].sentence
    assert REQUEST_DID_NOT_END not in {f.rule for f in found}


def test_the_cli_names_the_tear_first(tmp_path: Path) -> None:
    _two_handoffs_p_torn_in_the_second(tmp_path)
    done = _explain(str(tmp_path))
    assert done.returncode == 1, done.stderr
    first = next(line for line in done.stdout.splitlines() if line.startswith("1. "))
    assert first.startswith("1. [log-torn] p0's log ends at")
    assert "in flight where the log stops" in done.stdout and "never freed" not in done.stdout
    as_json = json.loads(_explain(str(tmp_path), "--json").stdout)
    assert [f["rule"] for f in as_json["findings"]] == [LOG_TORN] and as_json["in_flight"]


def test_until_lists_open_handoffs_in_flight_and_exits_0(tmp_path: Path) -> None:
    SCENARIOS["clean"](tmp_path)
    done = _explain(str(tmp_path), "--until", "+4ms", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads(done.stdout)
    assert out["ok"] is True and out["findings"] == []
    assert [v["rule"] for v in out["in_flight"]] == [IN_FLIGHT]
    text = _explain(str(tmp_path), "--until", "+4ms")
    assert text.returncode == 0 and "in flight where the log stops (1; not findings)" in text.stdout


def test_a_complete_log_still_reports_a_request_that_did_not_end(tmp_path: Path) -> None:
    """The in-flight reading applies only where the log stops early: a whole log's leak stays a finding."""
    SCENARIOS["clean"](tmp_path)
    p_dir = tmp_path / "p0"
    assert explain_logs([p_dir])[1] == []


@pytest.mark.slow
def test_a_torn_demo_log_names_the_tear_not_eight_leaks(tmp_path: Path) -> None:
    """The real two-process demo over NIXL, its P log cut by 37 bytes as a crash mid-write leaves it."""
    pytest.importorskip("nixl")
    demo = subprocess.run([sys.executable, "-m", "kvlifecycle", "demo", "--out", str(tmp_path / "demo"),
                           "--requests", "2"], capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    _tear(tmp_path / "demo" / "p0")
    out = json.loads(_explain(str(tmp_path / "demo"), "--json").stdout)
    assert [f["rule"] for f in out["findings"]] == [LOG_TORN]
    assert all(v["rule"] == IN_FLIGHT for v in out["in_flight"])


@pytest.mark.mutants
def test_without_the_tear_the_crash_reads_as_leaks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: explain ignores where a log stops. The torn log's open requests come back as leaks."""
    monkeypatch.setattr(explain_module, "_torn_findings", lambda trace: [])
    monkeypatch.setattr(explain_module, "_log_stops", lambda trace, worker: "")
    _two_handoffs_p_torn_in_the_second(tmp_path)
    _, found = explain_logs([tmp_path])
    assert LOG_TORN not in {f.rule for f in found}
    assert REQUEST_DID_NOT_END in {f.rule for f in found}
