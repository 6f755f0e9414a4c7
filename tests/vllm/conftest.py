"""Fixtures for the real-vLLM end-to-end tests: skip cleanly without the vLLM venv, unless KVL_REQUIRE_ALL=1.
A failed test's report carries the connector's warnings and errors from the servers' logs (where CI shows only
the report, the logs themselves are gone)."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest
import vllm_harness as h

_SETUP_STARTED = pytest.StashKey[float]()


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    h.require_vllm()
    return h.build_tiny_model(h.MODEL_CACHE)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    if call.when == "setup":
        item.stash[_SETUP_STARTED] = call.start
    report = yield
    if report.failed:  # the logs written since this test's setup began (a module's servers start in its first)
        digest = h.failure_digest(item.stash.get(_SETUP_STARTED, call.start) - 1.0)
        if digest:
            report.sections.append(("kvlifecycle lines of the servers' logs", digest))
    return report
