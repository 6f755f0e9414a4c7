"""A planted bug for the tests that need a failing seed: a failed load leaves its sibling handles posted. Plain
functions (no pytest), so a spawned worker process of ``run_many(..., jobs=N)`` can plant it too."""

from __future__ import annotations

from typing import Any

from kvlifecycle.sim.protocol_driver import ConsumerCore

_ORIGINAL_FAIL = ConsumerCore._fail


def _fail_without_releasing_handles(self: ConsumerCore, load: Any, reason: str, **how: Any) -> None:
    load.handles.clear()
    _ORIGINAL_FAIL(self, load, reason, **how)


def plant_handle_leak() -> None:
    """Patch the bug in for the rest of this process (a worker's)."""
    ConsumerCore._fail = _fail_without_releasing_handles  # type: ignore[method-assign]
