"""A planted bug for the tests that need a failing seed: the real ``Consumer._fail`` keeps its read handles (a
failed load's sibling reads stay posted). Plain functions (no pytest), so a spawned worker process of
``run_many(..., jobs=N)`` can plant it too."""

from __future__ import annotations

from typing import Any

from kvlifecycle.handoff import Consumer

_ORIGINAL_FAIL = Consumer._fail


def _fail_without_releasing_handles(self: Consumer, load: Any, reason: str, **how: Any) -> None:
    load.handles.clear()
    _ORIGINAL_FAIL(self, load, reason, **how)


def plant_handle_leak() -> None:
    """Patch the bug in for the rest of this process (a worker's)."""
    Consumer._fail = _fail_without_releasing_handles  # type: ignore[method-assign]
