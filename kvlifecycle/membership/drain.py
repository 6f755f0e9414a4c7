"""A drain ordered from outside the engine (``kvlifecycle drain``): every rank of a P instance is marked
``draining`` in its own key, the mark the P ranks (following their own keys), D and ``kvlifecycle proxy --etcd``
already act on.

Why the mark goes on the rank's own key, not on a key of its own: D and the proxy stop routing new requests to the
instance the moment it is written, before the P has even reacted; the key space gains nothing (``kvlifecycle doctor
--etcd`` shows the state as it is); and no order outlives its object: the mark lives on the rank's etcd lease, so
it goes with the rank, and a restarted P (a new epoch) writes a fresh ``serving`` value instead of inheriting an
old order.

The write is a compare-and-swap on the key's mod revision, under the key's own lease: it never overwrites a value
the rank rewrote meanwhile (it rereads and retries, a bounded number of times) and never extends the key's life.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from kvlifecycle.membership.etcd import EtcdSession, MembershipError
from kvlifecycle.membership.keys import (
    Member,
    MemberKey,
    MemberState,
    Role,
    decode_member,
    encode_member,
    instance_prefix,
)


@dataclass(frozen=True, slots=True)
class Rank:
    """One registered rank as etcd holds it."""

    key: MemberKey
    member: Member
    lease: int  # the etcd lease the key is attached to (0: none)
    revision: int  # the key's mod revision


def instance_ranks(session: EtcdSession, instance: str, role: Role = Role.PREFILL) -> list[Rank]:
    """The registered ranks of ``instance`` (sorted by DP, TP); keys that do not parse are left out."""
    prefix = instance_prefix(session.options.cluster, role, instance)
    resp = session.call(f"list {prefix}", lambda c: c.get_prefix_response(prefix))
    ranks = []
    for kv in resp.kvs:
        try:
            ranks.append(Rank(MemberKey.parse(kv.key), decode_member(kv.value), int(kv.lease),
                              int(kv.mod_revision)))
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
            continue
    return sorted(ranks, key=lambda r: r.key)


def _mark(client: Any, rank: Rank) -> bool:
    value = encode_member(msgspec.structs.replace(rank.member, state=MemberState.DRAINING))
    path = rank.key.path
    succeeded, _ = client.transaction(compare=[client.transactions.mod(path) == rank.revision],
                                      success=[client.transactions.put(path, value, lease=rank.lease or None)],
                                      failure=[])
    return bool(succeeded)


def order_drain(session: EtcdSession, instance: str, *, role: Role = Role.PREFILL, attempts: int = 5) -> list[Rank]:
    """Mark every rank of ``instance`` draining; returns the ranks as etcd then holds them (all draining). Raises
    :class:`MembershipError` when no rank is registered or a rank's key kept changing under ``attempts`` tries,
    :class:`~kvlifecycle.membership.etcd.EtcdUnavailableError` when etcd does not answer."""
    if Role(role) is not Role.PREFILL:
        raise MembershipError(f"only a prefill instance drains (its leases finish, then it leaves), not {role}")
    for _ in range(attempts):
        ranks = instance_ranks(session, instance, role)
        if not ranks:
            raise MembershipError(f"no {Role(role).value} instance {instance!r} is registered in cluster "
                                  f"{session.options.cluster!r}")
        pending = [r for r in ranks if r.member.state is not MemberState.DRAINING]
        if not pending:
            return ranks
        for rank in pending:  # a failed swap (the rank rewrote its key) is retried on the next listing
            session.call(f"mark {rank.key} draining", functools.partial(_mark, rank=rank))
    raise MembershipError(f"{instance!r}: a rank's key changed under each of {attempts} tries; not all ranks "
                          f"are marked draining")


def wait_departed(session: EtcdSession, instance: str, *, role: Role = Role.PREFILL, timeout_s: float,
                  poll_s: float = 0.2) -> bool:
    """Wait (at most ``timeout_s``) until no rank of ``instance`` is registered: True once they all left."""
    deadline = time.monotonic() + timeout_s
    while instance_ranks(session, instance, role):
        if time.monotonic() + poll_s > deadline:
            return False
        time.sleep(poll_s)
    return True
