"""``kvlifecycle replay --request / --block / --until / --events``: the stories told by logs of real runs (the demo
over NIXL, and the real ledgers writing through the real log writer), checked event by event."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS
from test_timeline import write_logs

from kvlifecycle.cli import main
from kvlifecycle.cli.render import STEP_COLUMNS, Output, step_row
from kvlifecycle.story import block_ranges, request_story, step_view, trace_logs
from kvlifecycle.transfer_ids import load_id


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_text(capsys: pytest.CaptureFixture[str], *argv: str, rc: int = 0) -> list[str]:
    assert main(list(argv)) == rc
    return capsys.readouterr().out.splitlines()


def event_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if line.lstrip().startswith("+") and " ms " in line]


def assert_lines_match(lines: list[str], steps: list[dict]) -> None:
    """The text shows every step of the JSON, in the same order, with its worker, event and states."""
    rows = event_lines(lines)
    assert len(rows) == len(steps)
    for line, step in zip(rows, steps, strict=True):
        assert line.split()[:3] == [f"+{step['t_ms']:.3f}", "ms", step["worker"]], line
        assert f"  {step['event']}" in line, line
        for t in step["transitions"]:
            assert t["before"] in line and t["after"] in line, line
        if step["transfer"]:
            assert step["transfer"] in line, line


def kinds_on(steps: list[dict]) -> list[tuple[str, str]]:
    return [(s["worker"], s["event"]) for s in steps]


def test_block_ranges_keep_order_and_collapse_runs() -> None:
    assert block_ranges([0, 1, 2, 3, 7]) == "0-3,7"
    assert block_ranges([63, 62, 61, 59]) == "63-61,59"
    assert block_ranges([]) == ""


# --- the demo: P and D in two processes over NIXL ----------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("nixl")
    out = tmp_path_factory.mktemp("demo")
    proc = subprocess.run([sys.executable, "-m", "kvlifecycle", "demo", "--out", str(out), "--requests", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.mark.nixl
def test_demo_pull_request_story(demo_logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = run_json(capsys, "replay", str(demo_logs / "p0"), str(demo_logs / "d0"), "--request", "req-pull-1")
    steps = [s for s in view["steps"] if s["event"] != "transfer observed"]
    expected = [("p0", "allocate"), ("p0", "prefill done"), ("p0", "grant"), ("d0", "reserve"), ("d0", "load start"),
                ("p0", "renew"), ("d0", "part done"), ("p0", "consumer done"), ("p0", "release"), ("d0", "finish"),
                ("p0", "free")]
    assert sorted(kinds_on(steps)) == sorted(expected)
    order = kinds_on(steps)  # each side in its own order; D's completion before P hears of it
    for before, after in [(0, 1), (1, 2), (3, 4), (4, 6), (5, 7), (6, 7), (7, 8), (8, 10), (6, 9)]:
        assert order.index(expected[before]) < order.index(expected[after]), order
    by = {(s["worker"], s["event"]): s for s in steps}
    src, dst = by[("p0", "allocate")]["blocks"], by[("d0", "reserve")]["blocks"]  # the demo picks them
    assert src and dst
    assert by[("p0", "allocate")]["transitions"] == [{"blocks": src, "before": "FREE", "after": "ALLOCATED"}]
    grant = by[("p0", "grant")]
    assert grant["transitions"][0]["after"] == "PINNED_FOR_TRANSFER" and grant["generation"] == 2
    assert grant["lease_left_s"] == pytest.approx(30.0)
    transfer = grant["transfer"]
    assert by[("d0", "load start")]["transfer"] == transfer and "pull from p0" in by[("d0", "load start")]["detail"]
    assert by[("d0", "part done")]["transitions"] == [{"blocks": dst, "before": "LOADING",
                                                       "after": "READY_FOR_ATTENTION"}]
    assert by[("p0", "release")]["reason"] == "completed"
    assert by[("p0", "release")]["transitions"][0]["after"] == "RELEASABLE"
    assert by[("p0", "free")]["transitions"] == [{"blocks": src, "before": "RELEASABLE", "after": "FREE"}]
    # the summary is the request's own
    assert view["ended"] is True
    parts = {p["worker"]: p for p in view["parts"]}
    assert parts["p0"]["state"] == "freed" and parts["d0"]["state"] == "finished"
    (lease,) = parts["p0"]["leases"]
    assert lease["transfer"] == transfer and lease["ended"] == "completed" and lease["peers"] == ["d0"]
    (load,) = parts["d0"]["loads"]
    assert load["outcome"] == "ready" and load["mode"] == "pull" and load["parts_done"] == [0]
    # the text shows the same, line by line, and a summary of this request only
    lines = run_text(capsys, "replay", str(demo_logs / "p0"), str(demo_logs / "d0"), "--request", "req-pull-1")
    assert_lines_match(lines, view["steps"])
    assert "outcome: " in "\n".join(lines) and "req-pull-0" not in "\n".join(lines)
    assert any(line.strip().startswith(f"lease {transfer} gen 2:") and "ended completed" in line for line in lines)


@pytest.mark.nixl
def test_demo_push_request_story_and_a_blocks_life(demo_logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    view = run_json(capsys, "replay", str(demo_logs), "--request", "req-push-2")
    by = {(s["worker"], s["event"]): s for s in view["steps"]}
    assert "push from p0" in by[("d0", "load start")]["detail"]
    assert by[("p0", "transfer observed")]["transfer"] == by[("p0", "grant")]["transfer"]  # P wrote it
    assert by[("p0", "release")]["reason"] == "completed" and view["ended"]

    # the first block of req-push-2 on P: its epoch of req-push-2, every state, the push that read it
    allocate = by[("p0", "allocate")]
    block = allocate["blocks"].split(",")[0].split("-")[0]
    life = run_json(capsys, "replay", str(demo_logs), "--block", block, "--worker", "P")
    (epoch,) = [x for x in life["epochs"] if x["request"] == "req-push-2"]
    assert epoch["epoch"] == allocate["epoch"]
    assert [x["state"] for x in epoch["states"]] == ["ALLOCATED", "READY", "PINNED_FOR_TRANSFER", "RELEASABLE",
                                                     "FREE"]
    (use,) = epoch["transfers"]
    assert use["how"] == "read by p0 to write into d0 (push)" and use["outcome"] == "released (completed)"
    assert life["state"] == "FREE" and life["worker"] == "p0"
    # D's steps of that transfer are in the block's story too
    assert {"load start", "part done"} <= {s["event"] for s in life["steps"] if s["worker"] == "d0"}
    lines = run_text(capsys, "replay", str(demo_logs), "--block", block, "--worker", "P")
    assert_lines_match(lines, life["steps"])
    assert any(line.startswith(f"  epoch {allocate['epoch']}: req-push-2: ALLOCATED +") for line in lines)


@pytest.mark.nixl
def test_demo_until_shows_the_state_at_that_moment(demo_logs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = run_json(capsys, "replay", str(demo_logs), "--request", "req-pull-0")
    grant = next(s for s in full["steps"] if s["event"] == "grant")
    view = run_json(capsys, "replay", str(demo_logs), "--request", "req-pull-0", "--until", repr(grant["wall"]))
    assert view["steps"][-1]["wall"] <= grant["wall"]
    assert "release" not in {s["event"] for s in view["steps"]}
    parts = {p["worker"]: p for p in view["parts"]}
    assert parts["p0"]["state"] == "PINNED_FOR_TRANSFER" and parts["p0"]["leases"][0]["ended"] is None
    assert view["ended"] is False
    block = grant["blocks"].split(",")[0].split("-")[0]
    life = run_json(capsys, "replay", str(demo_logs), "--block", block, "--worker", "p0", "--until",
                    repr(grant["wall"]))
    assert life["state"] == "PINNED_FOR_TRANSFER"


@pytest.mark.nixl
def test_demo_events_without_json_and_explain_finds_nothing(demo_logs: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    trace = trace_logs([demo_logs])
    lines = run_text(capsys, "replay", str(demo_logs / "p0"), str(demo_logs / "d0"), "--events")
    assert_lines_match(lines, [step_view(trace, s) for s in trace.steps])
    assert lines[0].startswith(str(demo_logs / "p0"))  # the summaries are still there, first
    assert run_text(capsys, "explain", str(demo_logs))[0].startswith("nothing to explain in")


# --- the real ledgers through the real log writer, in-process ----------------------------------------------------


def test_expired_lease_story_shows_the_refused_late_completion(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    p_dir, d_dir, _ = write_logs(tmp_path)
    view = run_json(capsys, "replay", str(p_dir), str(d_dir), "--request", "req-c")
    order = kinds_on(view["steps"])
    assert [e for w, e in order if w == "p0"] == ["allocate", "prefill done", "grant", "renew", "release",
                                                  "refused consumer_done", "free"]
    assert [e for w, e in order if w == "d0"] == ["reserve", "load start", "cancel", "load failed"]
    # what crossed between the ledgers (their HLCs observed each other) is in causal order
    assert order.index(("p0", "grant")) < order.index(("d0", "reserve"))
    assert order.index(("d0", "load start")) < order.index(("p0", "renew"))
    by = {s["event"]: s for s in view["steps"]}
    assert by["grant"]["lease_left_s"] == pytest.approx(0.01)
    assert by["release"]["reason"] == "expired" and by["release"]["lease_left_s"] < 0
    assert by["refused consumer_done"]["reason"].startswith("stale token")
    assert by["cancel"]["transitions"] == [{"blocks": "30-33", "before": "LOADING", "after": "LOADING"}]
    assert by["load failed"]["transitions"][0]["after"] == "FREE"
    assert by["load failed"]["reason"] == "source lease expired"
    parts = {p["worker"]: p for p in view["parts"]}
    assert parts["d0"]["state"] == "cancelled, load discarded" and parts["d0"]["loads"][0]["outcome"] == "discarded"
    assert parts["p0"]["leases"][0]["ended"] == "expired"
    assert parts["p0"]["refusals"] == ["consumer_done: stale token: no live lease for this transfer (released or "
                                       "never granted)"]
    lines = run_text(capsys, "replay", str(p_dir), str(d_dir), "--request", "req-c")
    assert_lines_match(lines, view["steps"])
    release_line = next(line for line in event_lines(lines) if "  release  " in line)
    assert "expired" in release_line and "PINNED_FOR_TRANSFER → RELEASABLE" in release_line


def test_two_part_load_and_recompute_stories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    a = run_json(capsys, "replay", str(tmp_path), "--request", "req-a")
    parts_done = [s for s in a["steps"] if s["event"] == "part done"]
    assert [s["detail"] for s in parts_done] == ["part 0", "part 1"]
    assert parts_done[0]["transitions"][0]["after"] == "LOADING"  # one of two parts: still loading
    assert parts_done[1]["transitions"][0]["after"] == "READY_FOR_ATTENTION"
    assert next(p for p in a["parts"] if p["worker"] == "d0")["state"] == "finished"
    d = run_json(capsys, "replay", str(tmp_path), "--request", "req-d")
    d_part = next(p for p in d["parts"] if p["worker"] == "d0")
    assert d_part["state"] == "READY_FOR_ATTENTION" and d_part["settled"]  # decoding: the handoff ended
    b = run_json(capsys, "replay", str(tmp_path), "--request", "req-b")
    failed = next(s for s in b["steps"] if s["event"] == "load failed")
    assert failed["transitions"][0] == {"blocks": "20-23", "before": "LOADING", "after": "RESERVED"}
    assert failed["detail"] == "recompute"
    fill = next(s for s in b["steps"] if s["event"] == "local fill")
    assert fill["transitions"][0]["after"] == "READY_FOR_ATTENTION"


def test_d_blocks_life_names_the_transfer_that_wrote_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_logs(tmp_path)
    life = run_json(capsys, "replay", str(tmp_path), "--block", "31", "--worker", "D")
    (epoch,) = life["epochs"]
    assert epoch["request"] == "req-c"
    assert [x["state"] for x in epoch["states"]] == ["RESERVED", "LOADING", "FREE"]
    (use,) = epoch["transfers"]
    assert use["how"] == "written by p0 (pull)" and use["outcome"] == "failed (source lease expired)"
    # P's side of that transfer: the grant, the expiry, the refused completion
    p_events = [s["event"] for s in life["steps"] if s["worker"] == "p0"]
    assert p_events == ["grant", "renew", "release", "refused consumer_done"]


def test_cancelled_and_restarted_peer_stories(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    SCENARIOS["cancelled"](tmp_path / "c")
    view = run_json(capsys, "replay", str(tmp_path / "c"), "--request", "req-7")
    assert ("p0", "cancel deferred") in kinds_on(view["steps"])
    release = next(s for s in view["steps"] if s["event"] == "release")
    assert release["reason"] == "cancelled"
    assert {p["worker"]: p["state"] for p in view["parts"]} == {"p0": "freed", "d0": "cancelled, load discarded"}
    SCENARIOS["peer_restart"](tmp_path / "r")
    view = run_json(capsys, "replay", str(tmp_path / "r"), "--request", "req-3")
    release = next(s for s in view["steps"] if s["event"] == "release")
    assert release["reason"] == "peer_restarted" and release["detail"] == "d0 epoch 1 -> 2"
    assert view["ended"] is True


def test_a_restarted_workers_story_marks_the_new_incarnation(tmp_path: Path) -> None:
    from kvlifecycle.ledger import open_ledger

    first = open_ledger("source", 8, str(tmp_path / "p"), worker="p0")
    first.allocate("r", [1])
    first.prefill_done("r")
    first.grant("r")
    first.log.close()  # a crash with the pin held
    second = open_ledger("source", 8, str(tmp_path / "p"), worker="p0")
    second.allocate("s", [1])  # the new incarnation reuses block 1
    second.log.close()
    trace = trace_logs([tmp_path / "p"])
    (restart,) = trace.restarts
    assert restart.worker == "p0" and [lease.request for lease in restart.leases] == ["r"]
    assert trace.steps[restart.step_index].new_incarnation
    assert request_story(trace, "r").parts[0].state == "lost when its worker restarted"


def test_terminal_output_is_a_rich_table_with_the_same_cells(tmp_path: Path) -> None:
    write_logs(tmp_path)
    trace = trace_logs([tmp_path])
    rows = [step_row(step_view(trace, s)) for s in trace.steps[:6]]
    tty = io.StringIO()
    Output(tty, force_terminal=True).table(STEP_COLUMNS, rows)
    plain = io.StringIO()
    Output(plain, force_terminal=False).table(STEP_COLUMNS, rows)
    assert "\x1b[" in tty.getvalue() and "\x1b[" not in plain.getvalue()
    for row in rows:
        for cell in (row[1], row[3], row[5]):
            assert cell in tty.getvalue() and cell in plain.getvalue()


def test_a_load_from_two_p_ranks_is_one_story(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """D reads one request from two P ranks under one load (``<request><-<t1>+<t2>``): the story, the block's life
    and explain follow both ranks' leases."""
    from kvlifecycle.clock import HybridLogicalClock, ManualClock
    from kvlifecycle.explain import explain_logs
    from kvlifecycle.ledger import open_ledger

    clock, hlc = ManualClock(10.0), HybridLogicalClock()
    ranks = [open_ledger("source", 8, str(tmp_path / f"p{r}"), clock=clock, hlc=hlc, worker=f"p{r}")
             for r in range(2)]
    d = open_ledger("target", 8, str(tmp_path / "d0"), clock=clock, hlc=hlc, worker="d0")
    grants = []
    for p in ranks:
        p.allocate("tp", [2, 3])
        p.prefill_done("tp")
        grants.append(p.grant("tp"))
    d.reserve("tp", [5, 6])
    load = load_id("tp", [g.transfer for g in grants])
    for p, g in zip(ranks, grants, strict=True):
        assert p.heartbeat(g.transfer, g.generation, peer="d0")
    d.start_load("tp", load, parts=2)
    for part, (p, g) in enumerate(zip(ranks, grants, strict=True)):
        d.part_done(load, part)
        p.consumer_done(g.transfer, g.generation)
        p.take_released()
        p.free("tp")
    d.finish("tp")
    for ledger in (*ranks, d):
        ledger.log.close()
    view = run_json(capsys, "replay", str(tmp_path), "--request", "tp")
    assert {p["worker"]: p["state"] for p in view["parts"]} == {"p0": "freed", "p1": "freed", "d0": "finished"}
    assert [s["worker"] for s in view["steps"] if s["event"] == "release"] == ["p0", "p1"]
    life = run_json(capsys, "replay", str(tmp_path), "--block", "5", "--worker", "D")
    assert {(s["worker"], s["event"]) for s in life["steps"] if s["worker"] != "d0"} == {
        (w, e) for w in ("p0", "p1") for e in ("grant", "renew", "consumer done", "release")}
    assert explain_logs([tmp_path])[1] == []
    assert main(["replay", str(tmp_path), "--block", "2", "--worker", "P"]) == 2  # two logs on that side
    assert "2 logs are on the source side (p0, p1): name one" in capsys.readouterr().err
