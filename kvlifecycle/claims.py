"""Claim tokens: a lease's release is bound to the consumer that claimed it.

Without a side-channel secret, any local process that reaches P's side-channel port can send a ``LoadFailed`` for a
transfer id it saw or guessed. A claim token closes that: the claim (the consumer's first heartbeat, for consumer
index ``i`` of the lease) is answered with a fresh random token (:data:`TOKEN_BYTES` from :mod:`secrets`), and from
then on only a message carrying that token renews the lease, fails it, asks P to push into it, or completes consumer
``i`` (the ``done`` notification's payload). Consumer ``i`` can be claimed once; a second claim of it is refused.

What it does not do: a lease nobody has claimed yet has no token to check (an unclaimed lease may be kept alive or
handed back by anyone who names it); a handshake announcing the consumer's restart is self-declared, and releases
the leases bound to that consumer; and a process that can read the side-channel traffic sees the tokens. The HMAC
secret covers all three: with it, no message reaches a handler unless it was signed by a holder of the secret.

The book keeps no history: tokens never reach the event log (they are secrets, and the ledger's fold does not need
them); entries of leases that ended are pruned by the owner's service loop.
"""

from __future__ import annotations

import hmac
import secrets
import threading
from collections.abc import Callable

TOKEN_BYTES = 16


class ClaimBook:
    """Tokens by (transfer, generation, consumer index). Thread-safe."""

    def __init__(self) -> None:
        self._claims: dict[tuple[str, int], dict[int, bytes]] = {}
        # (transfer, generation) -> consumer -> when P granted the claim (its clock): later messages' transit bound
        self._claimed_at: dict[tuple[str, int], dict[int, float]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._claims)

    def claimed(self, transfer: str, generation: int) -> bool:
        with self._lock:
            return bool(self._claims.get((transfer, generation)))

    def claim(self, transfer: str, generation: int, consumer: int, *, now: float = 0.0) -> bytes | None:
        """A new token for consumer ``consumer`` of the lease, or None when that consumer is already claimed.
        ``now``: P's clock at the claim, what :meth:`claimed_at` answers."""
        with self._lock:
            slots = self._claims.setdefault((transfer, generation), {})
            if consumer in slots:
                return None
            token = slots[consumer] = secrets.token_bytes(TOKEN_BYTES)
            self._claimed_at.setdefault((transfer, generation), {})[consumer] = now
            return token

    def claimed_at(self, transfer: str, generation: int, consumer: int) -> float | None:
        """When consumer ``consumer`` of the lease was claimed (None: it was not)."""
        with self._lock:
            return self._claimed_at.get((transfer, generation), {}).get(consumer)

    def unclaim(self, transfer: str, generation: int, consumer: int) -> None:
        """Take back a token that was never handed out (the ledger refused the claim)."""
        with self._lock:
            slots = self._claims.get((transfer, generation))
            if slots is not None:
                slots.pop(consumer, None)
                self._claimed_at.get((transfer, generation), {}).pop(consumer, None)
                if not slots:
                    del self._claims[(transfer, generation)]
                    self._claimed_at.pop((transfer, generation), None)

    def check(self, transfer: str, generation: int, token: bytes, *, consumer: int | None = None,
              unclaimed_ok: bool = False) -> str:
        """"" when ``token`` is the lease's claim token (of ``consumer``, when given), else why not.

        ``unclaimed_ok``: a message without a token is accepted while nobody has claimed the lease."""
        with self._lock:
            slots = self._claims.get((transfer, generation), {})
            if not token:
                if unclaimed_ok and not slots:
                    return ""
                return "claim token: none presented" + (" (the lease is claimed)" if slots else "")
            if consumer is not None:
                mine = slots.get(consumer)
                candidates = [] if mine is None else [mine]
            else:
                candidates = list(slots.values())
            # compare against every candidate (constant time each): no early exit tells which one was close
            matched = [hmac.compare_digest(token, known) for known in candidates]
            return "" if any(matched) else "claim token: not the claimant's"

    def prune(self, live: Callable[[str, int], bool]) -> int:
        """Forget the claims of leases that ended (``live(transfer, generation)`` is false); returns how many."""
        with self._lock:
            gone = [key for key in self._claims if not live(*key)]
            for key in gone:
                del self._claims[key]
                self._claimed_at.pop(key, None)
            return len(gone)
