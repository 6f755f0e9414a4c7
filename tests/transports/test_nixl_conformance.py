"""The conformance suite against real NIXL (UCX, DRAM), two agents in one process."""

from __future__ import annotations

import pytest
from transport_conformance import TransportConformance

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.nixl import NixlTransport

pytestmark = pytest.mark.nixl


class TestNixlConformance(TransportConformance):
    def make_transport(self, name: str) -> NixlTransport:
        return NixlTransport(name)
