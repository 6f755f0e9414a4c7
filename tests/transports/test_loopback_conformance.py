from __future__ import annotations

from transport_conformance import TransportConformance

from kvlifecycle.transports.loopback import LoopbackTransport


class TestLoopbackConformance(TransportConformance):
    def make_transport(self, name: str) -> LoopbackTransport:
        return LoopbackTransport(name)
