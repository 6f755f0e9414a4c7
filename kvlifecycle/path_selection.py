"""Which transport moves one link's bytes: the path-selector protocol the :class:`~kvlifecycle.handoff.Consumer`
asks at every handshake for its reads, and the :class:`~kvlifecycle.handoff.Producer` for its pushes (D's
``GetMeta`` with push metadata carries D's fast-path metadata, as P's ``MetaReply`` carries P's).

The core only asks; the policy lives with the transports (``kvlifecycle.transports.select.SameNodeSelector``: CUDA
IPC when both sides hold VRAM on one node and the connect-time self-test passes, else NIXL). The default,
:data:`PRIMARY_PATH`, picks nothing special: every link stays on the Consumer's own transport.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from kvlifecycle.transport import PeerMetadata, PreparedPlan, ProbeResult, Transport


@dataclass(frozen=True, slots=True)
class PathChoice:
    """Which path a connection took (``backend``), why, and what choosing it measured. ``report`` is the
    transports' own record of the choice (handed to their selection listeners); ``probe`` what the choice's
    self-test moved."""

    backend: str
    reason: str
    measured: Mapping[str, Any] = field(default_factory=dict)
    report: Any = None
    probe: ProbeResult | None = None


@dataclass(frozen=True, slots=True)
class DataPath:
    """The transport a link's reads go through, P's name on it (``""``: the link's own agent name, on the
    Consumer's transport), and the choice that picked it (``None``: no selection took place)."""

    transport: Transport
    peer: str = ""
    choice: PathChoice | None = None


@dataclass(frozen=True, slots=True)
class PushPath:
    """Where P's writes into one D agent go: the transport that posts them (and polls, releases and notifies),
    D's name on it, the plan prepared on it, and the choice that picked it (``None``: no selection took place).

    .. versionadded:: 0.1.0"""

    transport: Transport
    peer: str
    plan: PreparedPlan
    choice: PathChoice | None = None


@runtime_checkable
class PathSelector(Protocol):
    """Picks a link's data path at the handshake."""

    def select(self, primary: Transport, fast: Transport | None, offer: PeerMetadata | None) -> DataPath:
        """``primary``: the asking side's transport (it carried the handshake, and stays the fallback); ``fast``:
        its same-node fast path, if any (registered over the same KV regions); ``offer``: the fast-path metadata
        the peer sent in its handshake (P's reply to a Consumer; D's push ``GetMeta`` to a Producer), if any.
        Returns ``DataPath(primary)`` to stay on ``primary``; a path on ``fast`` must name the peer's agent on it
        (the selector added the peer)."""
        ...


class PrimaryPath:
    """The default selector: every link stays on the Consumer's own transport."""

    def select(self, primary: Transport, fast: Transport | None, offer: PeerMetadata | None) -> DataPath:
        return DataPath(primary)


PRIMARY_PATH = PrimaryPath()
