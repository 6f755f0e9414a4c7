"""A host staging pool's log, however edited, ends through replay, the checks and the summary in a clean replay or
a one-line :class:`~kvlifecycle.eventlog.LogError` — never another exception (``kvlifecycle replay`` would exit 1,
the code for "violations found"). Real pool histories edited under valid checksums reach deep into the fold; wild
headers and generated events reach the header checks. Examples are bounded per run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from log_edits import edited_history

from kvlifecycle import events as ev
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.eventlog import MAGIC, LogError, _frame
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.replay import check, replay, summary
from kvlifecycle.staging import HostStaging, Where
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StagingPolicy

FUZZ = settings(max_examples=int(os.environ.get("KVL_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])
SEGMENT = "seg-00000000.kvl"
HEADER = {"side": "staging", "worker": "P~host", "source_worker": "P", "num_blocks": 8, "incarnation": 1}


def outcome_of(segment: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / SEGMENT).write_bytes(segment)
        try:
            result = replay(Path(tmp))
            check(result, quiescent=True)
            summary(result)
            for event in result.events:
                ev.to_dict(event)
        except LogError as exc:
            assert "\n" not in str(exc), str(exc)
            return "error"
        return "clean" if result.tail is None else "torn-tail"


def _framed(header: object, events: list[ev.Event]) -> bytes:
    frames = [_frame(msgspec.msgpack.encode({"schema": ev.SCHEMA_VERSION, **header} if isinstance(header, dict)
                                            else header))]
    return MAGIC + b"".join(frames + ([_frame(ev.ENCODER.encode(events))] if events else []))


def _real_history() -> list[ev.Event]:
    clock, hlc = ManualClock(), HybridLogicalClock()
    source = SourceLedger(16, clock=clock, hlc=hlc, worker="P")
    pool = StagingLedger(8, clock=clock, hlc=hlc, source_worker="P")
    events: list[ev.Event] = []
    pool.listeners.append(events.append)
    staging = HostStaging(source, pool, StagingPolicy(when="after", pool_blocks=8))
    for i in range(4):
        source.allocate(f"r{i}", [2 * i, 2 * i + 1])
        source.prefill_done(f"r{i}")
        grant = source.grant(f"r{i}", ttl_s=5.0)
        staging.begin(grant.transfer)
        if i == 1:
            staging.copy_done(grant.transfer, ok=False)
            continue
        staging.copy_done(grant.transfer)
        where = staging.claim(grant.transfer, grant.generation, "D")
        if i == 2:
            clock.advance(6.0)
            staging.read_done(where, grant.transfer, grant.generation, ok=False, reason="bound")
            continue
        staging.read_done(where, grant.transfer, grant.generation)
    pool.serve("gone", 1)  # a refusal
    assert where is Where.HOST
    return events


REAL = _real_history()


def test_the_real_history_replays_clean() -> None:
    assert outcome_of(_framed(HEADER, REAL)) == "clean"


NAMES = st.sampled_from(["r0", "r1", "", "P"])
TRANSFERS = st.sampled_from([*{e.transfer for e in REAL if isinstance(e, ev.StgStarted)}, "", "t9"])
SMALL = st.integers(0, 2) | st.integers(-2, 20) | st.sampled_from([2**31, 2**63 - 1, -(2**63)])
TIMES = st.integers(0, 20).map(float) | st.floats(allow_nan=True, allow_infinity=True)
BLOCKS = st.lists(st.integers(-3, 20) | st.sampled_from([2**31 - 1]), max_size=5).map(
    lambda ids: np.array(ids, dtype=np.int64).astype(np.int32).tobytes()) | st.binary(max_size=9)


def _build(cls: type[ev.Event], **fields: st.SearchStrategy) -> st.SearchStrategy[ev.Event]:
    return st.builds(cls, hlc=st.integers(0, 2**63 - 1), at=TIMES, **fields)


EVENTS = st.one_of(
    _build(ev.StgStarted, request=NAMES, transfer=TRANSFERS, generation=SMALL, blocks=BLOCKS, gpu_blocks=BLOCKS,
           gpu_epoch=SMALL, consumers=SMALL, expires_at=TIMES, ttl_s=TIMES),
    _build(ev.StgCompleted, transfer=TRANSFERS),
    _build(ev.StgAborted, transfer=TRANSFERS, reason=NAMES),
    _build(ev.StgServed, transfer=TRANSFERS, expires_at=TIMES, peer=NAMES),
    _build(ev.StgRenewed, transfer=TRANSFERS, expires_at=TIMES, peer=NAMES),
    _build(ev.StgReadEnded, transfer=TRANSFERS, consumer=SMALL, ok=st.booleans(), reason=NAMES),
    _build(ev.StgReleased, transfer=TRANSFERS, reason=st.sampled_from(["completed", "expired", "x"])),
    _build(ev.SrcGranted, request=NAMES, transfer=TRANSFERS, generation=SMALL, consumers=SMALL, expires_at=TIMES),
    _build(ev.Refused, command=NAMES, reason=NAMES),
)
HEADERS = st.fixed_dictionaries(
    {"side": st.just("staging")},
    optional={"num_blocks": st.integers(-2, 12) | st.sampled_from([2**40, "8", True, None]),
              "worker": st.sampled_from(["P~host", 7, None]), "source_worker": st.sampled_from(["P", 3, None]),
              "incarnation": st.integers(0, 2)},
)


@FUZZ
@given(HEADERS, st.lists(EVENTS, max_size=8))
def test_generated_staging_logs_end_clean_or_in_a_typed_error(header: dict, events: list[ev.Event]) -> None:
    assert outcome_of(_framed(header, events)) in ("clean", "error")


@FUZZ
@given(st.data())
def test_real_staging_histories_edited_end_clean_or_in_a_typed_error(data: st.DataObject) -> None:
    events = edited_history(REAL, data, {bytes: BLOCKS, str: NAMES | TRANSFERS, bool: st.booleans(), int: SMALL,
                                          float: TIMES})
    assert outcome_of(_framed(HEADER, events)) in ("clean", "error")
