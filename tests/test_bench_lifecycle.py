"""The lifecycle benchmark runs, reports its documented keys, its logs replay clean (no speed asserted), and it prints
exactly one JSON line with --json and its progress on stderr only at a terminal."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from kvlifecycle.cli import main


@pytest.fixture
def quick_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verb's tracing-overhead figure is measured by its own test below: a stand-in here, so these
    tests run the verb's output paths in a second, not its 6,000 traced handoffs."""
    import kvlifecycle.tools.bench_lifecycle

    monkeypatch.setattr(kvlifecycle.tools.bench_lifecycle, "measure_tracing_overhead",
                        lambda: SimpleNamespace(ratio=1.0, sdk_ratio=None))


@pytest.mark.usefixtures("quick_tracing")
def test_bench_lifecycle_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lifecycle", "--json", "--requests", "300", "--blocks", "16", "--rounds", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tracing_noop_over_untraced"] == 1.0  # the tracing figure is reported (measured below)
    for key in ("us_per_request_p", "us_per_request_d", "append_events_per_s", "replay_events_per_s", "peak_rss_mb"):
        assert out[key] > 0
    assert out["replay_clean"] is True
    assert out["events_p"] == 300 * 7 and out["events_d"] == 300 * 4


SMALL = ["bench", "lifecycle", "--requests", "100", "--blocks", "4", "--rounds", "2"]


def _on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both streams claim to be terminals, as when a person runs the verb (capsys still captures them)."""
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


@pytest.mark.usefixtures("quick_tracing")
def test_with_json_the_output_is_one_json_object_line_even_on_a_terminal(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _on_a_terminal(monkeypatch)
    assert main([*SMALL, "--json"]) == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert len(lines) == 1 and captured.out == lines[0] + "\n"
    assert isinstance(json.loads(lines[0]), dict)
    assert captured.err == ""  # no bar, no progress text


@pytest.mark.usefixtures("quick_tracing")
def test_on_a_terminal_the_bar_goes_to_stderr_and_the_table_to_stdout(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _on_a_terminal(monkeypatch)
    assert main(SMALL) == 0
    captured = capsys.readouterr()
    assert "bench lifecycle" in captured.err and "round 2 of 2 done" in captured.err
    assert captured.out.startswith("lifecycle benchmark:") and "bench lifecycle" not in captured.out


@pytest.mark.usefixtures("quick_tracing")
def test_without_a_terminal_the_verb_prints_its_table_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(SMALL) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("lifecycle benchmark:")


def test_measure_tracing_overhead_reports_all_variants() -> None:
    from kvlifecycle.tools.bench_lifecycle import measure_tracing_overhead

    result = measure_tracing_overhead(handoffs=50, rounds=1)
    assert result.handoffs == 50
    assert result.untraced_s > 0 and result.noop_s > 0 and result.sdk_s is not None and result.sdk_s > 0
    assert result.ratio == result.noop_s / result.untraced_s
