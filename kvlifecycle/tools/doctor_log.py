"""``kvlifecycle doctor --log-dir DIR``: can this event-log directory be read, and can it be written now?

It reads every segment as a reader does (no lock, nothing modified), names the writer holding the directory (its
lock file's pid and host, and whether that pid is alive here), reports the filesystem's free space, and writes,
fsyncs and removes a probe file beside the segments: a full disk, a read-only mount or missing permissions show as
"cannot be written" with the operating system's reason. Exit status: 0 readable and writable; 1 not.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvlifecycle.eventlog import LogError, LogReader, segment_paths
from kvlifecycle.log_lock import LOCK_NAME

PROBE_BYTES = 4096  # one page: what the next frame needs at least


@dataclass
class LogDirReport:
    directory: str
    segments: int = 0
    events: int = 0
    readable: bool = False
    read_problem: str = ""
    torn_tail: str = ""
    writer: str = ""  # who holds the writer lock, per its lock file ("" when none is named)
    writer_alive: bool | None = None  # that pid is alive on this host (None: another host, or none named)
    free_bytes: int = 0
    writable: bool = False
    write_problem: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.readable and self.writable


def collect(directory: Path) -> LogDirReport:
    report = LogDirReport(str(directory))
    if not directory.is_dir():
        report.read_problem = report.write_problem = "not a directory"
        report.problems.append(f"{directory}: not a directory")
        return report
    report.segments = len(segment_paths(directory))
    try:
        reader = LogReader(directory)
        report.events = sum(1 for _ in reader)
        report.readable = True
        if reader.tail is not None:
            report.torn_tail = f"{reader.tail.segment.name} at {reader.tail.offset}: {reader.tail.reason}"
    except (LogError, OSError) as exc:
        report.read_problem = str(exc)
        report.problems.append(f"cannot be read: {exc}")
    _writer(directory, report)
    try:
        stat = os.statvfs(directory)
        report.free_bytes = stat.f_bavail * stat.f_frsize
    except OSError as exc:
        report.problems.append(f"statvfs: {exc}")
    probe = directory / f".doctor-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = os.write(fd, b"\0" * PROBE_BYTES)
            if written != PROBE_BYTES:
                raise OSError(f"short write: {written} of {PROBE_BYTES} bytes")
            os.fsync(fd)
        finally:
            os.close(fd)
        report.writable = True
    except OSError as exc:
        report.write_problem = exc.strerror or str(exc)
        report.problems.append(f"cannot be written: {report.write_problem}")
    finally:
        probe.unlink(missing_ok=True)
    return report


def _writer(directory: Path, report: LogDirReport) -> None:
    try:
        text = (directory / LOCK_NAME).read_text(errors="replace").strip()
    except OSError:
        return
    report.writer = text
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    pid, host = fields.get("pid", ""), fields.get("host", "")
    if pid.isdigit() and host == socket.gethostname():
        try:
            os.kill(int(pid), 0)
            report.writer_alive = True
        except ProcessLookupError:
            report.writer_alive = False
        except PermissionError:
            report.writer_alive = True


def render(report: LogDirReport) -> str:
    lines = [f"event log {report.directory}: {report.segments} segment(s), {report.events} event(s)"]
    lines.append(f"  read:  {'ok' if report.readable else 'FAILED: ' + report.read_problem}"
                 + (f" (torn tail: {report.torn_tail})" if report.torn_tail else ""))
    if report.writer:
        alive = {True: ", alive", False: ", not running (the lock is free)", None: ""}[report.writer_alive]
        lines.append(f"  writer: {report.writer}{alive}")
    lines.append(f"  free:  {report.free_bytes / (1 << 20):.1f} MiB")
    write = "ok" if report.writable else f"FAILED: the log cannot be written: {report.write_problem}"
    lines.append(f"  write: {write}")
    lines.append(f"doctor {'OK' if report.ok else 'FAILED'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    report = collect(Path(args.log_dir))
    if args.json:
        print(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    else:
        print(render(report))
    return 0 if report.ok else 1

