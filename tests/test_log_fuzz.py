"""Any bytes in a log directory end, through the reader, replay and the checks, in one of three ways: a clean replay,
a torn-tail report, or a one-line :class:`~kvlifecycle.eventlog.LogError` (``kvlifecycle replay`` exits 2 on it).
Never another exception: a traceback would exit 1, the code that means "violations found".

Raw bytes and mutations of a real log's bytes mostly fail a checksum; well-framed logs of generated events (valid
checksums, impossible contents) reach the header checks and the fold. Examples are bounded per run; hypothesis
prints the seed and the failing example.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from log_edits import edited_history

from kvlifecycle import events as ev
from kvlifecycle.clock import ManualClock
from kvlifecycle.eventlog import MAGIC, MAX_RECORD, CorruptLogError, LogError, _frame
from kvlifecycle.ledger import ReplayError, open_ledger
from kvlifecycle.replay import check, replay, summary

# a bounded number per CI run; KVL_FUZZ_EXAMPLES raises it for a longer hunt
FUZZ = settings(
    max_examples=int(os.environ.get("KVL_FUZZ_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
SEGMENT = "seg-00000000.kvl"


def outcome(directory: Path) -> str:
    """What ``kvlifecycle replay --check --quiescent --events`` does with the directory, as one word."""
    try:
        result = replay(directory)
        check(result, quiescent=True)
        summary(result)
        for event in result.events:
            ev.to_dict(event)
    except LogError as exc:
        assert "\n" not in str(exc), str(exc)
        return "error"
    return "clean" if result.tail is None else "torn-tail"


def outcome_of(segment: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SEGMENT).write_bytes(segment)
        return outcome(Path(tmp))


def _real_log(side: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        ledger = open_ledger(side, 16, tmp, worker=f"{side}0", clock=ManualClock(5.0), fsync="never")
        if side == "source":
            for i in range(3):
                ledger.allocate(f"r{i}", [2 * i, 2 * i + 1])
                ledger.prefill_done(f"r{i}")
                ledger.commit()
                g = ledger.grant(f"r{i}", ttl_s=3.0)
                ledger.heartbeat(g.transfer, g.generation, peer="d0")
                ledger.consumer_done(g.transfer, g.generation)
                ledger.free(f"r{i}", cache=i == 1)
                ledger.commit()
            ledger.evict([2])
            ledger.consumer_done("gone", 1)  # a refusal
        else:
            for i in range(3):
                ledger.reserve(f"r{i}", [i, 8 + i])
                ledger.start_load(f"r{i}", f"t{i}", parts=2, peer="p0", mode="push" if i else "pull")
                ledger.commit()
                ledger.part_done(f"t{i}", 0)
                ledger.part_done(f"t{i}", 1)
                ledger.finish(f"r{i}")
                ledger.commit()
            ledger.cancel("nobody")
        ledger.log.close()
        return (Path(tmp) / SEGMENT).read_bytes()


REAL = {"source": _real_log("source"), "target": _real_log("target")}


def test_the_real_logs_replay_clean() -> None:
    assert {side: outcome_of(raw) for side, raw in REAL.items()} == {"source": "clean", "target": "clean"}


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_end_clean_torn_or_in_a_log_error(raw: bytes) -> None:
    assert outcome_of(raw) in ("clean", "torn-tail", "error")
    assert outcome_of(MAGIC + raw) in ("clean", "torn-tail", "error")


def _mutate(data: bytes, draw: st.DrawFn) -> bytes:
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "duplicate"]))
        pos = draw(st.integers(0, max(0, len(buf) - 1)))
        if kind == "flip" and buf:
            buf[pos] ^= draw(st.integers(1, 255))
        elif kind == "set" and buf:
            buf[pos] = draw(st.integers(0, 255))
        elif kind == "insert":
            buf[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del buf[pos : pos + draw(st.integers(1, 16))]
        elif kind == "truncate":
            del buf[pos:]
        elif kind == "duplicate":
            end = draw(st.integers(pos, len(buf)))
            buf[end:end] = buf[pos:end]
    return bytes(buf)


@FUZZ
@given(st.sampled_from(sorted(REAL)), st.data())
def test_mutations_of_a_real_log_end_clean_torn_or_in_a_log_error(side: str, data: st.DataObject) -> None:
    mutated = _mutate(REAL[side], data.draw)
    assert outcome_of(mutated) in ("clean", "torn-tail", "error")


def _restarted_log() -> dict[str, bytes]:
    """A source log of two incarnations over several small segments (rotation, and a restart mid-log)."""
    from kvlifecycle.eventlog import EventLog

    with tempfile.TemporaryDirectory() as tmp:
        for incarnation in (1, 2):
            ledger = open_ledger("source", 16, None, worker="p0", clock=ManualClock(5.0))
            ledger.incarnation = incarnation
            ledger.log = EventLog(tmp, header=ledger.header(), fsync="never", segment_bytes=256, batch_bytes=64)
            for i in range(4):
                ledger.allocate(f"r{i}", [i])
                ledger.prefill_done(f"r{i}")
                ledger.commit()
                if incarnation == 2 or i < 2:  # the first incarnation crashes with two leases live
                    g = ledger.grant(f"r{i}")
                    ledger.commit()
                    if incarnation == 2:
                        ledger.consumer_done(g.transfer, g.generation)
                        ledger.free(f"r{i}")
                        ledger.commit()
            ledger.log.close()
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir())}


RESTARTED = _restarted_log()


def _outcome_of_segments(segments: dict[str, bytes]) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for name, raw in segments.items():
            (Path(tmp) / name).write_bytes(raw)
        return outcome(Path(tmp))


def test_the_restarted_log_spans_segments_and_replays_clean() -> None:
    assert len(RESTARTED) > 3 and _outcome_of_segments(RESTARTED) == "clean"


@FUZZ
@given(st.data())
def test_mutations_of_any_segment_of_a_multi_segment_log_end_clean_torn_or_in_a_log_error(data) -> None:
    segments = dict(RESTARTED)
    names = sorted(segments)
    for _ in range(data.draw(st.integers(1, 2))):
        action = data.draw(st.sampled_from(["mutate", "mutate", "drop", "swap"]))
        name = data.draw(st.sampled_from(names))
        if action == "mutate":
            segments[name] = _mutate(segments.get(name, b""), data.draw)
        elif action == "drop" and len(segments) > 1:
            segments.pop(name, None)
        elif action == "swap":
            other = data.draw(st.sampled_from(names))
            segments[name], segments[other] = segments.get(other, b""), segments.get(name, b"")
    assert _outcome_of_segments(segments) in ("clean", "torn-tail", "error")


# -- well framed, impossible -------------------------------------------------------------------------------------

def _mostly(usual: st.SearchStrategy, odd: st.SearchStrategy) -> st.SearchStrategy:
    """``usual`` nine times in ten: plausible values reach deeper into the fold than wild ones."""
    return st.integers(0, 9).flatmap(lambda i: odd if i == 0 else usual)


NAMES = st.sampled_from(["r0", "r1", "r0", "r1", "", "p0"])
TRANSFERS = st.sampled_from(["t0", "t1", "t0", "t1", "", "p0"])
SMALL = _mostly(st.integers(0, 2), st.integers(-2, 20) | st.sampled_from([2**31, 2**63 - 1, -(2**63)]))
TIMES = _mostly(st.integers(0, 20).map(float), st.floats(allow_nan=True, allow_infinity=True))
BLOCKS = _mostly(
    st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(-3, 20) | st.sampled_from([2**31 - 1, 2**20]), max_size=6),
).map(lambda ids: np.array(ids, dtype=np.int64).astype(np.int32).tobytes()) | st.binary(max_size=9)


def _events(side: str) -> st.SearchStrategy[ev.Event]:
    """Events of ``side`` nine times in ten, of either side otherwise."""

    def build(cls: type[ev.Event], **fields: st.SearchStrategy) -> st.SearchStrategy[ev.Event]:
        return st.builds(cls, hlc=st.integers(0, 2**63 - 1), at=TIMES, **fields)

    source = st.one_of(
        build(ev.SrcAllocated, request=NAMES, blocks=BLOCKS),
        build(ev.SrcShared, request=NAMES, blocks=BLOCKS),
        build(ev.SrcPrefillDone, request=NAMES),
        build(ev.SrcGranted, request=NAMES, transfer=TRANSFERS, generation=SMALL, consumers=SMALL, expires_at=TIMES,
              peer=NAMES),
        build(ev.SrcLeaseRenewed, transfer=TRANSFERS, expires_at=TIMES, peer=NAMES),
        build(ev.SrcCancelDeferred, transfer=TRANSFERS),
        build(ev.SrcConsumerDone, transfer=TRANSFERS, consumer=SMALL),
        build(ev.SrcLeaseReleased, transfer=TRANSFERS, reason=st.sampled_from(["completed", "failed", "x"])),
        build(ev.SrcFreed, request=NAMES, cached=st.booleans()),
        build(ev.SrcAborted, request=NAMES),
        build(ev.SrcEvicted, blocks=BLOCKS),
    )
    target = st.one_of(
        build(ev.TgtReserved, request=NAMES, blocks=BLOCKS),
        build(ev.TgtLoadStarted, request=NAMES, transfer=TRANSFERS, parts=SMALL, generation=SMALL, peer=NAMES,
              peer_epoch=SMALL, mode=st.sampled_from(["pull", "push", "?"])),
        build(ev.TgtPartDone, transfer=TRANSFERS, part=SMALL),
        build(ev.TgtLoadFailed, transfer=TRANSFERS, reason=NAMES, recompute=st.booleans()),
        build(ev.TgtCancelled, request=NAMES),
        build(ev.TgtLocalFilled, request=NAMES),
        build(ev.TgtFinished, request=NAMES),
    )
    both = build(ev.PeerEpochChanged, peer=NAMES, epoch=SMALL) | build(ev.Refused, command=NAMES, reason=NAMES)
    own = source if side == "source" else target
    return _mostly(own | both, source | target)


WILD_HEADERS = st.fixed_dictionaries(
    {"schema": st.just(ev.SCHEMA_VERSION)},
    optional={
        "side": st.sampled_from(["source", "target", "middle", 3]),
        "num_blocks": st.integers(-2, 24) | st.sampled_from([2**31, 2**40, "8", 8.0, True, None]),
        "worker": st.sampled_from(["w0", 7, None]),
        "failure_policy": st.sampled_from(["fail", "recompute", "retry", 0]),
        "incarnation": st.integers(0, 3) | st.sampled_from(["x", 1.5, None]),
        "segment": st.integers(0, 2) | st.just("0"),
    },
)
HEADERS = _mostly(
    st.fixed_dictionaries(
        {"schema": st.just(ev.SCHEMA_VERSION), "side": st.sampled_from(["source", "target"]),
         "num_blocks": st.integers(1, 12), "worker": st.just("w0"), "incarnation": st.integers(0, 1)},
        optional={"failure_policy": st.sampled_from(["fail", "recompute"])},
    ),
    WILD_HEADERS,
)
RAW_MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=4) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=12,
)


@FUZZ
@given(HEADERS, st.data(), st.lists(RAW_MSGPACK, max_size=1))
def test_well_framed_impossible_logs_end_in_a_typed_error_not_a_crash(header, data, junk) -> None:
    events = _events("target" if header.get("side") == "target" else "source")
    batches = data.draw(st.lists(st.lists(events, max_size=6), max_size=4))
    frames = [_frame(msgspec.msgpack.encode(header))]
    frames += [_frame(ev.ENCODER.encode(batch)) for batch in batches if batch]
    frames += [_frame(msgspec.msgpack.encode(value)) for value in junk]
    assert outcome_of(MAGIC + b"".join(frames)) in ("clean", "error")  # well framed: never a torn tail


def _real_events(side: str) -> list[ev.Event]:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SEGMENT).write_bytes(REAL[side])
        return replay(Path(tmp)).events


REAL_EVENTS = {side: _real_events(side) for side in REAL}


@FUZZ
@given(st.sampled_from(sorted(REAL)), st.data())
def test_real_event_sequences_edited_and_reframed_end_clean_or_in_a_typed_error(side: str, data) -> None:
    """Edits of a real history (events dropped, repeated, swapped, a field changed) under valid checksums: these
    go deep into the fold, where an impossible step must be a ReplayError."""
    events = edited_history(REAL_EVENTS[side], data, {bytes: BLOCKS, str: NAMES | TRANSFERS, bool: st.booleans(),
                                                      int: SMALL, float: TIMES})
    header = {"side": side, "worker": "w0", "num_blocks": 16, "incarnation": 1}
    assert outcome_of(_framed(header, events)) in ("clean", "error")


# -- the named cases ---------------------------------------------------------------------------------------------


def _framed(header: dict, *batches: list[ev.Event]) -> bytes:
    return MAGIC + b"".join(
        [_frame(msgspec.msgpack.encode({"schema": ev.SCHEMA_VERSION, **header}))]
        + [_frame(ev.ENCODER.encode(b)) for b in batches]
    )


def _error_of(segment: bytes) -> LogError:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SEGMENT).write_bytes(segment)
        try:
            replay(Path(tmp))
        except LogError as exc:
            return exc
    raise AssertionError("replayed without an error")


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ({"side": "source", "worker": "p"}, "num_blocks is not an integer"),
        ({"side": "source", "num_blocks": 0}, "num_blocks 0 is not in"),
        ({"side": "target", "num_blocks": -5}, "num_blocks -5 is not in"),
        ({"side": "target", "num_blocks": 4, "failure_policy": "retry"}, "failure_policy"),
        ({"num_blocks": 4}, "no known side"),
    ],
)
def test_impossible_headers_are_replay_errors(header: dict, reason: str) -> None:
    exc = _error_of(_framed(header, [ev.SrcPrefillDone(1, 0.0, "r")]))
    assert isinstance(exc, ReplayError) and reason in str(exc)


def test_a_block_id_beyond_the_pool_is_a_replay_error() -> None:
    blocks = np.array([1, 9], dtype=np.int32).tobytes()
    exc = _error_of(_framed({"side": "source", "num_blocks": 8}, [ev.SrcAllocated(1, 0.0, "r", blocks)]))
    assert isinstance(exc, ReplayError) and "9 not in [0, 8)" in str(exc)
    negative = np.array([-1], dtype=np.int32).tobytes()  # np.put would silently wrap it to the last block
    exc = _error_of(_framed({"side": "target", "num_blocks": 8}, [ev.TgtReserved(1, 0.0, "r", negative)]))
    assert isinstance(exc, ReplayError) and "-1 not in [0, 8)" in str(exc)


def test_an_event_of_the_other_side_or_unknown_request_is_a_replay_error() -> None:
    exc = _error_of(_framed({"side": "source", "num_blocks": 8}, [ev.TgtFinished(1, 0.0, "r")]))
    assert isinstance(exc, ReplayError) and "TgtFinished does not belong in a source log" in str(exc)
    exc = _error_of(_framed({"side": "target", "num_blocks": 8}, [ev.TgtFinished(1, 0.0, "r")]))
    assert isinstance(exc, ReplayError) and "TgtFinished(request='r')" in str(exc) and "unknown" in str(exc)


def test_a_length_beyond_the_maximum_record_after_the_header_is_corruption() -> None:
    head = _framed({"side": "source", "num_blocks": 8})
    junk = (MAX_RECORD + 1).to_bytes(4, "little") + b"\x00" * 12
    exc = _error_of(head + junk)
    assert isinstance(exc, CorruptLogError) and exc.offset == len(head)
    assert "exceeds the maximum record size" in str(exc) and SEGMENT in str(exc)
    assert outcome_of(head + junk[:3]) == "torn-tail"  # a partial length field is still a torn write
