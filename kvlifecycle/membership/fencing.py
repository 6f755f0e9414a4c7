"""A member's writes to its own key, fenced: each is one etcd transaction that applies only while the key is still
the writer's, so an old incarnation can neither overwrite nor delete its successor's key.

Why: in a rolling restart with a stable engine id, the new incarnation registers under the same key while the old
one is still draining. An unconditional ``put`` of the old one's ``draining`` mark, or its ``delete`` at the end,
would land on the successor's key: watchers would drop the live successor and etcd would end with no rank
registered, while the successor's keep-alive stays healthy on a lease that no longer holds its key. etcd's own
election and lock recipes guard every write the same way (``Txn().If(...)``).

- Ownership is the key's *lease*: an etcd lease is granted to one incarnation only, so "the key is on my lease"
  means no successor has written it since. An ordered drain's mark (:mod:`.drain`) is written on the rank's own
  lease, so it does not change the owner. etcd compares a missing key's lease as 0, which is never ours: a write
  after the key vanished fails too (a vanished key was reported lost to every watcher; reviving it is not ours to
  do). The compare target ``LEASE`` exists since etcd 3.3; ``pyetcd`` has no builder for it, hence :class:`_LeaseIs`.
- A registration (and a re-registration) is a compare-and-swap on the key's mod revision as last read (0: absent),
  so two incarnations registering at once cannot both win on a stale read.
- A failed compare answers with the key as it is now (:class:`Holder`), so the caller can say who holds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from kvlifecycle.membership.keys import Member, decode_member


@dataclass(frozen=True, slots=True)
class Holder:
    """The key as etcd holds it: its value (None: not a Member), its lease (0: none) and its mod revision."""

    member: Member | None
    lease: int
    revision: int

    def describe(self) -> str:
        who = "an unreadable value" if self.member is None else (
            f"agent {self.member.agent} epoch {self.member.epoch} ({self.member.state.value})")
        return f"{who} under lease {self.lease:x}"


@dataclass(frozen=True, slots=True)
class TxnOutcome:
    """Whether the write applied; else the key as it is now (None: absent)."""

    applied: bool
    holder: Holder | None


class _LeaseIs:
    """etcd's compare "the key is attached to ``lease_id``" (``pyetcd`` builds only version, create, mod, value)."""

    def __init__(self, path: str, lease_id: int) -> None:
        self.path, self.lease_id = path, lease_id

    def build_message(self) -> Any:
        from pyetcd import etcdrpc  # the client is imported only when a session talks to etcd (see .etcd)

        return etcdrpc.Compare(key=self.path.encode(), result=etcdrpc.Compare.EQUAL,
                               target=etcdrpc.Compare.LEASE, lease=self.lease_id)


def _holder(value: bytes, metadata: Any) -> Holder:
    try:
        member: Member | None = decode_member(value)
    except (msgspec.DecodeError, msgspec.ValidationError):
        member = None
    return Holder(member, int(metadata.lease_id), int(metadata.mod_revision))


def read_holder(client: Any, path: str) -> Holder | None:
    """The key as it is now (None: absent)."""
    value, metadata = client.get(path)
    return None if metadata is None else _holder(value, metadata)


def _txn(client: Any, path: str, compare: Any, write: Any) -> TxnOutcome:
    succeeded, responses = client.transaction(compare=[compare], success=[write],
                                              failure=[client.transactions.get(path)])
    if succeeded:
        return TxnOutcome(True, None)
    found = responses[0] if responses else []
    return TxnOutcome(False, _holder(*found[0]) if found else None)


def put_if_owned(client: Any, path: str, value: bytes, lease_id: int) -> TxnOutcome:
    """Rewrite the key, on the same lease, only while it is attached to ``lease_id``."""
    return _txn(client, path, _LeaseIs(path, lease_id), client.transactions.put(path, value, lease=lease_id))


def delete_if_owned(client: Any, path: str, lease_id: int) -> TxnOutcome:
    """Delete the key only while it is attached to ``lease_id``."""
    return _txn(client, path, _LeaseIs(path, lease_id), client.transactions.delete(path))


def put_if_unchanged(client: Any, path: str, value: bytes, lease_id: int, revision: int) -> TxnOutcome:
    """Put the key on ``lease_id`` only if its mod revision is still ``revision`` (0: only if it is absent)."""
    return _txn(client, path, client.transactions.mod(path) == revision,
                client.transactions.put(path, value, lease=lease_id))
