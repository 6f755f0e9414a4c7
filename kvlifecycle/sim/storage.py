"""Faulty storage for the event logs: a crash loses the batch not yet written, and may tear the last segment at any
byte (TigerBeetle's faulty storage). Reopening the directory with :class:`~kvlifecycle.eventlog.EventLog` recovers
the torn tail: it truncates to the last whole record and reports it.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from kvlifecycle.eventlog import EventLog, TornTailWarning, segment_paths


def crash(log: EventLog) -> None:
    """The process died: what the log held in memory (its unwritten batch) is gone, the file is just closed."""
    with log._lock:  # the simulated crash reaches into the log: nothing else may drop a batch unwritten
        log._pending.clear()
        log._pending_bytes = 0
        if log._fh is not None:
            log._fh.close()
            log._fh = None
        log._closed = True


def tear_tail(directory: str | Path, fraction: float) -> tuple[Path, int, int] | None:
    """Truncate the last segment of the log in ``directory`` at ``fraction`` of its size (a seeded byte offset).
    Returns (segment, new size, old size), or None when there is no segment."""
    segments = segment_paths(Path(directory))
    if not segments:
        return None
    last = segments[-1]
    size = last.stat().st_size
    cut = min(size, max(0, int(size * fraction)))
    with open(last, "r+b") as fh:
        fh.truncate(cut)
    return last, cut, size


def reopen(directory: str | Path, header: dict) -> tuple[EventLog, bool]:
    """Open the log for append after a crash; returns it and whether a torn tail was recovered."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        log = EventLog(directory, header=header, fsync="never")
    return log, log.recovered is not None
