"""Test helpers shipped with the library: the transport conformance suite (:mod:`.transport_conformance`), which
any transport, a third party's too, can run by subclassing :class:`~.transport_conformance.TransportConformance`.
Importing it needs pytest, never torch."""
