"""Each mutant (one rule patched away) is caught by the simulation within a fixed seed budget. The seeds each
needed, at the time of writing (streams, prefix hits and per-seed decode shapes simulated; seeds 0, 1, ... until the
first failing one): epoch check skipped 3, release on expiry skipped 5, completion applied twice 6, READY before the
last handle 6, old-epoch notification 1, a lease released under its write 88, a push timeout failing the load 27, a
read outliving its lease 21, a stream READY after its first layer batch 5, a stream's source released under its
writes 5, a stream written past its window 716, a retry appended after a partial frame 7 (see docs/simulation.md).
Since the simulation runs the real Producer and Consumer: the read deadline over the latest part 427, the real
``Consumer._fail`` keeping its handles 3, a lease released at the first of two consumers' completions 15 (a seed
whose decode side is a TP-2 instance). GPU blocks released before the staging copy completed: 2 (seed 1, a seed
whose P workers stage). Settled writes forgotten (a duplicated push written twice) 15 (seed 14), caught by the
late re-delivery of a push request after its write failed, its lease still live (3 of the first 1,000 seeds: the
real code's hand-back deferral stops most second writes too); clock jumps and late re-deliveries are drawn from a
stream of their own, so the other mutants' seeds are those above. A stream written past its window was the weakest
(about one seed in 300, first at seed 715) until a stall under a stream's write (its own RNG stream) reached it: now
seed 4, 5 of the first 100. D's digest mismatch ignored: seed 4 (a corrupted block READY). An uncancellable copy
treated as cancelled at release: seed 11 (one seed in 8 runs transports that cannot cancel). After corruption and
those seeds, the others' first seeds are unchanged but for completion applied twice (5 -> 4: its ``_part_done``
skips the digest check) and a stream READY after its first layer batch (4 -> 9); docs/simulation.md lists them.
Writers declared lost (invalidations under a push or stream write, late renewals) moved some: a lease released
under its write 632, settled writes forgotten 279, a push timeout failing the load 138 (each also caught by a named
test: tests/test_handoff_push_duplicate.py, tests/test_handoff_lost_writer.py); new: a P declared lost taken for
dead under its push 44, under its stream 58."""

from __future__ import annotations

import pytest
from mutants import MUTANTS, released_at_the_first_consumer

from kvlifecycle.sim.runner import run_seed
from kvlifecycle.sim.world import SimConfig, d_shape

BUDGET = 1000


@pytest.mark.mutants
@pytest.mark.parametrize("name", list(MUTANTS))
def test_mutant_is_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    MUTANTS[name](monkeypatch)
    for seed in range(BUDGET):
        result = run_seed(seed)
        if not result.ok:
            print(f"{name}: caught by seed {seed} ({seed + 1} seed(s)): {(result.violations + result.leaks)[0]}")
            return
    pytest.fail(f"mutant {name!r} survived {BUDGET} seeds")


@pytest.mark.mutants
def test_a_lease_released_at_the_first_of_two_consumers_is_a_read_under_a_freed_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds whose decode side is a TP-2 instance (two D ranks reading one P rank's lease, each its head slice): the
    lease released at the first completion frees the blocks under the other rank's read, which the in-flight check
    or the cross-log check names. Three seeds within the budget, each of that shape: not one lucky seed."""
    released_at_the_first_consumer(monkeypatch)
    caught: list[tuple[int, str]] = []
    for seed in range(BUDGET):
        result = run_seed(seed)
        if not result.ok:
            caught.append((seed, (result.violations + result.leaks)[0]))
            if len(caught) == 3:
                break
    print(f"caught by seeds {[seed for seed, _ in caught]}")
    assert len(caught) == 3, caught
    for seed, violation in caught:
        assert d_shape(SimConfig(), seed) == (2, 1)
        assert "reused or freed while transfer" in violation or (
            "released-under-reader" in violation and "completed before every consumer" in violation), violation
