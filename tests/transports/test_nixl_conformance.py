"""The conformance suite against real NIXL (UCX, DRAM), two agents in one process."""

from __future__ import annotations

import os

import pytest
from transport_conformance import TransportConformance


def _require_nixl() -> None:
    """Skip without NIXL, except in CI (KVL_REQUIRE_ALL=1), where a missing NIXL is a failure."""
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        if os.environ.get("KVL_REQUIRE_ALL") == "1":
            raise RuntimeError(f"KVL_REQUIRE_ALL=1 but NIXL is missing: {exc}") from exc
        pytest.skip("needs the real NIXL package (pip install nixl==1.5.1)", allow_module_level=True)


_require_nixl()

from kvlifecycle.transports.nixl import NixlTransport  # noqa: E402

pytestmark = pytest.mark.nixl


class TestNixlConformance(TransportConformance):
    def make_transport(self, name: str) -> NixlTransport:
        return NixlTransport(name)
