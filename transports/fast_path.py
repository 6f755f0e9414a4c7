"""A fast path, as the same-node selector (:class:`kvlifecycle.transports.select.SameNodeSelector`) walks it: a
transport beside the side's own one that answers one question per peer at the handshake, "do you take this
peer?", with the path it took (the peer added, the choice reported) or a :class:`Refusal` saying why not."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvlifecycle.path_selection import DataPath
from kvlifecycle.transport import PeerMetadata


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a fast path does not take a peer (kept in the link's :class:`~kvlifecycle.path_selection.PathChoice`)."""

    reason: str


class FastPath(Protocol):
    """One fast path over a registered transport."""

    name: str  # the backend it reports when it takes a peer ("cuda_ipc", "cuda_ipc+nixl")

    def try_peer(self, offer: PeerMetadata | None) -> DataPath | Refusal:
        """Take the peer whose handshake offered ``offer`` (its fast-path metadata, if any): add it, report the
        choice and return the path (its transport, the peer's name on it and the
        :class:`~kvlifecycle.path_selection.PathChoice`); or refuse, adding nothing."""
        ...
