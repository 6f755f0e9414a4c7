"""Merge several event logs (P's and D's, any number of workers) into one causal order by hybrid logical clock.

Each side stamps its events with its own HLC; a side that observes a peer's stamp (``HybridLogicalClock.observe``)
sorts after it, so sorting by stamp gives an order consistent with every message that crossed between the logs.
Ties (equal stamps from different workers) break by worker name, then by position in the worker's own log, so the
merge is deterministic.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvlifecycle.eventlog import SEGMENT_GLOB, LogError, LogReader, Record, TailRecovery


@dataclass(frozen=True, slots=True)
class LogSource:
    """One log directory and what its header says about the ledger that wrote it."""

    path: Path
    worker: str
    side: str  # "source" | "target"
    num_blocks: int
    header: dict[str, Any]  # the log header as written (JSON)


def expand_log_dirs(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """Log directories named by ``paths``: a directory holding segments is one log; a directory holding no segments
    but sub-directories that do (e.g. a demo's ``p/`` and ``d/``) stands for those sub-directories."""
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.is_dir():
            raise LogError(f"no event log at {path} (not a directory)")
        if any(path.glob(SEGMENT_GLOB)):
            out.append(path)
            continue
        children = sorted(child for child in path.iterdir() if child.is_dir() and any(child.glob(SEGMENT_GLOB)))
        if not children:
            raise LogError(f"no event log segments (seg-*.kvl) in {path} or its sub-directories")
        out.extend(children)
    return out


def open_sources(paths: Iterable[str | os.PathLike[str]]) -> list[tuple[LogSource, LogReader]]:
    sources: list[tuple[LogSource, LogReader]] = []
    seen: dict[str, Path] = {}
    for directory in expand_log_dirs(paths):
        reader = LogReader(directory)
        header = reader.read_header()
        worker = str(header.get("worker") or directory.name)
        side = str(header.get("side", ""))
        if worker in seen:
            raise LogError(f"two logs claim worker {worker!r}: {seen[worker]} and {directory}")
        seen[worker] = directory
        sources.append((LogSource(directory, worker, side, int(header.get("num_blocks", 0)), header), reader))
    return sources


def merge_logs(
    paths: Iterable[str | os.PathLike[str]], *, tails: dict[str, TailRecovery] | None = None
) -> list[tuple[str, str, Record]]:
    """Every event of every log in ``paths`` as ``(worker, side, Record)``, sorted by HLC, ties by worker, then by
    the record's index in its own log. Each log's own order is kept: where a log's stamps go backwards (a restarted
    worker whose new incarnation stamps below the last stamp of the old one), those records sort at the highest
    stamp their log had reached, never before events their own worker logged earlier. Raises
    :class:`~kvlifecycle.eventlog.LogError` (or its :class:`~kvlifecycle.eventlog.CorruptLogError`) naming the file
    for a missing or corrupt log. ``tails``, when given, receives each worker's torn tail (a log that ends in the
    middle of a record)."""
    merged = []
    for source, reader in open_sources(paths):
        high = 0
        for record in reader.records():
            high = max(high, record.event.hlc)
            merged.append((high, source.worker, record.index, source.side, record))
        if tails is not None and reader.tail is not None:
            tails[source.worker] = reader.tail
    merged.sort(key=lambda item: item[:3])
    return [(worker, side, record) for _hlc, worker, _index, side, record in merged]
