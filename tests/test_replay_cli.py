"""``kvlifecycle replay`` and ``explain`` at the command line: summaries, checks, filters, and exit codes: 0 clean, 1
violations found, 2 the input could not be read or is impossible (one line on stderr, never a traceback), for any
bytes at all."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tempfile
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvlifecycle import events as ev
from kvlifecycle.cli import main
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import MAGIC, EventLog, _frame, segment_paths
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


# --- exit codes: 0 clean, 1 violations, 2 unreadable or impossible (one stderr line, never a traceback) -----------

# every verb and view that reads a log, and the exit codes each may end with
READERS: list[tuple[list[str], set[int]]] = [
    (["replay"], {0, 2}),
    (["replay", "--check", "--quiescent"], {0, 1, 2}),
    (["replay", "--events"], {0, 2}),
    (["replay", "--request", "r", "--check"], {0, 1, 2}),
    (["replay", "--block", "1"], {0, 2}),
    (["explain"], {0, 1, 2}),
    (["explain", "--json"], {0, 1, 2}),
]


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(argv)  # an exception escaping here is the traceback a user would see: the test fails on it
    return rc, out.getvalue(), err.getvalue()


def assert_every_reader_exits_cleanly(log_dir: str) -> set[int]:
    codes = set()
    for args, allowed in READERS:
        rc, _out, err = run_cli([args[0], log_dir, *args[1:]])
        assert rc in allowed, (args, rc, err)
        if rc == 2:
            assert err.count("\n") == 1 and err.startswith(f"kvlifecycle {args[0]}: "), err
        codes.add(rc)
    return codes


@pytest.fixture(scope="module")
def real_segment(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    p, _d = handoff_logs(tmp_path_factory.mktemp("real"))
    (segment,) = segment_paths(Path(p))
    return segment.read_bytes()


def write_segment(directory: str, data: bytes) -> str:
    Path(directory, "seg-00000000.kvl").write_bytes(data)
    return directory


HEADER_FRAME = _frame(msgspec.msgpack.encode({"schema": 1, "side": "source", "worker": "p0", "num_blocks": 16,
                                               "incarnation": 1, "segment": 0}))


@settings(max_examples=150, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from([b"", MAGIC, MAGIC + HEADER_FRAME]), body=st.binary(max_size=1024))
def test_any_bytes_end_in_exit_0_or_2_with_one_line(prefix: bytes, body: bytes) -> None:
    with tempfile.TemporaryDirectory() as directory:
        assert_every_reader_exits_cleanly(write_segment(directory, prefix + body))


MUTATION = st.tuples(st.sampled_from(["flip", "truncate", "insert", "overwrite"]), st.floats(0, 1),
                     st.binary(min_size=1, max_size=16))


def mutate(data: bytes, mutations: list[tuple[str, float, bytes]]) -> bytes:
    out = bytearray(data)
    for kind, where, junk in mutations:
        pos = int(where * max(len(out) - 1, 0))
        if kind == "flip" and out:
            out[pos] ^= junk[0] or 0xFF
        elif kind == "truncate":
            del out[pos:]
        elif kind == "insert":
            out[pos:pos] = junk
        else:
            out[pos:pos + len(junk)] = junk
    return bytes(out)


@settings(max_examples=150, deadline=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
@given(mutations=st.lists(MUTATION, min_size=1, max_size=4))
def test_mutated_real_logs_end_in_exit_0_1_or_2_with_one_line(real_segment: bytes, mutations) -> None:
    with tempfile.TemporaryDirectory() as directory:
        assert_every_reader_exits_cleanly(write_segment(directory, mutate(real_segment, mutations)))


def test_the_unmutated_log_replays_clean(real_segment: bytes, tmp_path: Path) -> None:
    """The property tests' starting point reads clean: the request is there and nothing is wrong."""
    assert assert_every_reader_exits_cleanly(write_segment(str(tmp_path), real_segment)) == {0}


def impossible_log(tmp_path: Path, header: dict, *events: ev.Event) -> str:
    log = EventLog(tmp_path / "p", header=header, fsync="never")
    for event in events:
        log.append(event)
    log.close()
    return str(tmp_path / "p")


ONE_BLOCK = ev.pack_blocks(np.array([1]))


@pytest.mark.parametrize(("header", "event"), [
    ({"side": "source", "worker": "p0"}, ev.SrcAllocated(1 << 16, 0.0, "r", ONE_BLOCK)),  # no num_blocks
    ({"side": "source", "worker": "p0", "num_blocks": 0}, ev.SrcAllocated(1 << 16, 0.0, "r", ONE_BLOCK)),
    ({"side": "source", "worker": "p0", "num_blocks": 1}, ev.SrcAllocated(1 << 16, 0.0, "r", ONE_BLOCK)),  # beyond
    ({"side": "source", "worker": "p0", "num_blocks": 4}, ev.SrcPrefillDone(1 << 16, 0.0, "nobody")),
    ({"side": "target", "worker": "d0", "num_blocks": 4}, ev.SrcPrefillDone(1 << 16, 0.0, "r")),  # other side's
    ({"side": "sideways", "worker": "d0", "num_blocks": 4}, ev.SrcPrefillDone(1 << 16, 0.0, "r")),
    ({"side": "source", "worker": "p0", "num_blocks": "many"}, ev.SrcPrefillDone(1 << 16, 0.0, "r")),
])
def test_impossible_logs_exit_2_with_one_line(tmp_path: Path, header: dict, event: ev.Event) -> None:
    log_dir = impossible_log(tmp_path, header, event)
    for args in (["replay", log_dir, "--check"], ["replay", log_dir, "--request", "r"], ["explain", log_dir]):
        rc, out, err = run_cli(args)
        assert (rc, out) == (2, "") and err.count("\n") == 1, (args, err)
        assert err.startswith(f"kvlifecycle {args[0]}: ") and "Traceback" not in err


def test_story_arguments_naming_nothing_exit_2(tmp_path: Path) -> None:
    p, d = handoff_logs(tmp_path)
    assert run_cli(["replay", p, d, "--request", "nobody"])[::2] == (
        2, "kvlifecycle replay: no request 'nobody' in these logs (requests: r)\n")
    assert run_cli(["replay", p, d, "--block", "1"])[::2] == (
        2, "kvlifecycle replay: --block needs --worker: one of p0, d0 (or P / D)\n")
    assert run_cli(["replay", p, d, "--block", "99", "--worker", "P"])[::2] == (
        2, "kvlifecycle replay: block 99 is not in p0's pool of 16\n")
    rc, out, _ = run_cli(["replay", p, d, "--block", "1", "--worker", "p0", "--until", "1970-01-02"])
    assert rc == 0 and out.startswith("block 1 on p0 (source): FREE as of ")  # before the first event
    assert ", epoch 0 " in out.splitlines()[0]
