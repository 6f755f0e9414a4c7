"""The grants D fetched for requests whose loads have not started: each (request, P rank) fetched once, and the
announced ones renewed until their load starts or the request goes. Thread-safe: the engine's thread adds and
takes them, D's service thread asks which renewals are due."""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from kvlifecycle.control import GrantReply

__all__ = ["GrantCountError", "HeldGrant", "HeldGrants"]

RENEWALS_PER_TTL = 6  # an announced lease is renewed every TTL / 6: five renewals may go unanswered before it expires


class GrantCountError(ValueError):
    """P counts its lease's consumers for another D TP size than this D's: a read would release it too early or
    never (P must count the D ranks of this D's TP size)."""


@dataclass(slots=True)
class HeldGrant:
    address: str  # the P rank's side channel
    grant: GrantReply
    renew: bool  # announced: renewed until the load starts
    last_renewal: float = -math.inf


class HeldGrants:
    """The grants of requests not loading yet, keyed by (D request, P rank address)."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, str], HeldGrant] = {}
        self._lock = threading.Lock()

    def get(self, request: str, address: str) -> GrantReply | None:
        with self._lock:
            held = self._held.get((request, address))
            return held.grant if held is not None else None

    def put(self, request: str, address: str, grant: GrantReply, *, renew: bool) -> None:
        with self._lock:
            held = self._held.get((request, address))
            if held is None or held.grant != grant:
                self._held[(request, address)] = HeldGrant(address, grant, renew)
            else:
                held.renew = held.renew or renew

    def stop_renewing(self, request: str, address: str | None = None) -> None:
        """``request``'s leases (on ``address`` alone, if named) are no longer renewed: gone, or claimed."""
        with self._lock:
            for (req, addr), held in self._held.items():
                if req == request and address in (None, addr):
                    held.renew = False

    def drop(self, request: str) -> list[tuple[str, GrantReply]]:
        """Forget ``request``'s grants; returns them as (P address, grant)."""
        with self._lock:
            keys = [key for key in self._held if key[0] == request]
            return [(key[1], self._held.pop(key).grant) for key in keys]

    def due(self, now: float) -> list[tuple[str, HeldGrant]]:
        """The (request, held grant) renewals due at ``now``, marked as renewed then."""
        out = []
        with self._lock:
            for (request, _), held in self._held.items():
                if held.renew and now - held.last_renewal >= held.grant.ttl_s / RENEWALS_PER_TTL:
                    held.last_renewal = now
                    out.append((request, held))
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)
