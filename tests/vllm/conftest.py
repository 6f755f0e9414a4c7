"""Fixtures for the real-vLLM end-to-end tests: skip cleanly without the vLLM venv, unless KVL_REQUIRE_ALL=1."""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_harness as h


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    h.require_vllm()
    return h.build_tiny_model(h.MODEL_CACHE)


