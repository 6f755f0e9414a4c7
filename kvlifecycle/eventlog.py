"""Append-only, crash-safe event log in segment files on local disk (the embedded default: no service needed).

Layout of a log directory::

    seg-00000000.kvl   MAGIC | frame(header) | frame(batch of events) | frame(batch of events) | ...
    seg-00000001.kvl   ...

A frame is ``<u32 length><u32 crc32(payload, seed)><payload>`` (a damaged length reads the wrong span, which fails the
checksum; a length above :data:`MAX_RECORD` cannot come from a torn write and is corruption). The header frame is a
msgpack map with the schema version and the ledger's configuration (side, worker, number of blocks, incarnation), so
a log replays on its own. Every other frame is one committed batch (split only past :data:`MAX_RECORD`): a msgpack
array of events, written with one ``write`` and decoded with one call, so a batch is the unit of atomicity — a crash
keeps whole batches and loses at most the last.

Durability: appends go into an in-memory batch; the batch is written (one ``write``) and fsynced according to the
:class:`FsyncPolicy` — every commit, every N ms, or never. Crash safety: on open for append, a torn or corrupt tail of
the last segment is detected, reported and truncated to the last good record; a corrupt record with good records
after it (or in an earlier segment) is a :class:`CorruptLogError` naming the segment and offset, never a silent skip.

One concept, longer than most: the log's writer and reader, which share the frame format, the segment layout and
the durability contract (a failed write cut back, a failed fsync's frames written again); the writer lock lives in
:mod:`kvlifecycle.log_lock`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import struct
import sys
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import attrs
import msgspec

from kvlifecycle.choices import Choice
from kvlifecycle.events import SCHEMA_VERSION, AnyEvent, Event, encode
from kvlifecycle.log_lock import LockHeld, WriterLock

BATCH_DECODER = msgspec.msgpack.Decoder(list[AnyEvent])

# A segment header as msgpack decodes it: a map from field name to whatever the writer put there. The reader checks
# the fields it relies on where it reads them (_decode_header, ledger_from_header).
LogHeader = dict[str, Any]

MAGIC = b"KVLLOG\x01\n"
FRAME = struct.Struct("<II")
FRAME_SIZE = FRAME.size
_pack_frame = FRAME.pack
CRC_SEED = 0x4B564C31  # a non-zero seed: a run of zero bytes is never a valid (empty) frame


def _crc32(payload: bytes | memoryview) -> int:
    return zlib.crc32(payload, CRC_SEED)


EVENT_SIZE_ESTIMATE = 96  # bytes per unencoded event, for the batch-size bound (a load event encodes to ~60-120)
MAX_RECORD = 16 << 20  # a frame claiming more than this is corrupt, not big
SEGMENT_GLOB = "seg-*.kvl"


class LogError(Exception):
    """Base class for event-log errors."""


class CorruptLogError(LogError):
    """A record that is not a torn tail failed its checks: the log needs a human, not a silent skip."""

    def __init__(self, segment: Path, offset: int, reason: str) -> None:
        super().__init__(f"corrupt event log: {segment} at byte offset {offset}: {reason}")
        self.segment = segment
        self.offset = offset
        self.reason = reason


class TornTailWarning(UserWarning):
    """The last segment ended in a partial or corrupt record; it was (or would be) truncated."""


class FsyncMode(Choice):
    """When committed batches reach the disk."""

    ALWAYS = "always"  # every commit
    INTERVAL = "interval"  # at most every ``interval_ms``, by a background syncer
    NEVER = "never"  # leave it to the OS


def _fsync_mode(value: FsyncMode | str) -> FsyncMode:
    return FsyncMode.parse(value, "fsync mode")


def _interval_fits_mode(policy: FsyncPolicy, _attribute: attrs.Attribute[float], interval_ms: float) -> None:
    if interval_ms < 0 or interval_ms != interval_ms or (policy.mode is FsyncMode.INTERVAL and interval_ms == 0):
        raise ValueError(f"interval_ms must be positive under the interval fsync mode, got {interval_ms!r}")


@attrs.frozen
class FsyncPolicy:
    """When committed batches reach the disk: ``always`` (every commit), ``interval`` (at most every
    ``interval_ms``), or ``never`` (leave it to the OS). ``mode`` takes a :class:`FsyncMode` or its spelling."""

    mode: FsyncMode = attrs.field(default=FsyncMode.INTERVAL, converter=_fsync_mode)
    interval_ms: float = attrs.field(default=10.0, converter=float, validator=_interval_fits_mode)

    @classmethod
    def always(cls) -> FsyncPolicy:
        return cls(FsyncMode.ALWAYS, 0.0)

    @classmethod
    def every(cls, interval_ms: float) -> FsyncPolicy:
        return cls(FsyncMode.INTERVAL, float(interval_ms))

    @classmethod
    def never(cls) -> FsyncPolicy:
        return cls(FsyncMode.NEVER, 0.0)

    @classmethod
    def parse(cls, text: FsyncPolicy | str) -> FsyncPolicy:
        """``always`` | ``never`` | ``<N>ms`` (a policy passes through)."""
        if isinstance(text, FsyncPolicy):
            return text
        if text in ("always", "never"):
            return cls.always() if text == "always" else cls.never()
        if isinstance(text, str) and text.endswith("ms"):
            try:
                return cls.every(float(text[:-2]))
            except ValueError:
                pass
        raise ValueError(f"fsync policy must be 'always', 'never' or '<N>ms' (N > 0), got {text!r}")


@dataclass(frozen=True, slots=True)
class TailRecovery:
    segment: Path
    offset: int  # where the last good record ends
    dropped_bytes: int
    reason: str


@dataclass(frozen=True, slots=True)
class Record:
    segment: int  # segment index
    offset: int  # byte offset of the frame (the committed batch) holding the event
    index: int  # position of the event in the whole log (0-based)
    event: Event
    incarnation: int = 0  # the writing ledger's incarnation: a change marks a restart of the worker


_ARRAY_HEAD_MAX = 5  # bytes of the longest msgpack array header a batch starts with


def _array_head(n: int) -> bytes:
    """A msgpack array header: followed by ``n`` encoded elements it is the encoding of their list (no re-encoding)."""
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 65536 else b"\xdd" + n.to_bytes(4, "big")


def _frame(payload: bytes) -> bytes:
    return FRAME.pack(len(payload), _crc32(payload)) + payload


def _frame_ok(buf: memoryview, pos: int, end: int) -> int:
    """Length of the valid frame at ``pos`` or -1."""
    if pos + FRAME_SIZE > end:
        return -1
    length: int
    crc: int
    length, crc = FRAME.unpack_from(buf, pos)
    if length > MAX_RECORD or pos + FRAME_SIZE + length > end:
        return -1
    if length == 0 or _crc32(buf[pos + FRAME_SIZE : pos + FRAME_SIZE + length]) != crc:
        return -1
    return length


def _any_valid_frame_after(buf: memoryview, start: int, end: int) -> int:
    """Offset of a valid frame anywhere in ``[start, end)``, or -1: tells mid-log corruption from a torn tail."""
    for pos in range(start, end - FRAME_SIZE + 1):
        if _frame_ok(buf, pos, end) >= 0:
            return pos
    return -1


def segment_paths(directory: Path) -> list[Path]:
    return sorted(Path(directory).glob(SEGMENT_GLOB))


def _segment_index(path: Path) -> int:
    return int(path.stem.split("-")[1])


@dataclass
class SegmentScan:
    """One segment read in a single pass: its header and every good record, plus what (if anything) follows them."""

    path: Path
    header: LogHeader
    offsets: list[int]
    payloads: list[memoryview]
    good_end: int
    size: int
    tail_problem: str | None  # why the bytes after good_end are not records (None: clean)


def scan_segment(path: Path, *, is_last: bool) -> SegmentScan:
    """Read and verify a whole segment in one tight loop (replay speed lives here).

    Raises :class:`CorruptLogError` for corruption that is not a torn tail of the last segment.
    """
    data = path.read_bytes()
    size = len(data)
    buf = memoryview(data)
    if size == 0:
        if is_last:
            return SegmentScan(path, {}, [], [], 0, 0, "empty segment (crashed while creating it)")
        raise CorruptLogError(path, 0, "empty segment in the middle of the log")
    if size < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
        if is_last and size < len(MAGIC) and MAGIC.startswith(data):
            return SegmentScan(path, {}, [], [], 0, size, "torn segment magic")
        raise CorruptLogError(path, 0, "not a kvlifecycle log segment (bad magic)")
    pos = len(MAGIC)
    _refuse_oversized(path, buf, pos, size)
    length = _frame_ok(buf, pos, size)
    if length < 0:
        if is_last and _any_valid_frame_after(buf, pos + 1, size) < 0:
            return SegmentScan(path, {}, [], [], 0, size, "torn segment header")
        raise CorruptLogError(path, pos, "segment header failed its checksum")
    header = _decode_header(path, pos, buf[pos + FRAME_SIZE : pos + FRAME_SIZE + length])
    pos += FRAME_SIZE + length
    offsets: list[int] = []
    payloads: list[memoryview] = []
    add_offset, add_payload = offsets.append, payloads.append
    unpack_from = FRAME.unpack_from
    crc32 = zlib.crc32
    while pos < size:
        if pos + FRAME_SIZE > size:
            break
        length, crc = unpack_from(data, pos)
        start = pos + FRAME_SIZE
        if not 0 < length <= MAX_RECORD or start + length > size:
            break
        payload = buf[start : start + length]
        if crc32(payload, CRC_SEED) != crc:
            break
        add_offset(pos)
        add_payload(payload)
        pos = start + length
    if pos >= size:
        return SegmentScan(path, header, offsets, payloads, pos, size, None)
    _refuse_oversized(path, buf, pos, size)
    reason = _describe_bad_frame(buf, pos, size)
    if not is_last:
        raise CorruptLogError(path, pos, reason)
    after = _any_valid_frame_after(buf, pos + 1, size)
    if after >= 0:
        raise CorruptLogError(
            path, pos, f"{reason}; a valid record follows at offset {after}, so this is not a torn tail"
        )
    return SegmentScan(path, header, offsets, payloads, pos, size, reason)


def _refuse_oversized(path: Path, buf: memoryview, pos: int, size: int) -> None:
    """A frame whose length field is whole but beyond :data:`MAX_RECORD`: no writer made it, and a torn write keeps
    a prefix of what was written (a whole length field is the written one), so this is corruption wherever it is."""
    if pos + FRAME_SIZE <= size:
        length = FRAME.unpack_from(buf, pos)[0]
        if length > MAX_RECORD:
            raise CorruptLogError(
                path, pos, f"record length {length} exceeds the maximum record size {MAX_RECORD}: not a torn write"
            )


def _decode_header(path: Path, pos: int, payload: memoryview) -> LogHeader:
    """A segment header that passed its checksum: a map with this schema version and the fields the reader uses
    typed as the writer writes them, or :class:`CorruptLogError`."""
    try:
        header = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # deep nesting: msgspec raises RecursionError
        raise CorruptLogError(path, pos, f"segment header does not decode: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict) or header.get("schema") != SCHEMA_VERSION:
        found = header.get("schema") if isinstance(header, dict) else type(header).__name__
        raise CorruptLogError(path, pos, f"schema version {found!r} != {SCHEMA_VERSION}")
    for key in ("incarnation", "segment"):
        value = header.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int):
            raise CorruptLogError(path, pos, f"segment header's {key} is not an integer: {value!r}")
    return header


def _describe_bad_frame(buf: memoryview, pos: int, size: int) -> str:
    if pos + FRAME_SIZE > size:
        return f"partial frame header ({size - pos} of {FRAME_SIZE} bytes)"
    length, _ = FRAME.unpack_from(buf, pos)
    if length > MAX_RECORD:
        return f"implausible record length {length}"
    if pos + FRAME_SIZE + length > size:
        return f"record of {length} bytes runs past the end of the segment ({size - pos - FRAME_SIZE} left)"
    return "record checksum mismatch"


class LogReader:
    """Streams the events of a log directory in order. A torn tail of the last segment is reported in
    :attr:`tail` (the reader never modifies files); anything else corrupt raises :class:`CorruptLogError`."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise LogError(f"no event log at {self.directory} (not a directory)")
        self.segments = segment_paths(self.directory)
        if not self.segments:
            raise LogError(f"no event log segments (seg-*.kvl) in {self.directory}")
        self.header: LogHeader = {}
        self.tail: TailRecovery | None = None

    def scans(self) -> Iterator[SegmentScan]:
        """Each segment, verified, in order; a torn tail of the last one lands in :attr:`tail`."""
        last = len(self.segments) - 1
        for i, path in enumerate(self.segments):
            scan = scan_segment(path, is_last=i == last)
            if scan.header and not self.header:
                self.header = scan.header
            if scan.tail_problem is not None:
                self.tail = TailRecovery(path, scan.good_end, scan.size - scan.good_end, scan.tail_problem)
            yield scan

    def records(self) -> Iterator[Record]:
        index = 0
        for scan in self.scans():
            seg_index = _segment_index(scan.path)
            incarnation = int(scan.header.get("incarnation", 0))
            for offset, batch in decode_frames(scan):
                for event in batch:
                    yield Record(seg_index, offset, index, event, incarnation)
                    index += 1

    def __iter__(self) -> Iterator[Event]:
        for scan in self.scans():
            yield from decode_payloads(scan)

    def read_header(self) -> LogHeader:
        scan = scan_segment(self.segments[0], is_last=len(self.segments) == 1)
        if not scan.header:
            raise LogError(f"{self.segments[0]} has no readable header")
        self.header = scan.header
        return scan.header


def decode_frames(scan: SegmentScan) -> list[tuple[int, list[AnyEvent]]]:
    """Each frame's events, with the frame's offset; a frame that passes its checksum but does not decode is
    corruption too."""
    out: list[tuple[int, list[AnyEvent]]] = []
    for offset, payload in zip(scan.offsets, scan.payloads, strict=True):
        try:
            out.append((offset, BATCH_DECODER.decode(payload)))
        except (msgspec.DecodeError, RecursionError) as exc:
            raise CorruptLogError(scan.path, offset, f"record does not decode: {type(exc).__name__}: {exc}") from None
    return out


def decode_payloads(scan: SegmentScan) -> list[Event]:
    """A segment's events, in order."""
    events: list[Event] = []
    for _, batch in decode_frames(scan):
        events += batch
    return events


def _all_encoded(pending: list[bytes | Event]) -> TypeGuard[list[bytes]]:
    """Whether a batch holds encoded events only (events appended by ``append_events`` wait unencoded)."""
    return all(p.__class__ is bytes for p in pending)


SYNC_BACKOFF_MAX_S = 1.0  # the syncer retries a failing disk at most this far apart


def _sync_every_interval(ref: weakref.ref[EventLog], stop: threading.Event, interval_s: float) -> None:
    """The syncer thread of an ``interval`` log: ends at close, or when the log was dropped. It never dies of an
    error: each one is counted and reported by the log (:meth:`EventLog._failed`), and the round is retried with a
    doubling delay up to :data:`SYNC_BACKOFF_MAX_S`."""
    delay = interval_s
    while not stop.wait(delay):
        log = ref()
        if log is None:
            return
        try:
            if not log._sync_once():
                return
            delay = interval_s
        except LogWriteError:  # counted and reported where it happened; the disk gets time before the next try
            delay = min(max(delay * 2, interval_s), max(SYNC_BACKOFF_MAX_S, interval_s))
        except LogError as exc:  # a named problem with some records (unencodable): the rest was written
            warnings.warn(str(exc), RuntimeWarning, stacklevel=1)
            delay = interval_s
        except Exception as exc:  # the syncer outlives every error, a bug included; each one is reported
            log._report_unexpected(exc)
            delay = min(max(delay * 2, interval_s), max(SYNC_BACKOFF_MAX_S, interval_s))
        del log  # no strong reference while waiting


def read_events(directory: str | os.PathLike[str]) -> list[Event]:
    return list(LogReader(directory))


class LogWriteError(LogError):
    """The log could not write or fsync its records (a full disk, an I/O error, a short write). Nothing partial is
    left in the segment; the records stay in memory and are written, whole, by a later commit, flush or syncer round.
    :attr:`errno` is the operating system's error number."""

    def __init__(self, directory: Path, what: str, cause: BaseException) -> None:
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause) or type(cause).__name__
        super().__init__(f"event log {directory} cannot be written: {what} failed: {reason}; "
                         f"the records stay pending and are written once the disk allows")
        self.directory = directory
        self.errno: int | None = cause.errno if isinstance(cause, OSError) else None
        self.__cause__ = cause


class LogFullError(LogError):
    """Backpressure: the log cannot be written and holds as much pending as it may, so a command is refused before
    it changes anything (nothing applied is ever missing from the log)."""

    def __init__(self, directory: Path, held_bytes: int, bound: int, last: LogWriteError | None) -> None:
        why = str(last) if last is not None else "records are not being written"
        super().__init__(f"event log {directory} cannot take more records: {held_bytes} bytes wait unwritten "
                         f"(bound {bound}); command refused before it changed anything ({why})")
        self.directory = directory
        self.errno: int | None = last.errno if last is not None else None


class LogLockedError(LogError):
    """Another writer holds the log directory (one writer per directory)."""

    def __init__(self, directory: Path, holder: str) -> None:
        super().__init__(f"event log {directory} is in use by another writer ({holder}); one writer per directory")
        self.directory = directory
        self.holder = holder


class LogFiles:
    """The writer's file operations, one method per system call: the seam where the simulator injects storage faults
    (ENOSPC, EIO, short writes, failed fsyncs). The default is the operating system's."""

    def write(self, fd: int, data: memoryview) -> int:
        return os.write(fd, data)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)


OS_FILES = LogFiles()
DEFAULT_MAX_PENDING_BYTES = 64 << 20  # records held unwritten while the disk refuses them; past it, backpressure

_log = logging.getLogger("kvlifecycle.eventlog")
_log.addHandler(logging.NullHandler())  # a library prints nothing unless the application configures logging


class EventLog:
    """Appends events to segment files with group commit. One writer per directory (an OS lock,
    :class:`~kvlifecycle.log_lock.WriterLock`, taken before anything in the directory is read or cut).

    ``append`` only adds to an in-memory batch (no I/O on the hot path; a write only once the batch grows past
    ``batch_bytes``, never an fsync except under ``always``). The batch is written on :meth:`commit` (once per
    scheduler step) and :meth:`close`; under ``interval`` a background syncer writes and fsyncs it every interval,
    so an appended event is durable within about one interval whether or not the caller commits, and the fsync
    runs outside the lock appends take (a forward thread never waits for a disk flush).

    Storage faults (the durability contract in docs/design.md): a write that fails cuts the segment back to its last
    whole frame and keeps the batch pending; a failed fsync cuts back to the last synced size and writes those frames
    again (the kernel may have dropped their pages); ``append`` never raises an I/O error (the command did apply),
    :meth:`commit` and :meth:`flush` raise :class:`LogWriteError`; past ``max_pending_bytes`` held unwritten (and,
    under ``always``, as soon as a write failed) :meth:`admit` refuses new commands with :class:`LogFullError`.
    ``files`` is the seam for the file operations (the simulator's faulty disk); ``background_sync=False`` starts no
    syncer thread under ``interval``: the owner calls :meth:`sync_round` instead.
    """

    warn_on_failure = True  # a RuntimeWarning per reported failure, beside the log line (a simulation turns it off)

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        header: LogHeader | None = None,
        fsync: FsyncPolicy | str = FsyncPolicy(),
        segment_bytes: int = 64 << 20,
        batch_bytes: int = 256 << 10,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        files: LogFiles = OS_FILES,
        background_sync: bool = True,
    ) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.policy = FsyncPolicy.parse(fsync)
        self.segment_bytes = segment_bytes
        self.batch_bytes = min(batch_bytes, MAX_RECORD // 2)
        if max_pending_bytes < self.batch_bytes:
            raise ValueError(f"max_pending_bytes ({max_pending_bytes}) must be at least batch_bytes ({batch_bytes})")
        self.max_pending_bytes = max_pending_bytes
        self.header = {"schema": SCHEMA_VERSION, **(header or {})}
        self.recovered: TailRecovery | None = None
        self.files = files
        self.write_failures = 0  # write and fsync failures so far (each one reported)
        self.write_error: LogWriteError | None = None  # the last failure, until records are written again
        self._lock = threading.Lock()
        self._pending: list[bytes | Event] = []  # the batch being built: encoded events, or events (append_events)
        self._pending_bytes = 0
        # Frames written since the last good fsync (not under ``never``): after a failed fsync they are cut off and
        # written again, into ``_rewrite``, since the kernel may have dropped their pages.
        self._unsynced_frames: list[bytes] = []
        self._rewrite: list[bytes] = []
        self._rewrite_bytes = 0
        self._keep_unsynced = self.policy.mode is not FsyncMode.NEVER
        self._synced_size = 0
        self._sync_failure: OSError | None = None  # set under _sync_lock by the syncer; handled under _lock
        self._broken: LogWriteError | None = None  # a failed write could not be cut back: nothing is written again
        self._fh: Any = None
        self._segment_size = 0
        self._last_sync = time.monotonic()
        self._unsynced = False
        self._sync_each = self.policy.mode is FsyncMode.ALWAYS
        self._interval_s = self.policy.interval_ms / 1000.0 if self.policy.mode is FsyncMode.INTERVAL else float("inf")
        # Serialises an fsync with segment rotation and close (the syncer holds it, never together with _lock).
        self._sync_lock = threading.Lock()
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        self.appended = 0
        self._closed = False
        try:  # first: nothing in the directory is read or cut while another writer may be appending to it
            self._writer_lock: WriterLock | None = WriterLock(self.directory)
        except LockHeld as held:
            raise LogLockedError(self.directory, held.holder) from None
        try:
            existing = segment_paths(self.directory)
            self._next_segment = _segment_index(existing[-1]) + 1 if existing else 0
            if existing:
                self._recover(existing)
            try:
                self._fh, self.path = self._create_segment()
            except OSError as exc:
                raise LogWriteError(self.directory, "creating a segment", exc) from exc
        except BaseException:
            self._writer_lock.release()
            raise
        if self.policy.mode is FsyncMode.INTERVAL and background_sync:
            # a weak reference: a log dropped without close() is collected, and its syncer ends with it
            self._syncer = threading.Thread(target=_sync_every_interval, args=(weakref.ref(self), self._stop,
                                                                                self._interval_s),
                                            daemon=True, name=f"kvl-log-sync-{self.directory.name}")
            self._syncer.start()

    # -- recovery -------------------------------------------------------------------------------------------------
    def _recover(self, existing: list[Path]) -> None:
        for i, path in enumerate(existing):
            scan = scan_segment(path, is_last=i == len(existing) - 1)
            if i == 0 and scan.header:
                self._check_header_compatible(path, scan.header)
            if scan.tail_problem is None:
                continue
            good_end, size, problem = scan.good_end, scan.size, scan.tail_problem
            del scan  # drop the views into the file's bytes before touching the file
            self.recovered = TailRecovery(path, good_end, size - good_end, problem)
            warnings.warn(
                f"event log {path}: {problem} at offset {good_end}; "
                f"truncated {size - good_end} bytes, every record before it is kept",
                TornTailWarning,
                stacklevel=3,
            )
            if good_end == 0:  # not even a whole header survived: the segment holds nothing
                path.unlink()
                continue
            with open(path, "r+b") as fh:
                fh.truncate(good_end)
                os.fsync(fh.fileno())

    def adopt_header(self, header: LogHeader) -> None:
        """Give a log opened without a ledger's header (``EventLog(dir)``) the header of the ledger it is handed to,
        so that it replays on its own: the fresh segment is written again with ``header``. A log that already names
        a side must agree with ``header`` on side, worker and pool size; one that holds records already, or a
        directory whose older segments belong to another ledger, is refused with :class:`LogError`."""
        with self._sync_lock, self._lock:
            if "side" in self.header:
                for key in ("side", "worker", "num_blocks"):
                    if key in header and key in self.header and self.header[key] != header[key]:
                        raise LogError(
                            f"{self.directory}: log was opened for {key}={self.header[key]!r}, "
                            f"the ledger it is given to has {key}={header[key]!r}"
                        )
                return
            if self.appended or self._pending or self._closed or self._broken is not None:
                raise LogError(
                    f"{self.directory}: log holds records without a ledger's header and cannot replay; open it "
                    "through open_ledger(side, num_blocks, log_dir) or hand it to the ledger before appending"
                )
            merged: LogHeader = {"schema": SCHEMA_VERSION, **header}
            older = [p for p in segment_paths(self.directory) if p != self.path]
            if older:
                found = scan_segment(older[0], is_last=False).header
                for key in ("side", "worker", "num_blocks"):
                    if key in found and found[key] != merged.get(key):
                        raise LogError(
                            f"{older[0]}: log belongs to {key}={found[key]!r}, refusing to append as "
                            f"{key}={merged.get(key)!r}"
                        )
            self._fh.close()
            self.path.unlink()
            self._next_segment -= 1
            self.header = merged
            try:
                self._fh, self.path = self._create_segment()
            except OSError as exc:
                raise LogWriteError(self.directory, "creating a segment", exc) from exc

    def _check_header_compatible(self, path: Path, found: LogHeader) -> None:
        for key in ("side", "worker", "num_blocks"):
            if key in self.header and key in found and self.header[key] != found[key]:
                raise LogError(
                    f"{path}: log belongs to {key}={found[key]!r}, refusing to append as {key}={self.header[key]!r}"
                )

    # -- writing --------------------------------------------------------------------------------------------------
    def _create_segment(self) -> tuple[Any, Path]:
        """A new segment with its header written and synced; on a failure the file is removed (a segment that
        never got its header must not sit between whole ones) and the OSError raised."""
        path = self.directory / f"seg-{self._next_segment:08d}.kvl"
        fh = open(path, "xb", buffering=0)  # noqa: SIM115 - held open for the writer's lifetime
        head = MAGIC + _frame(msgspec.msgpack.encode({**self.header, "segment": self._next_segment}))
        try:
            self._write_all(fh.fileno(), head)
            if self.policy.mode is not FsyncMode.NEVER:
                self.files.fsync(fh.fileno())
        except BaseException:
            fh.close()
            path.unlink(missing_ok=True)
            raise
        self._next_segment += 1
        self._segment_size = self._synced_size = len(head)
        self._unsynced_frames = []
        self._unsynced = False
        self._last_sync = time.monotonic()
        return fh, path

    def admit(self) -> None:
        """Refuse a command before it changes anything when the log cannot take its record: more than
        ``max_pending_bytes`` wait unwritten, or (under ``always``) the last write failed. One write is tried first
        (I/O only on this failure path), so a disk that came back admits at once. Raises :class:`LogFullError`."""
        if self._pending_bytes + self._rewrite_bytes < self.max_pending_bytes and (
            self.write_error is None or not self._sync_each
        ):
            return
        with self._lock:
            if self._closed:
                raise LogError(f"append to a closed event log ({self.directory})")
            with contextlib.suppress(LogWriteError):  # counted and reported by _failed
                self._persist(sync=self._sync_each)
            held = self._pending_bytes + self._rewrite_bytes
            if held < self.max_pending_bytes and (self.write_error is None or not self._sync_each):
                return
            raise LogFullError(self.directory, held, self.max_pending_bytes, self.write_error)

    def append(self, event: Event) -> None:
        self.append_payload(encode(event))

    def append_payload(self, payload: bytes) -> None:
        """Add one encoded event to the batch being built (no I/O unless the batch is due). Never raises an I/O
        error: a write that fails keeps the batch pending, and :meth:`commit` reports it."""
        with self._lock:
            if self._closed:
                raise LogError("append to a closed event log")
            self._pending.append(payload)
            self._pending_bytes += len(payload)
            self.appended += 1
            if self._sync_each:
                self._persist_quietly(sync=True)
            elif self._pending_bytes >= self.batch_bytes:
                self._persist_quietly(sync=False)  # bounds memory; the syncer (interval) or close makes it durable

    def append_events(self, events: list[Event]) -> None:
        """Add events to the batch as they are: they are encoded when the batch is written (commit, the syncer),
        so a caller that appends at the end of a latency-critical step pays a list extend, not the encoding."""
        with self._lock:
            if self._closed:
                raise LogError("append to a closed event log")
            self._pending.extend(events)
            self._pending_bytes += EVENT_SIZE_ESTIMATE * len(events)
            self.appended += len(events)
            if self._sync_each:
                self._persist_quietly(sync=True)
            elif self._pending_bytes >= self.batch_bytes:
                self._persist_quietly(sync=False)

    def commit(self) -> None:
        """Write the batch (a group-commit boundary: once per scheduler step). ``always`` has synced every event
        already (a batch a failure left pending is written and synced here); under ``interval`` the syncer fsyncs
        within the interval, off the caller's thread. Raises :class:`LogWriteError` when the records cannot be
        written (they stay pending)."""
        with self._lock:
            self._persist(sync=self._sync_each)

    def flush(self) -> None:
        """Write and fsync now, whatever the policy (``never`` excepted: written, not synced). Raises
        :class:`LogWriteError` when that fails; everything it did not write stays pending."""
        with self._lock:
            self._persist(sync=self.policy.mode is not FsyncMode.NEVER)

    def sync_round(self) -> bool:
        """One round of the ``interval`` syncer, on the caller's thread: for a log opened with
        ``background_sync=False`` (a deterministic simulation drives the rounds). False once the log is closed."""
        return self._sync_once()

    def _sync_once(self) -> bool:
        """One round of the syncer (``interval``): write what is pending, then fsync outside ``_lock``. False once
        the log is closed; raises :class:`LogWriteError` on a failure (the syncer reports it and backs off)."""
        with self._lock:
            if self._closed:
                return False
            self._persist(sync=False)
            if not self._unsynced:
                return True
            fh, synced_to, frames = self._fh, self._segment_size, len(self._unsynced_frames)
            last_covered = self._unsynced_frames[-1] if frames else None
        failed: OSError | None = None
        with self._sync_lock:  # never take _lock while holding this (rotation takes them the other way round)
            if fh.closed:  # rotated or closed meanwhile: that synced it
                return True
            try:
                self.files.fsync(fh.fileno())
            except OSError as exc:
                failed = self._sync_failure = exc  # seen by every later write and sync before they trust the file
        with self._lock:
            if failed is not None:
                raise self._failed("fsync", failed)
            unchanged = frames <= len(self._unsynced_frames) and (
                not frames or self._unsynced_frames[frames - 1] is last_covered
            )  # a flush meanwhile may have synced (and dropped) them already
            if fh is self._fh and self._sync_failure is None and unchanged:
                self._synced_size = max(self._synced_size, synced_to)
                del self._unsynced_frames[:frames]
                self._unsynced = bool(self._unsynced_frames)
                self._last_sync = time.monotonic()
        return True

    def _persist_quietly(self, *, sync: bool) -> None:
        with contextlib.suppress(LogWriteError):  # counted and reported by _failed; the records stay pending
            self._persist(sync=sync)

    def _persist(self, *, sync: bool) -> None:
        """Write what waits (frames a failed fsync cut off, then the batch) and fsync if asked, under ``_lock``.
        Raises :class:`LogWriteError` on a failure, after the segment was cut back to its last whole frame."""
        if self._broken is not None:
            raise self._broken
        stage = "cutting back frames a failed fsync left unsynced"
        try:
            if self._sync_failure is not None:
                self._cut_back_unsynced()
            stage = "write"
            if self._rewrite:
                self._write_rewrite()
            self._write_batch()
            stage = "fsync"
            if sync and (self._unsynced or self._sync_failure is not None):
                self._sync()
        except OSError as exc:
            raise self._failed(stage, exc) from exc
        if self.write_error is not None:
            _log.warning("event log %s is written again after %d failure(s)", self.directory, self.write_failures)
            self.write_error = None

    def _failed(self, what: str, exc: OSError) -> LogWriteError:
        """Count and report a failure; the error :meth:`commit` raises."""
        error = LogWriteError(self.directory, what, exc)
        self.write_failures += 1
        if self.write_error is None or self.write_failures & (self.write_failures - 1) == 0:  # rate-limited: 1,2,4,...
            _log.error("event_log_write_failed directory=%s what=%s errno=%s failures=%d pending_bytes=%d",
                       self.directory, what, error.errno, self.write_failures,
                       self._pending_bytes + self._rewrite_bytes)
            if self.warn_on_failure:  # also where no logging is configured
                warnings.warn(str(error), RuntimeWarning, stacklevel=3)
        self.write_error = error
        for listener in _WRITE_FAILURE_LISTENERS:
            listener(self, error)
        return error

    def _report_unexpected(self, exc: BaseException) -> None:
        """The syncer met something that is not a write failure (a bug): counted and logged, never fatal."""
        self.write_failures += 1
        _log.error("event_log_syncer_error directory=%s error=%r", self.directory, exc, exc_info=exc)

    def _cut_back_unsynced(self) -> None:
        """After a failed fsync: cut the segment back to its last synced size and queue the frames written since
        to be written again (new dirty pages a later fsync covers). PostgreSQL's lesson: a failed fsync may have
        dropped those pages, and a retried fsync can succeed without them."""
        fd = self._fh.fileno()
        self.files.truncate(fd, self._synced_size)
        os.lseek(fd, self._synced_size, os.SEEK_SET)
        self._segment_size = self._synced_size
        again = self._unsynced_frames
        self._rewrite[:0] = again
        self._rewrite_bytes += sum(len(f) for f in again)
        self._unsynced_frames = []
        self._unsynced = False
        self._sync_failure = None

    def _write_rewrite(self) -> None:
        while self._rewrite:
            frame = self._rewrite[0]
            self._write_framed(frame)
            del self._rewrite[0]
            self._rewrite_bytes -= len(frame)

    def _write_batch(self) -> None:
        pending = self._pending
        if not pending:
            return
        unencodable: list[str] = []
        if _all_encoded(pending):
            encoded = pending
        else:  # events appended unencoded (append_events): the batch is kept encoded for a retry
            encoded = self._encode_pending(pending, unencodable)
            self._pending = [*encoded]
            self._pending_bytes = sum(len(e) for e in encoded)
        why = (f"event log {self.directory}: {len(unencodable)} event(s) could not be encoded and were not written: "
               f"{'; '.join(unencodable[:3])}") if unencodable else ""
        try:
            if encoded:
                self._write_encoded(encoded)
        except OSError as exc:  # the encoded batch stays pending for the next try
            if why and sys.version_info >= (3, 11):
                exc.add_note(why)
            elif why:  # no exception notes before Python 3.11
                warnings.warn(why, RuntimeWarning, stacklevel=3)
            raise
        if why:  # the rest of the batch is written; these could not be, and are named
            raise LogError(why)

    @staticmethod
    def _encode_pending(pending: list[bytes | Event], unencodable: list[str]) -> list[bytes]:
        out: list[bytes] = []
        for p in pending:
            if isinstance(p, bytes):
                out.append(p)
                continue
            try:
                out.append(encode(p))
            except (TypeError, ValueError, OverflowError) as exc:
                unencodable.append(f"{p!r}: {exc}")
        return out

    def _write_encoded(self, pending: list[bytes]) -> None:
        body = b"".join(pending)
        if len(body) + _ARRAY_HEAD_MAX <= MAX_RECORD:
            self._write_frame(_array_head(len(pending)) + body)
        else:  # a batch beyond the maximum record goes as several (a reader calls a longer frame corrupt)
            self._write_split(pending)
        self._pending = []  # only once written: a failed write keeps the batch for the next try
        self._pending_bytes = 0

    def _write_split(self, pending: list[bytes]) -> None:
        start = 0
        while start < len(pending):
            end, size = start, 0
            while end < len(pending) and size + len(pending[end]) + _ARRAY_HEAD_MAX <= MAX_RECORD:
                size += len(pending[end])
                end += 1
            if end == start:  # one event larger than a record: it cannot be written, and is named
                self._pending = [*pending[start + 1 :]]
                self._pending_bytes = sum(len(p) for p in pending[start + 1 :])
                raise LogError(f"event log {self.directory}: an event of {len(pending[start])} bytes exceeds the "
                               f"maximum record size {MAX_RECORD} and was not written")
            self._write_frame(_array_head(end - start) + b"".join(pending[start:end]))
            self._pending = [*pending[end:]]  # what is written is never written again, even if a later frame fails
            self._pending_bytes = sum(len(p) for p in pending[end:])
            start = end

    def _write_frame(self, payload: bytes) -> None:
        self._write_framed(_pack_frame(len(payload), _crc32(payload)) + payload)

    def _write_framed(self, frame: bytes) -> None:
        """Write one whole frame, or nothing: on any failure (ENOSPC, EIO, a short write) the segment is cut back to
        where the frame began before the error goes on, so a later write never follows a partial frame."""
        if self._segment_size + len(frame) > self.segment_bytes and self._segment_size > 64:
            self._rotate()
        start = self._segment_size
        fd = self._fh.fileno()
        try:
            self._write_all(fd, frame)
        except BaseException:
            self._cut_back(fd, start)
            raise
        self._segment_size = start + len(frame)
        self._unsynced = True
        if self._keep_unsynced:
            self._unsynced_frames.append(frame)

    def _cut_back(self, fd: int, size: int) -> None:
        """Truncate the segment to ``size`` (the end of its last whole frame) and write from there on. A failure here
        is the one fault the log cannot undo: the log writes nothing more, and every command is refused (it needs a
        human: the segment may end in a partial frame, which a restart's recovery cuts off as a torn tail)."""
        try:
            self.files.truncate(fd, size)
            os.lseek(fd, size, os.SEEK_SET)
        except OSError as exc:
            self._broken = LogWriteError(self.directory, f"cutting a failed write back to offset {size} of "
                                         f"{self.path}", exc)
            self.max_pending_bytes = 0  # admit() refuses every command from now on
            raise self._broken from exc

    def _write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        done = 0
        while done < len(view):  # bounded: every round writes at least one byte or raises
            n = self.files.write(fd, view[done:])
            if n <= 0:
                raise OSError(errno.EIO, f"write made no progress at {done} of {len(view)} bytes")
            done += n

    def _rotate(self) -> None:
        """Close the full segment and open the next: the old one is synced first, the new one must be whole (header
        written and synced) before the old one is let go; any failure leaves the old one current."""
        with self._sync_lock:  # never close a segment under the syncer's fsync
            self._sync()
            fh, path = self._create_segment()
            self._fh.close()
            self._fh, self.path = fh, path

    def _sync(self) -> None:
        """fsync the current segment (except under ``never``). After a failure the next write cuts the unsynced
        frames off and writes them again before anything is trusted to the disk."""
        if self._sync_failure is not None:
            raise OSError(errno.EIO, "an earlier fsync of this segment failed; its unsynced frames are written again")
        if self.policy.mode is not FsyncMode.NEVER:
            try:
                self.files.fsync(self._fh.fileno())
            except OSError as exc:
                self._sync_failure = exc
                raise
        self._synced_size = self._segment_size
        self._unsynced_frames.clear()
        self._last_sync = time.monotonic()
        self._unsynced = False

    def close(self) -> None:
        """Write and sync what waits, close the segment and let the directory go. Raises :class:`LogWriteError`
        (after closing) when records could not be written: they are lost with the writer, and counted in it."""
        self._stop.set()
        syncer, self._syncer = self._syncer, None
        if syncer is not None and syncer is not threading.current_thread():
            syncer.join(10.0)  # bounded: it wakes at once (stop is set) and finishes at most one fsync
        failure: LogWriteError | None = None
        with self._lock:
            if self._closed and self._fh is None:
                return
            if not self._closed:
                try:
                    self._persist(sync=True)
                except LogWriteError as exc:
                    failure = exc
            with self._sync_lock:
                if self._fh is not None:
                    self._fh.close()
                    self._fh = None
            self._closed = True
            if self._writer_lock is not None:
                self._writer_lock.release()
            if failure is not None:
                lost = len(self._pending) + len(self._rewrite)
                raise LogWriteError(self.directory, f"closing with {lost} record(s) unwritten", failure.__cause__
                                    or failure) from failure

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


WriteFailureListener = Callable[[EventLog, LogWriteError], None]
_WRITE_FAILURE_LISTENERS: list[WriteFailureListener] = []


def on_write_failure(listener: WriteFailureListener) -> Callable[[], None]:
    """Call ``listener(log, error)`` on every write or fsync failure of any log in this process (telemetry hooks in
    here); returns a function that removes it."""
    _WRITE_FAILURE_LISTENERS.append(listener)

    def remove() -> None:
        if listener in _WRITE_FAILURE_LISTENERS:
            _WRITE_FAILURE_LISTENERS.remove(listener)

    return remove
