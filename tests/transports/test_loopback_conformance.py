from __future__ import annotations

from kvlifecycle.transports.loopback import LoopbackTransport
from transport_conformance import TransportConformance


class TestLoopbackConformance(TransportConformance):
    def make_transport(self, name: str) -> LoopbackTransport:
        return LoopbackTransport(name)
