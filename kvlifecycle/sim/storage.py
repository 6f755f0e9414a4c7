"""Faulty storage for the event logs: a crash loses the batch not yet written, or tears it at any byte while it is
being written (TigerBeetle's faulty storage). Reopening the directory with :class:`~kvlifecycle.eventlog.EventLog`
recovers the torn tail: it truncates to the last whole record and reports it.

Beside crashes, a worker's disk fails while it runs (:class:`FaultyDisk`, at the real log's file-operations seam,
seeded per worker and boot): ENOSPC and EIO (sometimes after a short write that reached the file), short writes,
failed fsyncs, each for a few operations, then the disk comes back. The worker's log (:class:`SimLog`) is the real
:class:`~kvlifecycle.eventlog.EventLog` under an ``interval`` policy whose syncer rounds the scheduler drives (one
after each commit); a failed commit is what an engine sees: counted, the records stay pending for a later commit.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal, get_args

from kvlifecycle.eventlog import EventLog, FsyncPolicy, LogFiles, LogWriteError, TornTailWarning, segment_paths

DiskFault = Literal["enospc", "eio", "short_write", "fsync_fail"]
DISK_FAULTS: tuple[DiskFault, ...] = get_args(DiskFault)
DISK_BACK = "disk_back"  # a fault ended: the disk takes writes again
FAULT_RATE = 0.03  # chance that a healthy operation starts a fault


class FaultyDisk(LogFiles):
    """Real file operations with seeded faults: each healthy operation may start one (:data:`FAULT_RATE`), which then
    lasts a few operations (a full disk up to 30) before the disk comes back. Truncation never fails (a shrink needs
    no space). fsync does not reach the device: the simulated crashes are process crashes, the page cache survives."""

    def __init__(self, seed_text: str, exercise: Callable[[str], None]) -> None:
        self.rng = random.Random(zlib.crc32(seed_text.encode()))
        self.exercise = exercise
        self.enabled = True
        self.fault: DiskFault | None = None
        self.left = 0  # operations the current fault still lasts
        self.fresh = False  # the fault's first operation (where a short write may precede the error)

    def _next(self) -> DiskFault | None:
        if not self.enabled:
            return None
        if self.fault is not None and self.left == 0:
            self.fault = None
            self.exercise(DISK_BACK)
        if self.fault is None:
            if self.rng.random() >= FAULT_RATE:
                return None
            fault: DiskFault = self.rng.choice(DISK_FAULTS)
            self.fault = fault
            self.left = self.rng.randint(1, 30 if fault == "enospc" else 6)
            self.fresh = True
            self.exercise(fault)
        else:
            self.fresh = False
        self.left -= 1
        return self.fault

    def write(self, fd: int, data: memoryview) -> int:
        fault = self._next()
        if fault is None or fault == "fsync_fail":
            return os.write(fd, data)
        if fault == "short_write" or (self.fresh and len(data) > 1 and self.rng.random() < 0.5):
            return os.write(fd, data[: self.rng.randrange(1, len(data))] if len(data) > 1 else data)
        code = errno.ENOSPC if fault == "enospc" else errno.EIO
        raise OSError(code, os.strerror(code))

    def fsync(self, fd: int) -> None:
        if self._next() == "fsync_fail":
            raise OSError(errno.EIO, os.strerror(errno.EIO))


class SimLog(EventLog):
    """A worker's log in the simulation: the real writer, with the syncer's rounds run by the scheduler after each
    commit, and a failed commit absorbed as an engine does (the records stay pending; the next commit writes them)."""

    warn_on_failure = False  # thousands of seeds: the checks judge the log, not the warnings

    def __init__(self, directory: str | Path, header: dict[str, Any], disk: FaultyDisk | None) -> None:
        if disk is not None:  # the worker starts on a working disk (a start on a failing one is an error to retry)
            disk.enabled = False
        super().__init__(directory, header=header, fsync=FsyncPolicy.every(10.0), background_sync=False,
                         files=disk if disk is not None else LogFiles())
        if disk is not None:
            disk.enabled = True
        self.disk = disk
        self.failed_commits = 0
        self.absorb = True  # False while the runtime's loop runs: its commits raise, as the real log's do

    def commit(self) -> None:
        try:
            super().commit()
            self.sync_round()
        except LogWriteError:
            self.failed_commits += 1
            if not self.absorb:
                raise

    @contextlib.contextmanager
    def runtime_loop(self) -> Iterator[None]:
        """A turn of the Producer's or Consumer's loop: a commit that fails raises into it (the Consumer commits a
        load's failure before it tells P, and must not tell P of a record the log does not hold); the loop's own
        catch-all ends the turn, as the real service thread's does."""
        self.absorb = False
        try:
            yield
        except LogWriteError:
            pass
        finally:
            self.absorb = True

    def close(self) -> None:
        if self.disk is not None:  # the disk is back before the worker exits: what waits is written
            self.disk.enabled = False
        super().close()


def crash(log: EventLog, tear: float | None = None) -> tuple[Path, int, int] | None:
    """The process died. Without ``tear``: its unwritten batch is gone, the file is just closed. With ``tear``: it
    died while writing that batch, which stops at ``tear`` of its bytes (a seeded byte offset; mid-record, as a
    rule). What an earlier commit wrote survives: the process crashed, the host did not. Returns (segment, new size,
    written size) of a torn write, else None."""
    torn = None
    with log._lock:  # the simulated crash reaches into the log: nothing else may drop a batch unwritten
        if tear is not None and log._pending and log._fh is not None:
            before = segment_paths(log.directory)
            start = (before[-1], before[-1].stat().st_size) if before else None
            disk = log.files if isinstance(log.files, FaultyDisk) else None
            if disk is not None:
                disk.enabled = False  # the tear is the crash's own fault
            with contextlib.suppress(LogWriteError):
                log._persist(sync=False)
            last = segment_paths(log.directory)[-1]
            size = last.stat().st_size
            offset = start[1] if start is not None and start[0] == last else 0
            torn = last, offset + int((size - offset) * tear), size
        log._pending.clear()
        log._pending_bytes = 0
        log._rewrite.clear()  # frames a failed fsync cut off: as unwritten as the batch
        log._rewrite_bytes = 0
        if log._fh is not None:
            log._fh.close()
            log._fh = None
        log._closed = True
        if log._writer_lock is not None:
            log._writer_lock.release()  # the kernel lets a dead process's lock go
    if torn is not None:
        with open(torn[0], "r+b") as fh:
            fh.truncate(torn[1])
    return torn


def reopen(directory: str | Path, header: dict[str, Any], disk: FaultyDisk | None = None) -> tuple[SimLog, bool]:
    """Open the log for append after a crash (on ``disk``, or a healthy one); returns it and whether a torn tail
    was recovered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        log = SimLog(directory, header, disk)
    return log, log.recovered is not None
