"""``kvlifecycle timeline``: P and D event logs (real ledgers, real segment files) merged by HLC into a Perfetto
trace whose structure is validated, and a PNG."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvlifecycle.cli import main as cli_main
from kvlifecycle.clock import ManualClock
from kvlifecycle.eventlog import EventLog, LogError
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.merge import merge_logs
from kvlifecycle.timeline import build_timeline, to_chrome_trace, validate_chrome_trace


def write_logs(tmp_path: Path) -> tuple[Path, Path, list[str]]:
    """A P and a D ledger with real logs: two handoffs complete (one in two parts), one load fails and falls back to
    recompute, one lease expires under its read (the read outlives it) and its late completion is refused, one
    request is cancelled mid-load."""
    clock = ManualClock(50.0)
    p_dir, d_dir = tmp_path / "p0", tmp_path / "d0"
    source = SourceLedger(64, clock=clock, worker="p0")
    target = TargetLedger(64, clock=clock, worker="d0", failure_policy="recompute")
    source.log = EventLog(p_dir, header=source.header(), fsync="never")
    target.log = EventLog(d_dir, header=target.header(), fsync="never")
    completed = []

    def hand_off(request: str, src: range, dst: range, *, parts: int = 1, fail: bool = False, ttl: float = 30.0):
        source.allocate(request, np.array(src))
        clock.advance(0.004)
        source.prefill_done(request)
        grant = source.grant(request, ttl_s=ttl, peer="d0")
        target.hlc.observe(source.hlc.last)  # the grant travelled to D
        target.reserve(request, np.array(dst))
        clock.advance(0.001)
        target.start_load(request, grant.transfer, parts=parts, generation=grant.generation, peer="p0")
        source.hlc.observe(target.hlc.last)
        assert source.heartbeat(grant.transfer, grant.generation)
        return grant

    grant = hand_off("req-a", range(0, 4), range(10, 14), parts=2)
    clock.advance(0.003)
    target.observe_transfer(grant.transfer, t_post_s=0.0005, t_xfer_s=0.002, nbytes=1 << 20, descriptors=8,
                            backend="UCX", ok=True)
    target.part_done(grant.transfer, 0)
    clock.advance(0.001)
    target.part_done(grant.transfer, 1)
    source.hlc.observe(target.hlc.last)
    source.consumer_done(grant.transfer, grant.generation)
    completed.append(grant.transfer)

    grant = hand_off("req-b", range(4, 8), range(20, 24))
    clock.advance(0.002)
    target.fail(grant.transfer, "notification lost")
    source.fail(grant.transfer, grant.generation, "consumer reported failure")
    target.local_fill("req-b")

    grant = hand_off("req-c", range(8, 12), range(30, 34), ttl=0.01)
    clock.advance(0.02)
    assert source.sweep() == [grant.transfer]
    assert not source.consumer_done(grant.transfer, grant.generation)  # too late: refused, recorded
    target.hlc.observe(source.hlc.last)  # the refusal travelled back: D ends its read after P's expiry
    target.cancel("req-c")  # in flight: the blocks free when the load settles
    target.fail(grant.transfer, "source lease expired")

    grant = hand_off("req-d", range(12, 16), range(40, 44))
    clock.advance(0.002)
    target.part_done(grant.transfer, 0)
    source.hlc.observe(target.hlc.last)
    source.consumer_done(grant.transfer, grant.generation)
    completed.append(grant.transfer)

    for request in ("req-a", "req-b", "req-c", "req-d"):
        source.take_released()
        source.free(request)
    target.finish("req-a")
    source.log.close()
    target.log.close()
    return p_dir, d_dir, completed


def test_merge_orders_by_hlc_and_keeps_causality(tmp_path: Path) -> None:
    p_dir, d_dir, _ = write_logs(tmp_path)
    merged = merge_logs([d_dir, p_dir])
    stamps = [(record.event.hlc, worker) for worker, _, record in merged]
    assert stamps == sorted(stamps)
    assert {worker for worker, _, _ in merged} == {"p0", "d0"}
    assert {side for _, side, _ in merged} == {"source", "target"}
    kinds = [type(record.event).__name__ for _, _, record in merged]
    # D reserved after P granted (the grant travelled), P's completion after D's last part
    assert kinds.index("SrcGranted") < kinds.index("TgtReserved")
    assert kinds.index("TgtPartDone") < kinds.index("SrcConsumerDone")
    # a directory of log directories stands for its logs
    assert [r.event for _, _, r in merge_logs([tmp_path])] == [r.event for _, _, r in merged]


def test_merge_refuses_missing_and_duplicate_logs(tmp_path: Path) -> None:
    p_dir, _, _ = write_logs(tmp_path)
    with pytest.raises(LogError, match="not a directory"):
        merge_logs([tmp_path / "nope"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogError, match="no event log segments"):
        merge_logs([tmp_path / "empty"])
    with pytest.raises(LogError, match="two logs claim worker 'p0'"):
        merge_logs([p_dir, p_dir])


def test_chrome_trace_structure(tmp_path: Path) -> None:
    p_dir, d_dir, completed = write_logs(tmp_path)
    trace = to_chrome_trace(build_timeline(merge_logs([p_dir, d_dir])))
    assert validate_chrome_trace(trace) == []
    events = trace["traceEvents"]
    json.dumps(trace)  # serialisable as is
    phases = Counter(e["ph"] for e in events)
    assert phases["X"] > 0 and phases["M"] > 0 and phases["i"] > 0
    assert phases["s"] == phases["f"] == len(completed)

    processes = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(processes.values()) == ["d0 (D, target)", "p0 (P, source)"]
    pid = {name.split(" ")[0]: p for p, name in processes.items()}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["ph"] == "M" and e["name"] == "thread_name"}
    for worker in ("p0", "d0"):
        names = {name for (p, _), name in threads.items() if p == pid[worker]}
        assert {"events", "blocks 0", "transfers 0"} <= names

    slices = [e for e in events if e["ph"] == "X"]
    by_name = {e["name"]: e for e in slices}
    for state in ("ALLOCATED", "READY", "PINNED_FOR_TRANSFER", "RELEASABLE"):
        assert by_name[f"req-a {state}"]["pid"] == pid["p0"]
    for state in ("RESERVED", "LOADING", "READY_FOR_ATTENTION"):
        assert by_name[f"req-a {state}"]["pid"] == pid["d0"]
    # state intervals of one block group follow each other without gaps
    a = [by_name[f"req-a {s}"] for s in ("ALLOCATED", "READY", "PINNED_FOR_TRANSFER", "RELEASABLE")]
    for before, after in itertools.pairwise(a):
        assert before["ts"] + before["dur"] == pytest.approx(after["ts"], abs=1e-2)
    assert "req-b RESERVED (recompute)" in by_name and "req-b READY_FOR_ATTENTION (recomputed)" in by_name
    assert "req-c LOADING (cancel pending)" in by_name
    assert by_name[f"lease {completed[0]}"]["args"]["reason"] == "completed"
    expired = [e for e in slices if e["name"].startswith("lease") and e["args"].get("reason") == "expired"]
    assert len(expired) == 1 and expired[0]["cat"] == "failed"
    (xfer,) = [e for e in slices if e["name"].startswith("xfer")]
    assert xfer["args"]["bytes"] == 1 << 20 and xfer["dur"] == pytest.approx(2000, abs=1)  # T_xfer = 2 ms in µs

    instants = Counter(e["name"] for e in events if e["ph"] == "i")
    assert instants["refused consumer_done"] == 1 and instants["lease expired"] == 1
    assert instants["lease renewed"] == 4

    flows = {}
    for e in events:
        if e["ph"] in "sf":
            flows.setdefault(e["id"], {})[e["ph"]] = e
    assert sorted(f["s"]["name"] for f in flows.values()) == sorted(completed)
    for flow in flows.values():
        assert flow["s"]["pid"] == pid["p0"] and flow["f"]["pid"] == pid["d0"]
        assert flow["f"]["ts"] >= flow["s"]["ts"] and flow["f"]["bp"] == "e"


def test_validator_catches_broken_traces() -> None:
    good = {"ph": "X", "name": "a", "ts": 0, "dur": 10, "pid": 1, "tid": 1}
    assert validate_chrome_trace({"traceEvents": [good]}) == []
    assert validate_chrome_trace([]) == ["top level must be an object with a 'traceEvents' list"]
    overlapping = {"traceEvents": [good, {**good, "name": "b", "ts": 5, "dur": 10}]}
    assert any("overlaps" in p for p in validate_chrome_trace(overlapping))
    nested = {"traceEvents": [good, {**good, "name": "b", "ts": 2, "dur": 3}]}
    assert validate_chrome_trace(nested) == []
    assert any("unknown phase" in p for p in validate_chrome_trace({"traceEvents": [{"ph": "Q"}]}))
    assert any("missing" in p for p in validate_chrome_trace({"traceEvents": [{"ph": "X", "name": "a"}]}))
    assert any("non-negative" in p for p in validate_chrome_trace({"traceEvents": [{**good, "dur": -1}]}))
    dangling = {"ph": "s", "name": "t", "ts": 1, "pid": 1, "tid": 1, "id": 7, "cat": "handoff"}
    assert any("needs both" in p for p in validate_chrome_trace({"traceEvents": [good, dangling]}))
    outside = {**dangling, "ph": "f", "ts": 50, "bp": "e"}
    assert any("inside no slice" in p for p in validate_chrome_trace({"traceEvents": [good, dangling, outside]}))


def test_cli_writes_trace_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    p_dir, d_dir, completed = write_logs(tmp_path / "logs")
    out, png = tmp_path / "trace.json", tmp_path / "timeline.png"
    assert cli_main(["timeline", str(p_dir), str(d_dir), "-o", str(out), "--png", str(png)]) == 0
    trace = json.loads(out.read_text())
    assert validate_chrome_trace(trace) == []
    assert trace["otherData"]["flows"] == len(completed)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "2 workers" in printed and f"{len(completed)} grant→completion flows" in printed


def test_cli_reports_a_corrupt_log_and_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p_dir, d_dir, _ = write_logs(tmp_path / "logs")
    segment = sorted(p_dir.glob("seg-*.kvl"))[0]
    raw = bytearray(segment.read_bytes())
    raw[0] ^= 0xFF  # break the segment's magic: corruption, never mistaken for a torn tail
    segment.write_bytes(bytes(raw))
    out = tmp_path / "trace.json"
    assert cli_main(["timeline", str(p_dir), str(d_dir), "-o", str(out)]) == 2
    assert "corrupt event log" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.nixl
@pytest.mark.slow
def test_timeline_of_a_real_two_process_demo(tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    logs = tmp_path / "demo"
    demo = subprocess.run([sys.executable, "-m", "kvlifecycle", "demo", "--out", str(logs), "--requests", "2"],
                          capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    out = tmp_path / "trace.json"
    assert cli_main(["timeline", str(logs), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert validate_chrome_trace(trace) == []
    assert trace["otherData"]["flows"] == 4  # two pulls and two pushes, each granted by P and completed on D
    assert sorted(trace["otherData"]["workers"].items()) == [("d0", "target"), ("p0", "source")]


def test_two_consumers_and_a_restart(tmp_path: Path) -> None:
    """One grant read by two D workers (heterogeneous TP): two flows. Then P restarts (new incarnation, same log):
    its open intervals end at the restart and an instant marks it."""
    clock = ManualClock(10.0)
    p_dir = tmp_path / "p0"
    source = SourceLedger(16, clock=clock, worker="p0")
    source.log = EventLog(p_dir, header=source.header(), fsync="never")
    targets = []
    for name in ("d0", "d1"):
        target = TargetLedger(16, clock=clock, worker=name)
        target.log = EventLog(tmp_path / name, header=target.header(), fsync="never")
        targets.append(target)
    source.allocate("req", np.arange(4))
    source.prefill_done("req")
    grant = source.grant("req", consumers=2)
    for consumer, target in enumerate(targets):
        target.hlc.observe(source.hlc.last)
        target.reserve("req", np.arange(2))
        clock.advance(0.001)
        target.start_load("req", grant.transfer)
        target.part_done(grant.transfer)
        source.hlc.observe(target.hlc.last)
        source.consumer_done(grant.transfer, grant.generation, consumer)
        target.log.close()
    source.allocate("req-2", np.arange(4, 6))  # still ALLOCATED when P "crashes"
    source.log.close()
    clock.advance(0.01)
    again = SourceLedger(16, clock=clock, worker="p0")
    again.log = EventLog(p_dir, header=again.header(), fsync="never")
    again.allocate("req-3", np.arange(8, 10))
    again.log.close()

    trace = to_chrome_trace(build_timeline(merge_logs([tmp_path])))
    assert validate_chrome_trace(trace) == []
    events = trace["traceEvents"]
    pids = {e["args"]["name"].split(" ")[0]: e["pid"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    finishes = sorted(e["pid"] for e in events if e["ph"] == "f")
    assert finishes == sorted([pids["d0"], pids["d1"]])
    (restart,) = [e for e in events if e["ph"] == "i" and e["name"] == "worker restarted"]
    assert restart["pid"] == pids["p0"]
    (cut,) = [e for e in events if e["ph"] == "X" and e["name"] == "req-2 ALLOCATED"]
    assert cut["args"]["ended_by"] == "worker restart"
    assert cut["ts"] + cut["dur"] == pytest.approx(restart["ts"], abs=1e-2)
    assert any(e["ph"] == "X" and e["name"] == "req-3 ALLOCATED" for e in events)
