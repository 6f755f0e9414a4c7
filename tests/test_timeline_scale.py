"""``kvlifecycle timeline`` at scale: the PNG of many requests aggregates and samples (and says so), released blocks are
drawn as released, progress shows on a terminal only, and the lane and flow checks that replaced quadratic scans
give the answers the scans gave."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from timeline_logs import BLOCKS, IN_FLIGHT, handoffs

from kvlifecycle.cli import main as cli_main
from kvlifecycle.timeline import Slice, assign_lanes, render_png, timeline_from_logs, validate_chrome_trace
from kvlifecycle.timeline.aggregate import binned, request_groups, sample_groups, step_counts

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    handoffs(root, 60, d_prefix="d-")
    return root


def test_blocks_per_state_count_every_request(many: Path) -> None:
    timeline = timeline_from_logs([many])
    p = step_counts(s for s in timeline.slices if s.worker == "p0" and s.track == "blocks")
    d = step_counts(s for s in timeline.slices if s.worker == "d0" and s.track == "blocks")
    assert p.counts["PINNED_FOR_TRANSFER"].max() == IN_FLIGHT * BLOCKS  # the handoffs in flight at once, no more
    assert d.counts["LOADING"].max() == IN_FLIGHT * BLOCKS
    assert set(p.counts) == {"ALLOCATED", "READY", "PINNED_FOR_TRANSFER", "RELEASABLE"}
    # every slice counted once: the area under the counts is the summed block-time of the slices
    area = sum(float((c[:-1] * np.diff(p.times)).sum()) for c in p.counts.values())
    expected = sum(s.blocks * (s.end - s.start) for s in timeline.slices if s.worker == "p0" and s.track == "blocks")
    assert area == pytest.approx(expected, rel=1e-9)
    transfers = step_counts((s for s in timeline.slices if s.worker == "p0" and s.track == "transfers"), "one")
    assert sum(transfers.counts.values()).max() == IN_FLIGHT
    # the picture's bins keep the block-time: the means times the bin width add up to the same area
    edges, means = binned(p, timeline.t0, timeline.t_end, 7)
    assert len(edges) == 8 and all(len(m) == 7 for m in means.values())
    assert sum(float((m * np.diff(edges)).sum()) for m in means.values()) == pytest.approx(expected, rel=1e-9)


def test_requests_group_across_sides_and_the_sample_spreads_over_the_run(many: Path) -> None:
    timeline = timeline_from_logs([many])
    groups = request_groups(timeline)
    assert len(groups) == 60 and groups[0] == ["r0", "d-r0"] and groups[-1] == ["r59", "d-r59"]
    picked = sample_groups(groups, 6)
    assert [g[0] for g in picked] == ["r0", "r12", "r24", "r35", "r47", "r59"]
    assert sample_groups(groups, 100) == groups


def test_released_blocks_at_the_end_are_released_not_open_leases(many: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert cli_main(["timeline", str(many), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    still_open = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["args"].get("open_at_end_of_log")]
    # the three requests P had not freed yet (it frees lazily) and D's last decodes; nothing else
    on_p = sorted(e["name"] for e in still_open if e["args"].get("held") is False)
    assert on_p == ["r57 RELEASABLE", "r58 RELEASABLE", "r59 RELEASABLE"]
    assert all(e["name"].endswith("READY_FOR_ATTENTION") or e["args"].get("held") is False for e in still_open)


def test_many_requests_draw_an_aggregate_and_a_sample(many: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "many.png"
    assert cli_main(["timeline", str(many), "-o", str(tmp_path / "t.json"), "--png", str(png), "--sample", "6"]) == 0
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 10_000
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == (f"{png}: 60 requests aggregated (blocks per state on each worker), 6 sampled evenly over "
                           f"the run drawn in detail")
    timeline = timeline_from_logs([many])
    drawing = render_png(timeline, tmp_path / "sample.png", sample=6)
    assert (drawing.mode, drawing.requests, drawing.sampled, drawing.rows) == ("aggregate", 60, 6, 12)
    detail = render_png(timeline, tmp_path / "detail.png", sample=60)
    assert (detail.mode, detail.sampled) == ("detail", 60)
    assert (tmp_path / "detail.png").read_bytes()[:8] == PNG_MAGIC


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_drawn_on_a_terminal(many: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("rich")
    err, out = _Terminal(), _Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setattr(sys, "stdout", out)
    assert cli_main(["timeline", str(many), "-o", str(tmp_path / "t.json")]) == 0
    assert "timeline" in err.getvalue() and "reading the logs" in err.getvalue()
    assert "t.json: 2 workers" in out.getvalue() and "reading" not in out.getvalue()


def test_no_progress_when_stderr_is_not_a_terminal(many: Path, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "kvlifecycle", "timeline", str(many), "-o", str(tmp_path / "t.json")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.count("\n") == 1 and "2 workers" in done.stdout


def _lanes_by_scanning(slices: list[Slice]) -> list[int]:
    """The first version's lane assignment (a scan of every lane per slice): the reference."""
    ends: dict[tuple[str, str], list[float]] = {}
    lanes = {}
    for s in sorted(slices, key=lambda s: (s.start, s.end)):
        taken = ends.setdefault((s.worker, s.track), [])
        for i, end in enumerate(taken):
            if end <= s.start:
                lanes[id(s)] = i
                taken[i] = s.end
                break
        else:
            lanes[id(s)] = len(taken)
            taken.append(s.end)
    return [lanes[id(s)] for s in slices]


@pytest.mark.parametrize("seed", range(5))
def test_lanes_from_the_heap_are_the_lanes_of_the_scan(seed: int) -> None:
    rng = random.Random(seed)
    slices = []
    for _ in range(400):
        start = rng.choice([rng.uniform(0, 10), float(rng.randint(0, 10))])  # ties too
        slices.append(Slice(rng.choice(["p0", "d0"]), "source", rng.choice(["blocks", "transfers"]), "x", start,
                            start + rng.choice([0.0, rng.expovariate(1.0)]), "READY"))
    assign_lanes(slices)
    assert [s.lane for s in slices] == _lanes_by_scanning(slices)
    assert max(s.lane for s in slices) > 3


def test_the_flow_check_finds_an_enclosing_slice_past_a_nested_one() -> None:
    outer = {"ph": "X", "name": "outer", "ts": 0, "dur": 100, "pid": 1, "tid": 1}
    inner = {**outer, "name": "inner", "ts": 10, "dur": 10}
    later = {**outer, "name": "later", "ts": 200, "dur": 10}
    start = {"ph": "s", "name": "t", "ts": 5, "pid": 1, "tid": 1, "id": 1, "cat": "handoff"}
    for ts, ok in ((50, True), (15, True), (150, False), (205, True), (300, False)):
        finish = {**start, "ph": "f", "ts": ts, "bp": "e"}
        problems = validate_chrome_trace({"traceEvents": [outer, inner, later, start, finish]})
        assert (problems == []) == ok, (ts, problems)
