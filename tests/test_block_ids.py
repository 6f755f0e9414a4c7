"""Block ids are checked as the caller gave them, and every refused command — of any kind — is a ``Refused`` event."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlifecycle import events as ev
from kvlifecycle.blockids import DuplicateScratch, parse_block_ids
from kvlifecycle.clock import ManualClock
from kvlifecycle.ledger import (
    BlockBusyError,
    InvalidBlockIdsError,
    LedgerError,
    SourceLedger,
    TargetLedger,
    open_ledger,
)
from kvlifecycle.machines import SourceState
from kvlifecycle.replay import replay

N = 64

BAD_IDS: dict[str, Any] = {
    "int64 beyond int32 (would wrap to 10)": np.array([2**32 + 10], dtype=np.int64),
    "uint64 beyond int32": np.array([2**32 + 3], dtype=np.uint64),
    "python int beyond int32": [3, 2**32 + 10],
    "float that would truncate to 13": [13.9],
    "float array of whole numbers": np.array([1.0, 2.0]),
    "bools": np.array([True, False]),
    "strings": ["1", "2"],
    "objects": np.array([1, None], dtype=object),
    "empty list": [],
    "empty int array": np.array([], dtype=np.int32),
    "duplicates": [12, 12],
    "duplicates far apart": [5, 6, 7, 8, 5],
    "negative": [-1],
    "one past the pool": [N],
    "int16 negative": np.array([-3], dtype=np.int16),
    "2-D": [[1, 2], [3, 4]],
    "ragged": [[1], [2, 3]],
}


def _source_with_blocks_ready(ledger: SourceLedger) -> None:
    ledger.allocate("owner", [40, 41])
    ledger.prefill_done("owner")


ID_COMMANDS: dict[str, Callable[[Any, Any], Any]] = {
    "allocate": lambda led, ids: led.allocate("r", ids),
    "share": lambda led, ids: led.share("r", ids),
    "evict": lambda led, ids: led.evict(ids),
    "reserve": lambda led, ids: led.reserve("r", ids),
}


def _ledger_for(command: str, log_dir: Path) -> SourceLedger | TargetLedger:
    side = "target" if command == "reserve" else "source"
    ledger = open_ledger(side, N, str(log_dir), worker="w0")
    if side == "source":
        _source_with_blocks_ready(ledger)  # type: ignore[arg-type]
    return ledger


def _refused(log_dir: Path) -> list[ev.Refused]:
    return [e for e in replay(log_dir).events if isinstance(e, ev.Refused)]


@pytest.mark.parametrize("command", sorted(ID_COMMANDS))
@pytest.mark.parametrize("case", sorted(BAD_IDS))
def test_bad_ids_are_refused_by_every_id_command_with_a_refused_event(tmp_path: Path, command: str, case: str) -> None:
    ledger = _ledger_for(command, tmp_path / "log")
    before = (ledger.state.copy(), ledger.epoch.copy(), sorted(ledger.requests))
    with pytest.raises(InvalidBlockIdsError, match="block ids") as info:
        ID_COMMANDS[command](ledger, BAD_IDS[case])
    assert isinstance(info.value, LedgerError) and isinstance(info.value, ValueError)  # callers catch either
    after = (ledger.state, ledger.epoch, sorted(ledger.requests))
    assert np.array_equal(before[0], after[0]) and np.array_equal(before[1], after[1]) and before[2] == after[2]
    ledger.log.close()
    refused = _refused(tmp_path / "log")
    assert [(e.command, e.reason) for e in refused] == [(command, str(info.value))]
    assert "\n" not in refused[0].reason


def test_an_id_beyond_int32_never_becomes_a_small_block(source: SourceLedger) -> None:
    with pytest.raises(InvalidBlockIdsError, match="4294967306 not in"):
        source.allocate("r", np.array([2**32 + 10]))
    assert source.state[10] == SourceState.FREE and "r" not in source.requests
    assert source.allocate("r", np.array([10], dtype=np.int64)) == 1  # a valid wide id is narrowed once checked
    assert source.requests["r"].blocks.dtype == np.int32


def test_two_source_blocks_cannot_be_written_into_one_target_block(target: TargetLedger) -> None:
    with pytest.raises(InvalidBlockIdsError, match="12 given more than once"):
        target.reserve("r", [12, 12])
    assert target.refusals == {"reserve: block ids repeat": 1}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-2, N + 2), max_size=12))
def test_ids_are_accepted_exactly_when_each_is_in_the_pool_once(raw: list[int]) -> None:
    ledger = TargetLedger(N)
    valid = bool(raw) and all(0 <= b < N for b in raw) and len(set(raw)) == len(raw)
    if valid:
        ledger.reserve("r", np.array(raw, dtype=np.int64))
        assert ledger.requests["r"].blocks.tolist() == raw
        assert ledger.refusals == {}
    else:
        with pytest.raises(InvalidBlockIdsError):
            ledger.reserve("r", np.array(raw, dtype=np.int64))
        assert "r" not in ledger.requests and sum(ledger.refusals.values()) == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 15), min_size=1, max_size=40))
def test_the_duplicate_check_agrees_with_a_set(ids: list[int]) -> None:
    scratch = DuplicateScratch(16)
    arr = np.array(ids, dtype=np.int32)
    found = scratch.first_duplicate(arr)
    if len(set(ids)) == len(ids):
        assert found == -1
    else:
        assert ids.count(found) > 1
    # the scratch holds no memory of an earlier call
    assert scratch.first_duplicate(np.array(sorted(set(ids)), dtype=np.int32)) == -1


def test_a_query_checks_ids_too_but_records_nothing(source: SourceLedger) -> None:
    assert source.block_states([]).size == 0
    assert source.block_states([3, 3]).tolist() == [0, 0]  # a query may ask twice
    with pytest.raises(InvalidBlockIdsError, match="not integers"):
        source.block_states([1.5])
    assert source.refusals == {}
    assert parse_block_ids([1.5], N)[1].startswith("block ids not integers")


def test_evicting_a_pinned_block_names_its_real_state(source: SourceLedger) -> None:
    source.allocate("r", [1, 2])
    with pytest.raises(BlockBusyError, match="block 1 is ALLOCATED, not evictable"):
        source.evict([1])
    source.prefill_done("r")
    source.grant("r")
    with pytest.raises(BlockBusyError, match="block 2 is PINNED_FOR_TRANSFER, not evictable"):
        source.evict([2])
    assert "0 refs" not in "".join(source.refusals)


# -- every refused command is an event ---------------------------------------------------------------------------


def _granted(led: SourceLedger) -> Any:
    led.allocate("r", [1, 2])
    led.prefill_done("r")
    return led.grant("r", ttl_s=5.0)


def _loading(led: TargetLedger) -> None:
    led.reserve("r", [1, 2])
    led.start_load("r", "t", parts=1)


SOURCE_REFUSALS: dict[str, tuple[Callable[[SourceLedger], Any], Callable[[SourceLedger], Any]]] = {
    "allocate": (lambda led: led.allocate("r", [1]), lambda led: led.allocate("x", [1])),
    "share": (lambda led: None, lambda led: led.share("r", [3])),
    "prefill_done": (lambda led: None, lambda led: led.prefill_done("nope")),
    "grant": (lambda led: led.allocate("r", [1]), lambda led: led.grant("r")),
    "grant consumers": (lambda led: (led.allocate("r", [1]), led.prefill_done("r")),
                        lambda led: led.grant("r", consumers=0)),
    "heartbeat": (_granted, lambda led: led.heartbeat("t-unknown", 1)),
    "consumer_done": (_granted, lambda led: led.consumer_done(next(iter(led.leases)), 1, consumer=5)),
    "fail": (_granted, lambda led: led.fail(next(iter(led.leases)), 99)),
    "cancel": (lambda led: None, lambda led: led.cancel("nope")),
    "free": (_granted, lambda led: led.free("r")),
    "evict": (_granted, lambda led: led.evict([1])),
    "peer_restarted": (lambda led: led.peer_restarted("d0", 5), lambda led: led.peer_restarted("d0", 4)),
}

TARGET_REFUSALS: dict[str, tuple[Callable[[TargetLedger], Any], Callable[[TargetLedger], Any]]] = {
    "reserve": (lambda led: led.reserve("r", [1]), lambda led: led.reserve("x", [1])),
    "start_load": (lambda led: led.reserve("r", [1]), lambda led: led.start_load("nope", "t")),
    "start_load mode": (lambda led: led.reserve("r", [1]), lambda led: led.start_load("r", "t", mode="pul")),
    "start_load parts": (lambda led: led.reserve("r", [1]), lambda led: led.start_load("r", "t", parts=0)),
    "part_done": (_loading, lambda led: led.part_done("t", part=3)),
    "fail": (lambda led: None, lambda led: led.fail("t-unknown")),
    "cancel": (lambda led: None, lambda led: led.cancel("nope")),
    "local_fill": (_loading, lambda led: led.local_fill("r")),
    "finish": (_loading, lambda led: led.finish("r")),
    "peer_restarted": (lambda led: led.peer_restarted("p0", 5), lambda led: led.peer_restarted("p0", 4)),
}


@pytest.mark.parametrize(
    ("side", "case"),
    [("source", c) for c in SOURCE_REFUSALS] + [("target", c) for c in TARGET_REFUSALS],
)
def test_every_refused_command_appends_exactly_one_refused_event(tmp_path: Path, side: str, case: str) -> None:
    setup, command = (SOURCE_REFUSALS if side == "source" else TARGET_REFUSALS)[case]
    ledger: Any = open_ledger(side, N, str(tmp_path / "log"), worker="w0", clock=ManualClock(10.0))
    setup(ledger)
    ledger.commit()
    seen: list[ev.Event] = []
    ledger.listeners.append(seen.append)
    state_before = ledger.state.copy()
    try:
        outcome = command(ledger)
    except (LedgerError, ValueError):
        outcome = "raised"
    assert outcome in (False, [], "raised")  # refused: False, nothing dropped, or an exception
    assert [type(e) for e in seen] == [ev.Refused]
    assert seen[0].command == case.split()[0]
    assert np.array_equal(ledger.state, state_before)
    ledger.log.close()
    assert _refused(tmp_path / "log")[-1] == seen[0]  # and it is in the log, where replay sees it


@pytest.mark.parametrize("side", ["source", "target"])
def test_a_request_id_that_is_not_a_string_is_refused_and_the_log_stays_readable(tmp_path: Path, side: str) -> None:
    ledger: Any = open_ledger(side, N, str(tmp_path / "log"), worker="w0")
    enter = ledger.allocate if side == "source" else ledger.reserve
    with pytest.raises(LedgerError, match="request id not a string: int"):
        enter(5, [1])
    with pytest.raises(LedgerError):
        ledger.finish(7) if side == "target" else ledger.prefill_done(7)  # unknown: refused under its repr
    ledger.log.close()
    assert [(e.command, e.request) for e in _refused(tmp_path / "log")] == [
        ("allocate" if side == "source" else "reserve", "5"),
        ("finish" if side == "target" else "prefill_done", "7"),
    ]
