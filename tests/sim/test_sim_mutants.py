"""Each mutant (one rule patched away) is caught by the simulation within a fixed seed budget. The seeds each
needed, at the time of writing (streams and prefix hits simulated): epoch check skipped 10, release on expiry
skipped 1, completion applied twice 2, READY before the last handle 6, old-epoch notification 6, a lease released
under its write 46, a push timeout failing the load 46, a read outliving its lease 207, a stream READY after its
first layer batch 2, a stream's source released under its writes 2, a stream written past its window 2, a retry
appended after a partial frame 6 (see docs/simulation.md). Since the simulation runs the real Producer and
Consumer: the read deadline over the latest part 427, the real ``Consumer._fail`` keeping its handles 12."""

from __future__ import annotations

import pytest
from mutants import MUTANTS

from kvlifecycle.sim.runner import run_seed

BUDGET = 600


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
