"""Event log: framing, group commit, rotation, streaming reads, and crash safety."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvlifecycle import events as ev
from kvlifecycle.eventlog import (
    MAGIC,
    CorruptLogError,
    EventLog,
    FsyncPolicy,
    LogError,
    LogReader,
    TornTailWarning,
    read_events,
    segment_paths,
)


def make_events(n: int) -> list[ev.Event]:
    out: list[ev.Event] = []
    for i in range(n):
        if i % 3 == 0:
            out.append(ev.SrcAllocated(i, float(i), f"r{i}", ev.pack_blocks(np.arange(i % 7, dtype=np.int32))))
        elif i % 3 == 1:
            out.append(ev.SrcPrefillDone(i, float(i), f"r{i - 1}"))
        else:
            out.append(ev.Refused(i, float(i), "consumer_done", "stale token: test", f"r{i}", f"t{i}"))
    return out


def write_log(path: Path, events: list[ev.Event], **kwargs) -> Path:
    with EventLog(path, header={"side": "source", "worker": "p0", "num_blocks": 8}, **kwargs) as log:
        for e in events:
            log.append(e)
    return path


@pytest.mark.parametrize("policy", ["always", "never", "5ms"])
def test_round_trip_under_every_fsync_policy(tmp_path: Path, policy: str) -> None:
    events = make_events(50)
    write_log(tmp_path / "log", events, fsync=policy)
    assert read_events(tmp_path / "log") == events


def test_rotation_streams_across_segments_in_order(tmp_path: Path) -> None:
    events = make_events(500)
    write_log(tmp_path / "log", events, segment_bytes=2048, batch_bytes=256)
    segments = segment_paths(tmp_path / "log")
    assert len(segments) > 3
    records = list(LogReader(tmp_path / "log").records())
    assert [r.event for r in records] == events
    assert [r.index for r in records] == list(range(500))
    assert sorted({r.segment for r in records}) == list(range(len(segments)))


def test_reopen_appends_in_a_new_segment_and_refuses_a_foreign_log(tmp_path: Path) -> None:
    first, second = make_events(10), make_events(5)
    write_log(tmp_path / "log", first)
    write_log(tmp_path / "log", second)
    assert read_events(tmp_path / "log") == first + second
    with pytest.raises(LogError, match="side"):
        EventLog(tmp_path / "log", header={"side": "target", "worker": "p0", "num_blocks": 8})


def test_commit_makes_events_visible_to_a_reader_before_close(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync=FsyncPolicy.never())
    events = make_events(3)
    for e in events:
        log.append(e)
    log.commit()
    assert read_events(tmp_path / "log") == events
    log.close()
    with pytest.raises(LogError, match="closed"):
        log.append(events[0])


def _single_segment(tmp_path: Path, n: int = 6) -> tuple[Path, list[ev.Event], list[int]]:
    events = make_events(n)
    write_log(tmp_path / "log", events, fsync="always")  # one frame per event: every record is its own unit
    records = list(LogReader(tmp_path / "log").records())
    segment = segment_paths(tmp_path / "log")[0]
    ends = [r.offset for r in records[1:]] + [segment.stat().st_size]
    return segment, events, ends


def test_truncation_at_every_byte_offset_recovers_exactly_the_whole_records(tmp_path: Path) -> None:
    segment, events, ends = _single_segment(tmp_path)
    original = segment.read_bytes()
    first_record = next(iter(LogReader(tmp_path / "log").records())).offset
    for cut in range(len(original)):
        case = tmp_path / f"cut{cut}"
        case.mkdir()
        (case / segment.name).write_bytes(original[:cut])
        whole = sum(1 for end in ends if end <= cut) if cut >= first_record else 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            log = EventLog(case, header={"side": "source", "worker": "p0", "num_blocks": 8})
            log.close()
        torn = cut not in ends and cut != first_record
        assert any(issubclass(w.category, TornTailWarning) for w in caught) == torn, cut
        if torn:
            assert log.recovered is not None and log.recovered.segment.name == segment.name
        got = read_events(case)
        assert got == events[:whole], cut
        shutil.rmtree(case)


def test_flipping_a_byte_in_the_last_record_truncates_only_that_record(tmp_path: Path) -> None:
    segment, events, ends = _single_segment(tmp_path)
    original = bytearray(segment.read_bytes())
    last_start = ends[-2]
    for pos in range(last_start, len(original)):
        damaged = bytearray(original)
        damaged[pos] ^= 0xFF
        segment.write_bytes(bytes(damaged))
        reader = LogReader(tmp_path / "log")
        if pos == last_start + 3:  # the length's high byte: beyond the maximum record, which no torn write makes
            with pytest.raises(CorruptLogError, match="exceeds the maximum record size") as info:
                list(reader)
            assert info.value.offset == last_start
            continue
        assert list(reader) == events[:-1], pos
        assert reader.tail is not None and reader.tail.offset == last_start
    segment.write_bytes(bytes(original))


def test_flipping_a_byte_in_the_middle_is_an_error_naming_segment_and_offset(tmp_path: Path) -> None:
    segment, _, ends = _single_segment(tmp_path)
    original = bytearray(segment.read_bytes())
    header_end = next(iter(LogReader(tmp_path / "log").records())).offset
    for pos in range(len(MAGIC), ends[-2]):
        damaged = bytearray(original)
        damaged[pos] ^= 0x5A
        segment.write_bytes(bytes(damaged))
        with pytest.raises(CorruptLogError) as info:
            list(LogReader(tmp_path / "log"))
        assert info.value.segment == segment, pos
        assert str(segment) in str(info.value)
        # the offset named is the frame the flipped byte lives in
        frame_starts = [len(MAGIC), header_end, *ends[:-1]]
        expected = max(s for s in frame_starts if s <= pos)
        assert info.value.offset == expected, pos
        # and opening for append refuses too, rather than truncating good records away
        with pytest.raises(CorruptLogError):
            EventLog(tmp_path / "log", header={"side": "source"})
        assert segment.read_bytes() == bytes(damaged), "a refused open must not modify the log"
    segment.write_bytes(bytes(original))


def test_corruption_in_an_earlier_segment_is_an_error_even_at_its_end(tmp_path: Path) -> None:
    write_log(tmp_path / "log", make_events(200), segment_bytes=2048, batch_bytes=256)
    first = segment_paths(tmp_path / "log")[0]
    data = bytearray(first.read_bytes())
    data[-1] ^= 0xFF
    first.write_bytes(bytes(data))
    with pytest.raises(CorruptLogError, match=first.name):
        list(LogReader(tmp_path / "log"))


def test_not_a_log(tmp_path: Path) -> None:
    with pytest.raises(LogError, match="no event log"):
        LogReader(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LogError, match="no event log segments"):
        LogReader(tmp_path / "empty")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "seg-00000000.kvl").write_bytes(b"hello world, not a log at all" * 4)
    with pytest.raises(CorruptLogError, match="bad magic"):
        list(LogReader(tmp_path / "junk"))


def test_fsync_policy_parse() -> None:
    assert FsyncPolicy.parse("always").mode == "always"
    assert FsyncPolicy.parse("never").mode == "never"
    assert FsyncPolicy.parse("25ms") == FsyncPolicy("interval", 25.0)
    with pytest.raises(ValueError, match="fsync policy"):
        FsyncPolicy.parse("sometimes")


def test_a_committed_batch_is_one_frame_and_survives_or_goes_whole(tmp_path: Path) -> None:
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="never")
    first, second = make_events(5), make_events(7)
    for e in first:
        log.append(e)
    log.commit()
    for e in second:
        log.append(e)
    log.commit()
    log.close()
    records = list(LogReader(tmp_path / "log").records())
    assert len({r.offset for r in records}) == 2  # two commits, two frames
    segment = segment_paths(tmp_path / "log")[0]
    data = segment.read_bytes()
    segment.write_bytes(data[:-3])  # a crash while writing the second batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TornTailWarning)
        EventLog(tmp_path / "log", header={"side": "source"}).close()
    assert read_events(tmp_path / "log") == first


def test_append_does_no_io_until_commit_under_a_long_interval(tmp_path: Path) -> None:
    """The hot path never writes or fsyncs: under ``interval`` only commit (or the syncer) writes the batch."""
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="3600000ms")
    seg = segment_paths(tmp_path / "log")[0]
    header_only = seg.stat().st_size
    events = make_events(20)
    for e in events:
        log.append(e)
    assert seg.stat().st_size == header_only  # nothing written by appends
    log.commit()
    assert seg.stat().st_size > header_only and read_events(tmp_path / "log") == events
    log.close()


@pytest.mark.parametrize("policy", ["always", "3600000ms"])
def test_events_appended_unencoded_keep_their_place_among_encoded_ones(tmp_path: Path, policy: str) -> None:
    """``append_events`` (a ledger step's end) defers the encoding to the write; order and bytes are unchanged."""
    events = make_events(30)
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync=policy)
    seg = segment_paths(tmp_path / "log")[0]
    header_only = seg.stat().st_size
    log.append(events[0])
    log.append_events(events[1:20])
    log.append(events[20])
    log.append_events(events[21:])
    assert log.appended == 30
    if policy != "always":
        assert seg.stat().st_size == header_only  # neither kind of append wrote anything
    log.commit()
    assert read_events(tmp_path / "log") == events
    log.close()
    with pytest.raises(LogError, match="closed"):
        log.append_events(events[:1])


def test_interval_syncer_writes_without_commit_and_ends_at_close(tmp_path: Path) -> None:
    import threading
    import time

    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="5ms")
    events = make_events(7)
    for e in events:
        log.append(e)
    deadline = time.monotonic() + 10.0  # bounded: the syncer runs every 5 ms
    while time.monotonic() < deadline and read_events(tmp_path / "log") != events:
        time.sleep(0.005)
    assert read_events(tmp_path / "log") == events  # durable without a commit
    syncer = log._syncer
    assert syncer is not None and syncer.is_alive()
    log.close()
    assert not syncer.is_alive()
    assert not any(t.name == syncer.name for t in threading.enumerate())


def test_a_failing_fsync_in_the_syncer_is_reported_and_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    from kvlifecycle import eventlog

    real_fsync, calls = os.fsync, []

    def flaky(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 1:
            raise OSError(5, "injected I/O error")
        real_fsync(fd)

    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="5ms")
    monkeypatch.setattr(eventlog.os, "fsync", flaky)
    events = make_events(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for e in events:
            log.append(e)
        deadline = time.monotonic() + 10.0  # bounded: the syncer retries every 5 ms
        while time.monotonic() < deadline and len(calls) < 2:
            time.sleep(0.005)
    assert len(calls) >= 2  # retried after the failure
    assert any("fsync failed" in str(w.message) for w in caught)
    log.close()  # no deadlock, nothing lost
    assert read_events(tmp_path / "log") == events


def test_an_unencodable_event_in_the_syncers_batch_is_reported_and_the_syncer_goes_on(tmp_path: Path) -> None:
    import time

    good = make_events(4)
    bad = ev.Refused(99, 99.0, "start_load", object(), "r", "t")  # type: ignore[arg-type]
    log = EventLog(tmp_path / "log", header={"side": "source"}, fsync="5ms")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        log.append_events([good[0], bad, good[1]])
        deadline = time.monotonic() + 10.0  # bounded: the syncer writes every 5 ms
        while time.monotonic() < deadline and not any("could not be encoded" in str(w.message) for w in caught):
            time.sleep(0.005)
        assert any("could not be encoded" in str(w.message) and "Refused" in str(w.message) for w in caught)
        log.append_events(good[2:])  # the syncer is still writing
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and len(read_events(tmp_path / "log")) < 4:
            time.sleep(0.005)
    assert read_events(tmp_path / "log") == good
    log.close()


def test_a_batch_past_the_maximum_record_is_written_as_several(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifecycle import eventlog

    monkeypatch.setattr(eventlog, "MAX_RECORD", 2048)
    events = make_events(300)
    with EventLog(tmp_path / "log", header={"side": "source"}, batch_bytes=1 << 20, fsync="never") as log:
        log.append_events(events)  # one batch of ~10 KiB
        log.commit()
        huge = ev.SrcAllocated(1, 0.0, "big", b"\x00" * 4096)
        log.append_events([*events[:2], huge, events[2]])
        with pytest.raises(LogError, match="exceeds the maximum record size"):
            log.commit()
    records = list(LogReader(tmp_path / "log").records())
    assert [r.event for r in records] == [*events, *events[:3]]  # the one too big for any record is left out
    assert len({r.offset for r in records}) > 5  # several frames, none over the maximum (the reader checks)
