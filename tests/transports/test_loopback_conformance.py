"""The packaged conformance suite against the loopback transport (host memory)."""

from __future__ import annotations

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.testing.transport_conformance import TransportConformance


class TestLoopbackConformance(TransportConformance):
    def make_transport(self, name: str) -> LoopbackTransport:
        return LoopbackTransport(name)
