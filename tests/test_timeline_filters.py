"""``kvlifecycle timeline --request / --since / --until``: the trace holds exactly the events asked for, and a filter
that matches nothing is one line on stderr and exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from timeline_logs import handoffs

from kvlifecycle.cli import main as cli_main
from kvlifecycle.timeline import validate_chrome_trace


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Ten handoffs; D names request ``r{i}`` ``d-r{i}``."""
    p_dir, d_dir = handoffs(tmp_path_factory.mktemp("logs"), 10, d_prefix="d-")
    return str(p_dir), str(d_dir)


def _trace(tmp_path: Path, logs: tuple[str, str], *options: str) -> dict[str, Any]:
    out = tmp_path / f"trace-{len(list(tmp_path.iterdir()))}.json"
    assert cli_main(["timeline", *logs, "-o", str(out), *options]) == 0
    trace = json.loads(out.read_text())
    assert validate_chrome_trace(trace) == []
    return trace


def _slices(trace: dict[str, Any]) -> list[tuple[str, float, float]]:
    return sorted((e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X")


def _instants(trace: dict[str, Any]) -> list[tuple[str, float]]:
    return sorted((e["name"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "i")


def _belongs(event: dict[str, Any], requests: set[str], transfers: set[str]) -> bool:
    args = event.get("args", {})
    return args.get("request") in requests or args.get("transfer") in transfers


def test_a_request_brings_its_handoff_on_both_sides_and_nothing_else(tmp_path: Path, logs: tuple[str, str]) -> None:
    everything = _trace(tmp_path, logs)
    for asked in ("r3", "d-r3"):  # P's id or D's: the transfer links them
        trace = _trace(tmp_path, logs, "--request", asked)
        assert trace["otherData"]["requests"] == [asked, "r3" if asked == "d-r3" else "d-r3"]
        (lease,) = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("lease ")]
        transfers = {lease["args"]["transfer"]}
        wanted = [e for e in everything["traceEvents"] if e["ph"] in "Xi" and _belongs(e, {"r3", "d-r3"}, transfers)]
        # exactly the events of r3's handoff, at the same times as in the whole trace
        assert _slices(trace) == sorted((e["name"], e["ts"], e["dur"]) for e in wanted if e["ph"] == "X")
        assert _instants(trace) == sorted((e["name"], e["ts"]) for e in wanted if e["ph"] == "i")
        names = {name for name, _, _ in _slices(trace)}
        assert {"r3 ALLOCATED", "r3 PINNED_FOR_TRANSFER", "r3 RELEASABLE", "d-r3 RESERVED", "d-r3 LOADING",
                "d-r3 READY_FOR_ATTENTION"} <= names
        assert {n.split(" ")[0] for n in names} == {"r3", "d-r3", "lease", "load", "xfer"}
        assert trace["otherData"]["flows"] == 1
        assert sorted(trace["otherData"]["workers"]) == ["d0", "p0"]


def test_repeated_requests_are_their_union(tmp_path: Path, logs: tuple[str, str]) -> None:
    both = _slices(_trace(tmp_path, logs, "--request", "r2", "--request", "d-r7"))
    alone = _slices(_trace(tmp_path, logs, "--request", "r2")) + _slices(_trace(tmp_path, logs, "--request", "r7"))
    assert both == sorted(alone)


def test_a_window_keeps_what_overlaps_it_cut_at_its_edges(tmp_path: Path, logs: tuple[str, str]) -> None:
    everything = _trace(tmp_path, logs)
    trace = _trace(tmp_path, logs, "--since", "+3.5ms", "--until", "+9.5ms")
    lo, hi = 3500.0, 9500.0
    assert trace["otherData"]["window_us"] == pytest.approx([lo, hi], abs=0.5)
    whole = [e for e in everything["traceEvents"] if e["ph"] == "X"]
    overlapping = [e for e in whole if e["ts"] + e["dur"] >= lo and e["ts"] <= hi]
    cut = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert sorted(e["name"] for e in cut) == sorted(e["name"] for e in overlapping)
    assert 0 < len(cut) < len(whole)
    for e in cut:
        assert lo - 0.5 <= e["ts"] and e["ts"] + e["dur"] <= hi + 0.5, e
    before = [e for e in cut if e["args"].get("starts_before_window")]
    after = [e for e in cut if e["args"].get("ends_after_window")]
    assert before and all(e["ts"] == pytest.approx(lo, abs=0.5) for e in before)
    assert after and all(e["ts"] + e["dur"] == pytest.approx(hi, abs=0.5) for e in after)
    assert _instants(trace) == sorted((n, ts) for n, ts in _instants(everything) if lo <= ts <= hi)
    # a flow is kept when its grant and its completion are both inside the window
    flows: dict[int, dict[str, float]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] in "sf":
            flows.setdefault(e["id"], {})[e["ph"]] = e["ts"]
    assert flows and all(lo <= f["s"] and f["f"] <= hi for f in flows.values())
    assert trace["otherData"]["flows"] == len(flows)


def test_since_alone_and_a_window_on_one_request(tmp_path: Path, logs: tuple[str, str]) -> None:
    late = _trace(tmp_path, logs, "--since", "+9.5ms")
    assert all(e["ts"] >= 9500 - 0.5 for e in late["traceEvents"] if e["ph"] in "Xi")
    names = {e["name"] for e in late["traceEvents"] if e["ph"] == "X"}
    assert "r9 RELEASABLE" in names and "r0 ALLOCATED" not in names
    one = _trace(tmp_path, logs, "--request", "r9", "--until", "+10.5ms")
    assert {e["args"].get("request") for e in one["traceEvents"] if e["ph"] == "X"} <= {"r9", "d-r9", None}
    assert all(e["ts"] + e["dur"] <= 10500 + 0.5 for e in one["traceEvents"] if e["ph"] == "X")


@pytest.mark.parametrize(("options", "message"), [
    (("--request", "nope"), "kvlifecycle timeline: no request 'nope' in these logs (requests: d-r0, "),
    (("--request", "r1", "--request", "nope", "--request", "gone"), "no request 'nope' or 'gone' in these logs"),
    (("--since", "+8ms", "--until", "+2ms"), "kvlifecycle timeline: --until is before --since"),
    (("--since", "+1s"), "kvlifecycle timeline: nothing happened between +1000.000 ms and"),
])
def test_a_filter_that_matches_nothing_is_one_line_and_exit_2(
        tmp_path: Path, logs: tuple[str, str], capsys: pytest.CaptureFixture[str], options: tuple[str, ...],
        message: str) -> None:
    out = tmp_path / "trace.json"
    assert cli_main(["timeline", *logs, "-o", str(out), *options]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and message in captured.err, captured.err
    assert captured.out == "" and not out.exists()


def test_a_bad_time_is_refused_by_the_parser(logs: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli_main(["timeline", *logs, "--until", "soon"])
    assert exited.value.code == 2
    assert "is not a time" in capsys.readouterr().err
