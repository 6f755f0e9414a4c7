"""One writer per log directory, with real processes: a second writer is refused in one line naming the directory
and the holder (pid, host) before it reads or cuts anything; a writer killed with SIGKILL lets its successor in at
once; readers take no lock and modify nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvlifecycle import log_lock
from kvlifecycle.eventlog import EventLog, LogError, LogLockedError, LogReader, read_events, segment_paths
from kvlifecycle.ledger import open_ledger
from kvlifecycle.log_lock import LOCK_NAME
from kvlifecycle.replay import replay

HEADER = {"side": "source", "worker": "p0", "num_blocks": 8}  # what the writer process's ledger writes

WRITER = textwrap.dedent("""
    import sys
    from kvlifecycle.ledger import open_ledger
    ledger = open_ledger("source", 8, sys.argv[1], fsync="always", worker="p0")
    ledger.allocate("r0", [0])
    ledger.prefill_done("r0")
    ledger.free("r0")
    ledger.allocate("r1", [1])
    ledger.prefill_done("r1")  # five events, each synced before the command returned
    print("ready", flush=True)
    sys.stdin.readline()  # holds the log until told (or killed)
    ledger.log.close()
""")


class Writer:
    def __init__(self, directory: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, str(directory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # bounded by the child: it prints or dies (EOF)
        assert line.strip() == "ready", line

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Writer]:
    w = Writer(tmp_path / "log")
    try:
        yield w
    finally:
        w.stop()


def test_a_second_writer_process_is_refused_in_one_line_naming_the_directory_and_the_holder(
        tmp_path: Path, writer: Writer) -> None:
    log_dir = tmp_path / "log"
    segment = segment_paths(log_dir)[-1]
    with open(segment, "ab") as fh:  # a frame the holder is still writing: a second writer must not cut it
        fh.write(b"\x40\x00\x00\x00partial")
    size = segment.stat().st_size
    with pytest.raises(LogLockedError) as refused:
        EventLog(log_dir, header=HEADER)
    message = str(refused.value)
    assert "\n" not in message
    assert str(log_dir) in message and f"pid={writer.proc.pid}" in message and socket.gethostname() in message
    assert isinstance(refused.value, LogError)
    assert segment.stat().st_size == size  # nothing read-and-cut, nothing created
    assert segment_paths(log_dir) == [segment]


def test_mutant_without_the_lock_a_second_writer_is_let_in(tmp_path: Path, writer: Writer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    class NoLock:
        def __init__(self, directory: Path) -> None:
            pass

        def release(self) -> None:
            pass

    monkeypatch.setattr("kvlifecycle.eventlog.WriterLock", NoLock)
    second = EventLog(tmp_path / "log", header=HEADER)  # what the real test refuses
    assert len(segment_paths(tmp_path / "log")) == 2
    second.close()


def test_a_writer_killed_with_sigkill_lets_its_successor_open_at_once(tmp_path: Path, writer: Writer) -> None:
    os.kill(writer.proc.pid, signal.SIGKILL)
    writer.proc.wait(timeout=30)
    assert writer.proc.returncode == -signal.SIGKILL
    successor = open_ledger("source", 8, tmp_path / "log", fsync="always", worker="p0")  # no wait, no cleanup
    successor.allocate("r2", [2])
    assert successor.log is not None
    successor.log.close()
    result = replay(tmp_path / "log")
    assert len(result.events) == 6 and len(result.restarts) == 1  # both incarnations, each whole


def test_a_successor_opens_after_a_clean_close_in_another_process(tmp_path: Path, writer: Writer) -> None:
    assert writer.proc.stdin is not None
    writer.proc.stdin.write("\n")
    writer.proc.stdin.flush()
    assert writer.proc.wait(timeout=30) == 0
    EventLog(tmp_path / "log", header=HEADER).close()


def test_readers_take_no_lock_and_modify_nothing_while_a_writer_holds_the_log(tmp_path: Path,
                                                                             writer: Writer) -> None:
    log_dir = tmp_path / "log"
    before = {p.name: p.read_bytes() for p in log_dir.iterdir()}
    assert len(read_events(log_dir)) == 5
    assert len(list(LogReader(log_dir).records())) == 5
    assert len(replay(log_dir).events) == 5
    for command in (["replay", str(log_dir), "--check"], ["timeline", str(log_dir), "-o", str(tmp_path / "trace.json")],
                    ["explain", str(log_dir)]):
        proc = subprocess.run([sys.executable, "-m", "kvlifecycle", *command], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode in (0, 1), (command, proc.stderr)  # read it (1: findings), never "in use"
        assert "in use" not in proc.stderr
    assert {p.name: p.read_bytes() for p in log_dir.iterdir()} == before
    assert LOCK_NAME in before and all(p.name != LOCK_NAME for p in segment_paths(log_dir))


def test_a_reader_creates_no_lock_file(tmp_path: Path) -> None:
    ledger = open_ledger("source", 8, tmp_path / "log", worker="p0")
    ledger.allocate("r1", [1])
    assert ledger.log is not None
    ledger.log.close()
    (tmp_path / "log" / LOCK_NAME).unlink()
    read_events(tmp_path / "log")
    replay(tmp_path / "log")
    assert not (tmp_path / "log" / LOCK_NAME).exists()


def test_in_one_process_a_second_writer_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = EventLog(tmp_path / "log", header=HEADER)
    with pytest.raises(LogLockedError, match=f"pid={os.getpid()}"):
        EventLog(tmp_path / "log", header=HEADER)
    first.close()
    EventLog(tmp_path / "log", header=HEADER).close()


def test_the_lock_is_let_go_when_opening_fails_after_taking_it(tmp_path: Path) -> None:
    EventLog(tmp_path / "log", header=HEADER).close()
    with pytest.raises(LogError, match="refusing to append"):
        EventLog(tmp_path / "log", header={**HEADER, "worker": "someone-else"})
    lock = log_lock.WriterLock(tmp_path / "log")  # free again
    lock.release()
