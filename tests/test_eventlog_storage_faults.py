"""The event log survives its disk: a real 512 KiB tmpfs filled while a ledger commits and then freed, under every
fsync policy; the log replays clean at every moment and holds every command the ledger applied. Beside them, faults
a tmpfs cannot produce (EIO, a failed fsync, a bug in the syncer) come through the log's file-operations seam."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.eventlog import (
    CorruptLogError,
    EventLog,
    LogError,
    LogFiles,
    LogFullError,
    LogWriteError,
    read_events,
)
from kvlifecycle.ledger import SourceLedger, open_ledger
from kvlifecycle.replay import check, replay

POLICIES = ["always", "10ms", "never"]
BLOCKS = 64


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (root is needed; CI runs as root): {proc.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 512 KiB filesystem: full is full."""
    where = tmp_path / "disk"
    _mount_tmpfs(where, "512k")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def fill(disk: Path) -> Path:
    """Write a filler file until the disk refuses (bounded by the disk's size)."""
    filler = disk / "filler"
    chunk = b"\xa5" * 4096
    with open(filler, "wb", buffering=0) as fh:
        for _ in range(1024):
            try:
                fh.write(chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                return filler
    raise AssertionError("the disk never filled")


class Workload:
    """Requests through allocate → prefill_done → free, a command at a time, each step committed; a refused command
    (backpressure) changes nothing and the request waits for its next turn."""

    def __init__(self, ledger: SourceLedger) -> None:
        self.ledger = ledger
        self.next = 0
        self.live: dict[str, int] = {}  # request -> steps done (1 allocated, 2 prefilled)
        self.applied = self.refused = self.commit_errors = 0

    def step(self) -> None:
        ledger = self.ledger
        try:
            advanced = next((r for r, s in self.live.items() if s < 3), None)
            if advanced is None or len(self.live) < 8:
                request = f"r{self.next}"
                block = self.next % BLOCKS
                self.next += 1
                ledger.allocate(request, [block])
                self.live[request] = 1
            elif self.live[advanced] == 1:
                ledger.prefill_done(advanced)
                self.live[advanced] = 2
            else:
                ledger.free(advanced)
                del self.live[advanced]
            self.applied += 1
        except LogFullError:
            self.refused += 1
        try:
            ledger.commit()
        except LogWriteError as exc:
            assert exc.errno == errno.ENOSPC and str(ledger.log.directory) in str(exc)  # type: ignore[union-attr]
            self.commit_errors += 1


def replay_check_cli(log_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", str(log_dir), "--check"],
                          capture_output=True, text=True, timeout=120)


def clean_between_writes(log_dir: Path, *, writer_in_background: bool) -> bool:
    """No torn tail is ever left behind. Under ``interval`` the syncer writes on its own thread, so a read may meet
    the frame it is writing (or the part ENOSPC let through before the writer cut it back): such a tail must be gone
    at a later read, while the disk is still full."""
    if not writer_in_background:
        return replay(log_dir).tail is None
    return until(lambda: replay(log_dir).tail is None, timeout_s=10)


def assert_log_holds_the_ledger(log_dir: Path, ledger: SourceLedger, appended: int) -> None:
    result = replay(log_dir)
    assert result.tail is None  # no torn tail: nothing partial was ever left behind
    assert len(result.events) == appended  # every record the ledger appended, once
    assert np.array_equal(result.ledger.state, ledger.state)
    assert set(result.ledger.requests) == set(ledger.requests)
    assert result.ledger.allocations == ledger.allocations
    assert check(result) == []


@pytest.mark.parametrize("policy", POLICIES)
def test_a_full_disk_that_comes_back_leaves_a_log_holding_every_applied_command(small_disk: Path,
                                                                                policy: str) -> None:
    log_dir = small_disk / "log"
    ledger = open_ledger("source", BLOCKS, log_dir, fsync=policy)
    work = Workload(ledger)
    for _ in range(20):
        work.step()
    filler = fill(small_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the failures are reported; counted below
        for _ in range(600):  # ~60 bytes a record: several pages' worth, past what the disk has left
            work.step()
            if work.next % 50 == 0:  # readable and clean at every moment, even while full
                assert clean_between_writes(log_dir, writer_in_background=policy == "10ms")
        log = ledger.log
        assert log is not None
        assert log.write_failures > 0 and log.write_error is not None
        assert work.commit_errors > 0
        if policy == "always":  # every command after a failed write is refused before it changes anything
            assert work.refused > 0
        filler.unlink()
        ledger.commit()  # the disk is back: everything pending is written, once, whole
        log.flush()
    assert log.write_error is None
    assert_log_holds_the_ledger(log_dir, ledger, log.appended)
    log.close()
    proc = replay_check_cli(log_dir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reopened = open_ledger("source", BLOCKS, log_dir, fsync=policy)  # the worker restarts on its own log
    assert reopened.log is not None and reopened.log.recovered is None
    reopened.log.close()


@pytest.mark.parametrize("policy", ["always", "10ms"])
def test_mutant_retry_appends_after_a_partial_frame_is_caught(small_disk: Path, policy: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cut-back, a failed write's partial frame stays and the retry appends the whole batch after it:
    the log no longer replays."""
    monkeypatch.setattr(EventLog, "_cut_back", lambda self, fd, size: None)
    log_dir = small_disk / "log"
    ledger = open_ledger("source", BLOCKS, log_dir, fsync=policy)
    work = Workload(ledger)
    filler = fill(small_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(600):
            work.step()
        filler.unlink()
        ledger.commit()
        assert ledger.log is not None
        ledger.log.flush()
    ledger.log.close()
    with pytest.raises(CorruptLogError):
        replay(log_dir)
    assert replay_check_cli(log_dir).returncode == 2


def test_past_the_bound_commands_are_refused_before_they_change_anything(small_disk: Path) -> None:
    log_dir = small_disk / "log"
    ledger = SourceLedger(BLOCKS, worker="p0")
    log = EventLog(log_dir, header=ledger.header(), fsync="10ms", batch_bytes=1024, max_pending_bytes=4096)
    ledger.log = log
    work = Workload(ledger)
    filler = fill(small_disk)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(600):
            work.step()
        assert work.refused > 0
        assert log._pending_bytes + log._rewrite_bytes < 4096 + 1024  # bounded: one batch past the bound at most
        before = (ledger.state.copy(), dict(ledger.requests), ledger.allocations)
        with pytest.raises(LogFullError, match=r"cannot take more records.*refused before it changed anything"):
            ledger.allocate("refused", [BLOCKS - 1])
        assert np.array_equal(ledger.state, before[0]) and ledger.requests.keys() == before[1].keys()
        assert ledger.allocations == before[2]
        filler.unlink()
        ledger.allocate("admitted", [BLOCKS - 1] if "admitted" not in ledger.requests else [])  # the disk is back
        log.flush()
    assert_log_holds_the_ledger(log_dir, ledger, log.appended)
    log.close()


# -- faults a tmpfs cannot produce, through the file-operations seam ----------------------------------------------
class Faulty(LogFiles):
    """Real file operations, with a chosen failure switched on and off by the test."""

    def __init__(self) -> None:
        self.fail_write: OSError | Exception | None = None
        self.short_writes = False
        self.fail_fsync: OSError | None = None
        self.fail_truncate: OSError | None = None
        self.fsyncs_failed = 0
        self.written: list[bytes] = []

    def write(self, fd: int, data: memoryview) -> int:
        if self.fail_write is not None:
            raise self.fail_write
        if self.short_writes and len(data) > 1:
            data = data[: len(data) // 2]
        n = os.write(fd, data)
        self.written.append(bytes(data[:n]))
        return n

    def truncate(self, fd: int, size: int) -> None:
        if self.fail_truncate is not None:
            raise self.fail_truncate
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        if self.fail_fsync is not None:
            self.fsyncs_failed += 1
            raise self.fail_fsync
        os.fsync(fd)


def events(n: int, start: int = 0) -> list[ev.Event]:
    return [ev.SrcPrefillDone(i, float(i), f"r{i}") for i in range(start, start + n)]


def test_an_eio_write_raises_from_commit_with_errno_and_directory_and_the_batch_is_written_once_later(
        tmp_path: Path) -> None:
    files = Faulty()
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="never", files=files)
    first, second = events(3), events(3, 3)
    for e in first:
        log.append(e)
    files.fail_write = OSError(errno.EIO, "Input/output error")
    with pytest.warns(RuntimeWarning), pytest.raises(LogWriteError) as raised:
        log.commit()
    assert raised.value.errno == errno.EIO and str(tmp_path / "log") in str(raised.value)
    assert isinstance(raised.value, LogError)
    files.fail_write = None
    for e in second:
        log.append(e)
    log.commit()
    log.close()
    assert read_events(tmp_path / "log") == first + second


def test_short_writes_are_finished_not_taken_for_whole_ones(tmp_path: Path) -> None:
    files = Faulty()
    files.short_writes = True
    with EventLog(tmp_path / "log", header={"side": "source"}, fsync="always", files=files) as log:
        for e in events(20):
            log.append(e)
    assert read_events(tmp_path / "log") == events(20)


def test_after_a_failed_fsync_the_unsynced_frames_are_cut_off_and_written_again(tmp_path: Path) -> None:
    """fsyncgate: a failed fsync may have dropped the pages, and a retried fsync may succeed without them, so the
    frames since the last good fsync are written again (fresh dirty pages) before flush succeeds. A failing fsync
    cannot be made on tmpfs; the seam fakes only the fsync's answer, the writes are real."""
    files = Faulty()
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="always", files=files)
    log.append(events(1)[0])  # synced
    files.fail_fsync = OSError(errno.EIO, "Input/output error")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        log.append(events(1, 1)[0])  # written, its fsync fails: the command applied, commit reports it
    assert isinstance(log.write_error, LogWriteError) and log.write_error.errno == errno.EIO
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(LogFullError, match="cannot take more records"):  # under always: refused until written
            log.admit()
        with pytest.raises(LogWriteError, match="fsync failed"):
            log.flush()
    unsynced_frame = files.written[-1]
    files.fail_fsync = None
    files.written.clear()
    log.flush()  # cut back to the last good fsync, the frame written again, then synced
    assert files.written == [unsynced_frame]
    assert log.write_error is None
    log.admit()  # admitted again
    log.close()
    assert read_events(tmp_path / "log") == events(2)


def test_mutant_a_failed_fsync_trusted_on_retry_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant forgets the failure: the retried fsync "succeeds" and the frame whose pages may be gone is never
    written again."""
    monkeypatch.setattr(EventLog, "_cut_back_unsynced", lambda self: setattr(self, "_sync_failure", None))
    files = Faulty()
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="always", files=files)
    log.append(events(1)[0])
    files.fail_fsync = OSError(errno.EIO, "Input/output error")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        log.append(events(1, 1)[0])
    unsynced_frame = files.written[-1]
    files.fail_fsync = None
    files.written.clear()
    log.flush()
    assert files.written != [unsynced_frame]  # what the real test asserts does not hold
    log.close()


def test_the_syncer_survives_every_error_counts_it_and_backs_off(tmp_path: Path) -> None:
    files = Faulty()
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="5ms", files=files)
    syncer = log._syncer
    assert syncer is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        files.fail_write = OSError(errno.ENOSPC, "No space left on device")
        log.append(events(1)[0])
        deadline = time.monotonic() + 10.0  # a liveness bound, not a speed claim
        while log.write_failures < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert log.write_failures >= 2 and log.write_error is not None and log.write_error.errno == errno.ENOSPC
        files.fail_write = RuntimeError("a bug in the write path")  # not an OSError: still never fatal
        failures = log.write_failures
        while log.write_failures == failures and time.monotonic() < deadline:
            time.sleep(0.005)
        assert log.write_failures > failures
        assert syncer.is_alive()
        files.fail_write = None
        while read_events_safe(tmp_path / "log") != events(1) and time.monotonic() < deadline:
            time.sleep(0.005)
    assert syncer.is_alive()
    assert read_events(tmp_path / "log") == events(1)  # the syncer wrote it once the disk allowed
    log.close()
    assert not syncer.is_alive()


def read_events_safe(path: Path) -> list[ev.Event]:
    try:
        return read_events(path)
    except LogError:
        return []


def test_the_syncer_thread_name_and_log_counter_are_public(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="5ms")
    assert log.write_failures == 0 and log.write_error is None
    assert any(t.name == "kvl-log-sync-log" for t in threading.enumerate())
    log.close()


def test_the_ledger_refusal_names_the_directory(tmp_path: Path) -> None:
    files = Faulty()
    ledger = SourceLedger(BLOCKS, worker=f"p-{uuid.uuid4().hex[:6]}")
    ledger.log = EventLog(tmp_path / "log", header=ledger.header(), fsync="always", files=files)
    ledger.allocate("a", [0])
    files.fail_write = OSError(errno.ENOSPC, "No space left on device")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ledger.prefill_done("a")  # applied; its record waits (the command is not un-done)
        with pytest.raises(LogFullError) as refused:
            ledger.free("a")
    assert str(tmp_path / "log") in str(refused.value) and refused.value.errno == errno.ENOSPC
    files.fail_write = None
    ledger.free("a")
    ledger.log.close()
    assert [type(e).__name__ for e in read_events(tmp_path / "log")] == ["SrcAllocated", "SrcPrefillDone",
                                                                         "SrcFreed"]


def test_doctor_reports_a_log_that_cannot_be_written_and_clears_once_the_disk_is_back(small_disk: Path) -> None:
    log_dir = small_disk / "log"
    ledger = open_ledger("source", BLOCKS, log_dir, fsync="always")
    ledger.allocate("a", [0])
    filler = fill(small_disk)

    def doctor() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvlifecycle", "doctor", "--log-dir", str(log_dir)],
                              capture_output=True, text=True, timeout=120)

    full = doctor()
    assert full.returncode == 1, full.stdout + full.stderr
    assert "the log cannot be written: No space left on device" in full.stdout
    assert f"pid={os.getpid()}" in full.stdout and "alive" in full.stdout  # the writer holding it, named
    assert "read:  ok" in full.stdout  # a reader still reads it (and the doctor takes no lock)
    filler.unlink()
    back = doctor()
    assert back.returncode == 0 and "write: ok" in back.stdout, back.stdout + back.stderr
    assert ledger.log is not None
    ledger.log.close()


def test_write_failures_are_counted_in_the_telemetry(tmp_path: Path) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from kvlifecycle.telemetry import count_log_write_failures

    reader = InMemoryMetricReader()
    stop = count_log_write_failures(MeterProvider(metric_readers=[reader]))
    files = Faulty()
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="never", files=files)
    log.append(events(1)[0])
    files.fail_write = OSError(errno.ENOSPC, "No space left on device")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(3):
            with pytest.raises(LogWriteError):
                log.commit()
    stop()
    files.fail_write = None
    log.close()
    points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics if m.name == "kv.log.write_failures" for p in m.data.data_points]
    assert sum(p.value for p in points) == 3
    assert {p.attributes["kv.errno"] for p in points} == {"ENOSPC"}
    assert {p.attributes["kv.log.dir"] for p in points} == {str(tmp_path / "log")}


def test_a_failed_write_that_cannot_be_cut_back_stops_the_log_and_refuses_every_command(tmp_path: Path) -> None:
    """The one fault the log cannot undo: a partial frame it could not cut off. It writes nothing more (a retry would
    land after the partial frame), refuses every command, and a restart recovers the partial frame as a torn tail."""
    files = Faulty()
    ledger = SourceLedger(BLOCKS, worker="p0")
    ledger.log = EventLog(tmp_path / "log", header=ledger.header(), fsync="never", files=files)
    ledger.allocate("a", [0])
    ledger.commit()
    ledger.prefill_done("a")
    calls: list[int] = []

    def half_then_fail(fd: int, data: memoryview) -> int:  # half of the frame reaches the file, then the disk fails
        calls.append(len(data))
        if len(calls) == 1:
            return os.write(fd, data[: len(data) // 2])
        raise OSError(errno.EIO, "Input/output error")

    files.write = half_then_fail  # type: ignore[method-assign]
    files.fail_truncate = OSError(errno.EIO, "Input/output error")  # ... and so does the cut
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(LogWriteError, match="cutting a failed write back"):
            ledger.commit()
        files.fail_truncate = None
        del files.write  # the disk is back
        with pytest.raises(LogWriteError, match="cutting a failed write back"):
            ledger.commit()  # still stopped: a retry would land after the partial frame
        with pytest.raises(LogFullError):
            ledger.free("a")
    assert "a" in ledger.requests  # refused before it changed anything
    with pytest.raises(LogWriteError):
        ledger.log.close()
    with pytest.warns(Warning, match="truncated"):
        reopened = EventLog(tmp_path / "log", header=ledger.header())
    assert reopened.recovered is not None
    reopened.close()
    assert [type(e).__name__ for e in read_events(tmp_path / "log")] == ["SrcAllocated"]
