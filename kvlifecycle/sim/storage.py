"""Faulty storage for the event logs: a crash loses the batch not yet written, or tears it at any byte while it is
being written (TigerBeetle's faulty storage). Reopening the directory with :class:`~kvlifecycle.eventlog.EventLog`
recovers the torn tail: it truncates to the last whole record and reports it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from kvlifecycle.eventlog import EventLog, TornTailWarning, segment_paths


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
            log._write_batch()
            log._fh.flush()
            last = segment_paths(log.directory)[-1]
            size = last.stat().st_size
            offset = start[1] if start is not None and start[0] == last else 0
            torn = last, offset + int((size - offset) * tear), size
        log._pending.clear()
        log._pending_bytes = 0
        if log._fh is not None:
            log._fh.close()
            log._fh = None
        log._closed = True
    if torn is not None:
        with open(torn[0], "r+b") as fh:
            fh.truncate(torn[1])
    return torn


def reopen(directory: str | Path, header: dict) -> tuple[EventLog, bool]:
    """Open the log for append after a crash; returns it and whether a torn tail was recovered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        log = EventLog(directory, header=header, fsync="never")
    return log, log.recovered is not None
