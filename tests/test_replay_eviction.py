"""The fold of a log equals the live ledger through prefix-cache evictions: a real SourceLedger keeps blocks for prefix
reuse, shares them, evicts some (some still shared), reallocates evicted ones, and after every command the log folded
up to that point (``replay``, and the story's per-event fold) has every block's state, epoch and owner the live
ledger has. A replay that skips eviction events is caught."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvlifecycle import events as ev
from kvlifecycle import replay as replay_module
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.ledger import SourceLedger, open_ledger
from kvlifecycle.machines import SourceState
from kvlifecycle.replay import replay
from kvlifecycle.story import trace_logs

N = 16


def block_view(ledger: SourceLedger) -> dict[str, object]:
    """Every block's state and epoch, each request's blocks (the owners), and the prefix-sharing counts."""
    owners = {name: req.blocks.tolist() for name, req in ledger.requests.items()}
    return {"state": ledger.state.tolist(), "epoch": ledger.epoch.tolist(), "owners": owners,
            "refs": ledger.refs.tolist(), "pins": ledger.pins.tolist()}


def prefix_cache_story(ledger: SourceLedger, clock: ManualClock) -> list[tuple[str, Callable[[], object]]]:
    """The commands, in order: handoffs whose blocks are kept for prefix reuse, hits that share them, evictions
    (of unshared cached blocks), and reallocations of evicted blocks."""

    def handoff(request: str) -> None:
        ledger.prefill_done(request)
        g = ledger.grant(request, ttl_s=30.0)
        assert ledger.heartbeat(g.transfer, g.generation, peer="d0")
        assert ledger.consumer_done(g.transfer, g.generation)
        assert [r.request for r in ledger.take_released()] == [request]

    return [
        ("allocate a", lambda: ledger.allocate("a", [0, 1, 2, 3])),
        ("hand a off", lambda: handoff("a")),
        ("cache a", lambda: ledger.free("a", cache=True)),
        ("b shares a's prefix", lambda: ledger.share("b", [0, 1])),
        ("b's own blocks", lambda: ledger.allocate("b+", [4, 5])),
        ("evict a's unshared tail", lambda: ledger.evict([2, 3])),
        ("c reallocates an evicted block", lambda: ledger.allocate("c", [3, 6])),
        ("the clock moves", lambda: clock.advance(0.5)),
        ("hand c off", lambda: handoff("c")),
        ("cache c", lambda: ledger.free("c", cache=True)),
        ("b's prefix done", lambda: ledger.prefill_done("b")),
        ("b freed, its prefix stays cached", lambda: ledger.free("b", cache=True)),
        ("b+ freed", lambda: (ledger.prefill_done("b+"), ledger.free("b+"))),
        ("evict what b shared and c kept", lambda: ledger.evict([0, 3, 6])),
        ("d reallocates evicted blocks", lambda: ledger.allocate("d", [0, 6, 7])),
        ("evict the last cached blocks", lambda: ledger.evict([1])),
    ]


def run_and_snapshot(tmp_path: Path) -> tuple[Path, list[tuple[str, int, dict[str, object]]]]:
    """Run the story on a real ledger writing a real log; after each command, the live view and how many events
    the log held then."""
    clock = ManualClock(1_800_000_000.0)
    hlc = HybridLogicalClock(wall_ms=lambda: int(clock.now() * 1000))
    log_dir = tmp_path / "p0"
    ledger = open_ledger("source", N, str(log_dir), worker="p0", clock=clock, hlc=hlc, fsync="never")
    snapshots = []
    events = 0
    for name, command in prefix_cache_story(ledger, clock):
        command()
        ledger.commit()
        events = len(replay(log_dir).events)
        snapshots.append((name, events, block_view(ledger)))
    ledger.log.close()
    # the story did what it says: evictions happened, and evicted blocks went to new owners at new epochs
    assert sum(isinstance(e, ev.SrcEvicted) for e in replay(log_dir).events) == 3
    assert block_view(ledger)["owners"] == {"d": [0, 6, 7]}
    assert (ledger.state[[2, 3, 1]] == SourceState.FREE).all() and (ledger.epoch[[0, 6]] > 1).all()
    return log_dir, snapshots


def fold_differences(log_dir: Path, snapshots: list[tuple[str, int, dict[str, object]]]) -> list[str]:
    """Where the fold of the log up to each command differs from the live ledger then (both folds)."""
    out = []
    for name, events, live in snapshots:
        folded = replay(log_dir, until_index=events).ledger
        assert isinstance(folded, SourceLedger)
        if block_view(folded) != live:
            out.append(f"replay after: {name}")
    trace = trace_logs([log_dir])
    story_ledger = trace.logs["p0"].ledger
    assert isinstance(story_ledger, SourceLedger)
    if block_view(story_ledger) != snapshots[-1][2]:
        out.append("story fold at the end")
    return out


def test_fold_equals_live_through_evictions_and_reallocations(tmp_path: Path) -> None:
    log_dir, snapshots = run_and_snapshot(tmp_path)
    assert fold_differences(log_dir, snapshots) == []


@pytest.mark.mutants
def test_a_replay_that_skips_eviction_events_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The mutant: replay drops every eviction event it reads. The live ledger is untouched (the log holds the
    evictions), so the folded block states differ from the live ones, and the comparison says where."""
    log_dir, snapshots = run_and_snapshot(tmp_path)
    decode = replay_module.decode_payloads

    def decode_without_evictions(scan: object) -> list[ev.Event]:
        return [e for e in decode(scan) if not isinstance(e, ev.SrcEvicted)]  # type: ignore[arg-type]

    monkeypatch.setattr(replay_module, "decode_payloads", decode_without_evictions)
    differences = fold_differences(log_dir, snapshots)
    assert "replay after: evict a's unshared tail" in differences
    assert "replay after: evict the last cached blocks" in differences
    folded = replay(log_dir).ledger
    assert folded.state[1] == SourceState.PREFIX_CACHED and not np.array_equal(folded.state, snapshots[-1][2]["state"])


@pytest.mark.mutants
def test_the_stateful_machine_catches_a_replay_skipping_evictions(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same mutant against the random command machine (``tests/test_stateful.py``), whose teardown caches and
    evicts what is left and compares the fold with the live ledger: derandomized, so it is caught on every run."""
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test
    from test_stateful import Handoffs

    decode = replay_module.decode_payloads
    monkeypatch.setattr(replay_module, "decode_payloads",
                        lambda scan: [e for e in decode(scan) if not isinstance(e, ev.SrcEvicted)])
    fast = settings(max_examples=100, stateful_step_count=50, deadline=None, derandomize=True, database=None,
                    phases=[Phase.generate], suppress_health_check=[HealthCheck.too_slow])
    with pytest.raises(AssertionError):
        run_state_machine_as_test(Handoffs, settings=fast)
