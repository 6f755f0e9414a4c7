"""A bounded wait on an observable outcome, shared by the tests that drive threaded handoffs (no timed assertion:
the bound only keeps a broken run from hanging)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def until(fn: Callable[[], Any], timeout_s: float = 10.0) -> bool:
    """Poll ``fn`` every 2 ms until it is truthy (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.002)
    return False
