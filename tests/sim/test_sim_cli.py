"""``kvlifecycle sim``: the JSON summary, and a planted failure that shows its reproducer, a shrunk trace and logs
that ``replay --check`` and ``timeline`` open."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from planted import _fail_without_releasing_handles

from kvlifecycle.cli import main
from kvlifecycle.handoff import Consumer


def test_json_is_the_whole_of_stdout_and_the_table_goes_to_stderr(capsys: pytest.CaptureFixture[str],
                                                                   tmp_path: Path) -> None:
    assert main(["sim", "--seeds", "3", "--json", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["seeds"] == 3 and data["violations"] == 0 and data["leaks"] == 0
    assert {"unexercised", "seeds_per_s", "coverage", "known_findings"} <= set(data)
    assert "target: RESERVED -> LOADING (start_load)" in captured.err  # the coverage table


def test_unknown_fault_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "--faults", "meteor"]) == 2
    assert "unknown fault" in capsys.readouterr().err


def test_planted_failure_prints_its_reproducer_and_a_shrunk_trace(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plant a bug (a failed load leaves its sibling handles posted), find it, shrink it, and open its logs."""
    monkeypatch.setattr(Consumer, "_fail", _fail_without_releasing_handles)
    out_dir = tmp_path / "failures"
    # seeds 10-13: the bug fails 11 alone (each failing seed is shrunk)
    code = main(["sim", "--start", "10", "--seeds", "4", "--out", str(out_dir), "--json"])
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    lines = captured.err.strip().splitlines()
    assert code == 1 and data["failing_seeds"]
    seed = data["failing_seeds"][0]
    failure = data["failures"][0]
    assert f"reproduce: kvlifecycle sim --seed {seed}" in "\n".join(lines)
    assert failure["shrunk_steps"] < failure["steps"]
    trace = Path(failure["trace"]).read_text()
    assert trace.startswith(f"# seed {seed}: {failure['shrunk_steps']} step(s)")
    logs = sorted(str(p) for p in Path(failure["logs"]).iterdir())
    # P0 P1 P2 D0 D1, and P0~host P1~host P2~host in a seed whose P workers stage
    assert len([p for p in logs if not p.endswith("~host")]) == 5
    assert len(logs) in (5, 8)
    assert main(["replay", "--check", *logs]) in (0, 1)  # readable: 2 would mean it could not open them
    assert main(["timeline", *logs, "-o", str(tmp_path / "t.json")]) == 0
    # the reproducer reproduces
    capsys.readouterr()
    assert main(["sim", "--seed", str(seed), "--out", str(tmp_path / "again"), "--no-shrink"]) == 1
    assert f"FAIL seed {seed}" in capsys.readouterr().out
