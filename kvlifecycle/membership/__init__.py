"""Membership across hosts through etcd: who the P and D ranks are, where their side channels listen, and whether
their agent epochs are alive.

Reading path: :mod:`.keys` (the key space and the value), :mod:`.etcd` (the one module that talks to etcd, and
why this client), :mod:`.registration` (a rank's key under a kept-alive lease), :mod:`.fencing` (why each of its
later writes applies only while its own lease holds the key), :mod:`.watcher` (joins and losses as callbacks), then
the two bindings to the handoff: :mod:`.presence` (P: register, drain; D: register, fence) and :mod:`.directory` (D:
connect to new P ranks, invalidate lost ones; P: release a lost D's leases); for a router, :mod:`.instances` (the
routable P and D engine instances, as ``kvlifecycle proxy --etcd`` follows them); for an operator, :mod:`.drain` (a
drain ordered from outside, as ``kvlifecycle drain`` writes it).

Without etcd nothing here is used: the embedded default (addresses in ``kv_transfer_params``) works unchanged.
The etcd client (``pip install kvlifecycle[etcd]``) is imported only when a session first talks to etcd.
"""

from kvlifecycle.membership.directory import ConsumerDirectory, PeerEvent, ProducerDirectory
from kvlifecycle.membership.drain import Rank, instance_ranks, order_drain, wait_departed
from kvlifecycle.membership.etcd import (
    Backoff,
    EtcdClientMissingError,
    EtcdOptions,
    EtcdSession,
    EtcdUnavailableError,
    MembershipError,
)
from kvlifecycle.membership.instances import Instance, InstanceDirectory
from kvlifecycle.membership.keys import ROOT, Member, MemberKey, MemberState, Role, decode_member, encode_member
from kvlifecycle.membership.presence import ConsumerPresence, DrainingError, ProducerPresence
from kvlifecycle.membership.registration import Departure, Registration, StaleRegistrationError, SupersededError
from kvlifecycle.membership.watcher import PeerWatcher

__all__ = [
    "ROOT",
    "Backoff",
    "ConsumerDirectory",
    "ConsumerPresence",
    "Departure",
    "DrainingError",
    "EtcdClientMissingError",
    "EtcdOptions",
    "EtcdSession",
    "EtcdUnavailableError",
    "Instance",
    "InstanceDirectory",
    "Member",
    "MemberKey",
    "MemberState",
    "MembershipError",
    "PeerEvent",
    "PeerWatcher",
    "ProducerDirectory",
    "ProducerPresence",
    "Rank",
    "Registration",
    "Role",
    "StaleRegistrationError",
    "SupersededError",
    "decode_member",
    "encode_member",
    "instance_ranks",
    "order_drain",
    "wait_departed",
]
