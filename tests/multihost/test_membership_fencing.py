"""Fenced membership against a real etcd (127.0.0.1): a member's writes after registering apply only while its own
lease holds its key, so an old incarnation (a rolling restart with a stable engine id) can neither overwrite nor
delete its successor's key; a member whose key vanished or changed owner notices within a TTL.

Nothing here is timed: waits are bounded liveness checks (a few TTLs); how fast a loss was noticed is printed.
"What the watchers saw" is read after a barrier (a sentinel key's join): etcd delivers a watch's events in order,
so every earlier change has been reported by then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import etcd_harness as eh
import pytest
from vllm_adapter_modules import load_vllm_adapter_module

from kvlifecycle.membership import (
    EtcdOptions,
    EtcdSession,
    EtcdUnavailableError,
    Member,
    MemberKey,
    MemberState,
    PeerWatcher,
    ProducerPresence,
    Registration,
    Role,
    StaleRegistrationError,
    encode_member,
)
from kvlifecycle.membership import registration as registration_module
from kvlifecycle.membership.fencing import Holder, TxnOutcome, read_holder
from kvlifecycle.membership.registration import Departure, SupersededError

pytestmark = pytest.mark.multihost

TTL_S = 2
P0 = MemberKey("t", Role.PREFILL, "p0", 0, 0)
ADDRESS = "tcp://h:1"


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def session_for(server: eh.EtcdServer, cluster: str = "t") -> EtcdSession:
    return EtcdSession(EtcdOptions((server.endpoint,), cluster=cluster, lease_ttl_s=TTL_S, request_timeout_s=1.0,
                                   backoff_max_s=0.5))


class Recorder:
    """What a watcher of the prefill keys reported, as (kind, agent, epoch, state)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, MemberState]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str) -> Callable[[MemberKey, Member], None]:
        def record(_key: MemberKey, member: Member) -> None:
            with self.lock:
                self.events.append((kind, member.agent, member.epoch, member.state))
        return record

    def seen(self) -> list[tuple[str, str, int, MemberState]]:
        with self.lock:
            return list(self.events)


def watch(server: eh.EtcdServer, rec: Recorder, cluster: str = "t") -> PeerWatcher:
    watcher = PeerWatcher(session_for(server, cluster), Role.PREFILL, on_joined=rec("joined"), on_lost=rec("lost"),
                          on_updated=rec("updated"))
    watcher.start()
    return watcher


def barrier(server: eh.EtcdServer, rec: Recorder, cluster: str = "t") -> None:
    """Return once the watcher has reported every change made before this call."""
    sentinel = Registration(session_for(server, cluster), MemberKey(cluster, Role.PREFILL, "barrier"),
                            Member("tcp://barrier:1", "barrier", time.monotonic_ns()))
    sentinel.register()
    try:
        assert wait_for(lambda: any(e[0] == "joined" and e[1] == "barrier" for e in rec.seen()), 4 * TTL_S)
    finally:
        sentinel.deregister()
        sentinel.session.close()


def holder_of(server: eh.EtcdServer, path: str) -> Holder | None:
    session = session_for(server)
    try:
        return session.call("read", lambda c: read_holder(c, path))
    finally:
        session.close()


def lease_alive(server: eh.EtcdServer, lease_id: int) -> bool:
    session = session_for(server)
    try:
        return int(session.call("lease info", lambda c: c.get_lease_info(lease_id)).TTL) > 0
    finally:
        session.close()


def without_barrier(events: list[tuple[str, str, int, MemberState]]) -> list[tuple[str, str, int, MemberState]]:
    return [e for e in events if e[1] != "barrier"]


SERVING, DRAINING = MemberState.SERVING, MemberState.DRAINING


# -- (1) a rolling restart with the same engine id ---------------------------------------------------------------------
def test_old_member_marking_itself_draining_after_its_successor_registered_leaves_the_successor_key(
        local_etcd: eh.EtcdServer) -> None:
    rec = Recorder()
    old = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 1))
    new = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 2))
    old.register()
    watcher = watch(local_etcd, rec)
    try:
        new.register()
        assert new.lease_id is not None and new.lease_id != old.lease_id
        with pytest.raises(SupersededError, match=r"not marked draining: the key now holds agent p0 epoch 2"):
            old.set_state(DRAINING)
        now = holder_of(local_etcd, P0.path)
        assert now is not None and (now.member, now.lease) == (new.member, new.lease_id)
        assert old.member.state is SERVING  # the refused mark is not taken as written
        barrier(local_etcd, rec)
        assert without_barrier(rec.seen()) == [("joined", "p0", 1, SERVING), ("lost", "p0", 1, SERVING),
                                               ("joined", "p0", 2, SERVING)]  # epoch 2 never dropped
        # the old keep-alive notices its key changed owner, and stops: its epoch is dead
        assert wait_for(lambda: old.lost, 2 * TTL_S)
        assert old.lost_reason is not None and "agent p0 epoch 2" in old.lost_reason
        assert wait_for(lambda: not lease_alive(local_etcd, old.lease_id or 0), 2 * TTL_S)  # revoked: held nothing
        keepalives = new.keepalives
        assert wait_for(lambda: new.keepalives >= keepalives + 2, 4 * TTL_S) and not new.lost
        assert new.deregister() is Departure.DELETED
        assert holder_of(local_etcd, P0.path) is None
    finally:
        watcher.close()
        old.close()
        new.close()


class LedgerDouble:
    def __init__(self, *leases: str) -> None:
        self.leases: dict[str, object] = {name: object() for name in leases}


@dataclass
class ProducerDouble:
    """What ProducerPresence reads of a Producer: address, transport (agent, epoch, name), TP rank, ledger."""

    epoch: int
    address: str = ADDRESS
    tp_rank: int = 0
    transport: SimpleNamespace = field(init=False)
    ledger: LedgerDouble = field(default_factory=LedgerDouble)

    def __post_init__(self) -> None:
        self.transport = SimpleNamespace(agent="p0", epoch=self.epoch, name="nixl")


def test_rolling_restart_with_the_same_engine_id_while_the_old_member_drains(local_etcd: eh.EtcdServer) -> None:
    """The old P starts draining (a live lease holds it), the new P registers under the same key, then the old P's
    last lease ends and it leaves: the new P's key stays, serving, on the new P's lease."""
    rec = Recorder()
    old_producer = ProducerDouble(1, ledger=LedgerDouble("in-flight"))
    old = ProducerPresence(old_producer, session_for(local_etcd), "p0")  # type: ignore[arg-type]
    new = ProducerPresence(ProducerDouble(2), session_for(local_etcd), "p0")  # type: ignore[arg-type]
    old.register()
    watcher = watch(local_etcd, rec)
    result: list[bool] = []
    drainer = threading.Thread(target=lambda: result.append(old.drain(timeout_s=30.0, poll_s=0.01)), daemon=True)
    try:
        drainer.start()
        assert wait_for(lambda: ("updated", "p0", 1, DRAINING) in rec.seen(), 4 * TTL_S)
        new.register()
        assert drainer.is_alive()  # the live lease holds the old P's drain
        old_producer.ledger.leases.clear()  # its last lease ends: the old P leaves
        drainer.join(4 * TTL_S + 10)
        assert result == [True]
        assert old.registration.departure is Departure.SUPERSEDED
        now = holder_of(local_etcd, P0.path)
        assert now is not None and now.member == new.registration.member and now.member.state is SERVING
        assert now.lease == new.registration.lease_id
        barrier(local_etcd, rec)
        assert without_barrier(rec.seen()) == [("joined", "p0", 1, SERVING), ("updated", "p0", 1, DRAINING),
                                               ("lost", "p0", 1, DRAINING), ("joined", "p0", 2, SERVING)]
        assert not new.registration.lost
    finally:
        watcher.close()
        old.close()
        new.close()


# -- (2) the old member's deregister after the new one registered ------------------------------------------------------
def old_deregister_after_successor_registered(server: eh.EtcdServer) -> None:
    """The scenario, as a function the mutant test runs too: fails (AssertionError) if the old member's leaving
    touched its successor's key."""
    rec = Recorder()
    old = Registration(session_for(server), P0, Member(ADDRESS, "p0", 1))
    new = Registration(session_for(server), P0, Member(ADDRESS, "p0", 2))
    old.register()
    watcher = watch(server, rec)
    try:
        new.register()
        old_lease = old.lease_id or 0
        departure = old.deregister()
        now = holder_of(server, P0.path)
        assert now is not None and (now.member, now.lease) == (new.member, new.lease_id), \
            f"the old member's deregister changed its successor's key: {now}"
        assert departure is Departure.SUPERSEDED
        assert not lease_alive(server, old_lease)  # its own lease is revoked all the same
        barrier(server, rec)
        assert without_barrier(rec.seen()) == [("joined", "p0", 1, SERVING), ("lost", "p0", 1, SERVING),
                                               ("joined", "p0", 2, SERVING)]
        assert new.deregister() is Departure.DELETED
        assert old.deregister() is Departure.NOT_REGISTERED
    finally:
        watcher.close()
        old.close()
        new.close()


def test_old_member_deregistering_after_its_successor_registered_leaves_the_successor_key(
        local_etcd: eh.EtcdServer) -> None:
    old_deregister_after_successor_registered(local_etcd)


@pytest.mark.mutants
def test_mutant_unconditional_delete_in_deregister_is_caught(local_etcd: eh.EtcdServer,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: ``deregister`` deletes the key whoever holds it (the code before fencing)."""

    def unconditional_delete(client: Any, path: str, lease_id: int) -> TxnOutcome:
        client.delete(path)
        return TxnOutcome(True, None)

    monkeypatch.setattr(registration_module, "delete_if_owned", unconditional_delete)
    with pytest.raises(AssertionError, match="changed its successor's key"):
        old_deregister_after_successor_registered(local_etcd)


# -- the registration itself is a compare-and-swap ---------------------------------------------------------------------
def test_a_registration_whose_read_went_stale_does_not_overwrite_a_newer_epoch(
        local_etcd: eh.EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Epoch 2 registers between epoch 1's read of the (absent) key and its put: epoch 1's put does not apply, its
    reread finds the newer epoch and it is refused; its lease is revoked."""
    old = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 1))
    new = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 2))
    real_read = registration_module.read_holder
    reads: list[Holder | None] = []

    def read_then_successor_registers(client: Any, path: str) -> Holder | None:
        found = real_read(client, path)
        reads.append(found)
        if len(reads) == 1:
            new.register()  # the interleaving, for real: etcd now holds epoch 2
        return found

    monkeypatch.setattr(registration_module, "read_holder", read_then_successor_registers)
    granted: list[int] = []
    real_call = old.session.call

    def recording_call(what: str, fn: Callable[[Any], Any]) -> Any:
        out = real_call(what, fn)
        if what.startswith("grant"):
            granted.append(int(out.id))
        return out

    monkeypatch.setattr(old.session, "call", recording_call)
    try:
        with pytest.raises(StaleRegistrationError, match="already holds epoch 2 > 1"):
            old.register()
        assert reads[0] is None  # old's read, before the successor's put
        last = reads[-1]  # old's reread after its swap failed
        assert last is not None and last.member == new.member
        now = holder_of(local_etcd, P0.path)
        assert now is not None and (now.member, now.lease) == (new.member, new.lease_id)
        assert len(granted) == 1 and not lease_alive(local_etcd, granted[0])
    finally:
        old.close()
        new.deregister()


def test_a_registration_whose_put_answer_was_lost_retries_without_killing_its_epoch(
        local_etcd: eh.EtcdServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The put applied but its answer never came: the retry finds its own epoch in the key and moves it to the new
    lease; no watcher sees this epoch go (revoking the first lease would have deleted the key)."""
    rec = Recorder()
    watcher = watch(local_etcd, rec)
    reg = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 1))
    real_call = reg.session.call
    unanswered: list[TxnOutcome] = []

    def answer_of_first_put_lost(what: str, fn: Callable[[Any], Any]) -> Any:
        out = real_call(what, fn)
        if what.startswith("put") and not unanswered:
            unanswered.append(out)
            raise EtcdUnavailableError("the answer to the put was lost")
        return out

    monkeypatch.setattr(reg.session, "call", answer_of_first_put_lost)
    try:
        reg.register(retry_for_s=20.0)
        assert unanswered[0].applied
        now = holder_of(local_etcd, P0.path)
        assert now is not None and (now.member, now.lease) == (reg.member, reg.lease_id)
        barrier(local_etcd, rec)
        assert without_barrier(rec.seen()) == [("joined", "p0", 1, SERVING)]
    finally:
        watcher.close()
        reg.deregister()


# -- (3) the vLLM connector's shutdown path ----------------------------------------------------------------------------
def test_vllm_connector_shutdown_of_the_old_p_leaves_the_new_p_registered(local_etcd: eh.EtcdServer) -> None:
    """Two vLLM P workers with the same engine id (a rolling restart): the old one's shutdown (WorkerMembership.stop,
    what the connector's worker calls: mark draining, wait for leases, deregister) leaves the new one's key."""
    config_module, membership_module = load_vllm_adapter_module("config"), load_vllm_adapter_module("membership")
    config = config_module.AdapterConfig.from_extra({
        "etcd_endpoints": local_etcd.endpoint, "etcd_cluster": "vllm", "etcd_lease_ttl_s": TTL_S,
        "api_address": "127.0.0.1:8100", "drain_timeout_s": 5.0})
    rec = Recorder()
    [old] = membership_module.WorkerMembership.start(config, "eng-p", producer=ProducerDouble(1))
    watcher = watch(local_etcd, rec, cluster="vllm")
    news: list[Any] = []
    try:
        assert old.joined.wait(20)
        news = membership_module.WorkerMembership.start(config, "eng-p", producer=ProducerDouble(2))
        assert news[0].joined.wait(20)
        new_registration = news[0].presence.registration
        old.stop()
        now = holder_of(local_etcd, "/kvlifecycle/v1/vllm/prefill/eng-p/0/0")
        assert now is not None and now.member is not None
        assert (now.member.epoch, now.member.state, now.lease) == (2, SERVING, new_registration.lease_id)
        assert old.presence.registration.departure is Departure.SUPERSEDED
        barrier(local_etcd, rec, cluster="vllm")
        seen = without_barrier(rec.seen())
        assert ("lost", "p0", 2, SERVING) not in seen and ("updated", "p0", 2, DRAINING) not in seen
        assert seen[-1] == ("joined", "p0", 2, SERVING)
        keepalives = new_registration.keepalives
        assert wait_for(lambda: new_registration.keepalives >= keepalives + 2, 4 * TTL_S)
        assert not new_registration.lost
        news[0].stop()
        assert holder_of(local_etcd, "/kvlifecycle/v1/vllm/prefill/eng-p/0/0") is None
    finally:
        watcher.close()
        for membership in [old, *news]:
            membership.presence.close()


# -- (4) a key that vanished or changed owner is noticed ---------------------------------------------------------------
def key_deleted_by_someone_else_is_noticed(server: eh.EtcdServer) -> None:
    """The scenario, as a function the mutant test runs too."""
    lost_at: list[float] = []
    reg = Registration(session_for(server), P0, Member(ADDRESS, "p0", 1),
                       on_lease_lost=lambda _k, _m: lost_at.append(time.monotonic()))
    reg.register()
    other = session_for(server)
    try:
        other.call("delete", lambda c: c.delete(P0.path))
        deleted = time.monotonic()
        assert wait_for(lambda: bool(lost_at), 2 * TTL_S), "the member did not notice its key was deleted"
        print(f"\nkey deleted by someone else: noticed after {lost_at[0] - deleted:.3f}s "
              f"(TTL {TTL_S}s, keep-alive every {reg.session.options.keepalive_interval_s:.2f}s)")
        assert reg.lost and reg.lost_reason is not None and "the key is gone" in reg.lost_reason
        assert not lease_alive(server, reg.lease_id or 0)  # the lease held nothing: revoked
        assert holder_of(server, P0.path) is None  # the dead epoch is not resurrected
        assert reg.deregister() is Departure.ALREADY_GONE
    finally:
        reg.close()
        other.close()


def test_a_member_whose_key_someone_deleted_notices_within_a_ttl_and_stops(local_etcd: eh.EtcdServer) -> None:
    key_deleted_by_someone_else_is_noticed(local_etcd)


@pytest.mark.mutants
def test_mutant_keepalive_without_the_owner_check_is_caught(local_etcd: eh.EtcdServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the keep-alive refreshes the lease and never looks at the key (the code before fencing)."""
    monkeypatch.setattr(Registration, "_still_ours", lambda _self, _lease_id: True)
    with pytest.raises(AssertionError, match="did not notice its key was deleted"):
        key_deleted_by_someone_else_is_noticed(local_etcd)


def test_a_member_whose_key_another_agent_took_stops_and_one_holding_its_own_epoch_is_reclaimed(
        local_etcd: eh.EtcdServer) -> None:
    other = session_for(local_etcd)
    reg = Registration(session_for(local_etcd), P0, Member(ADDRESS, "p0", 3))
    thief = Member(ADDRESS, "p9", 1)
    try:
        reg.register()
        lease_id = reg.lease_id or 0
        # this agent's own epoch under no lease (a plain put by hand): no watcher dropped it, so it is put back
        other.call("put", lambda c: c.put(P0.path, encode_member(Member(ADDRESS, "p0", 3, DRAINING))))
        assert wait_for(lambda: reg.reregistrations == 1, 2 * TTL_S)
        now = holder_of(local_etcd, P0.path)
        assert now is not None and now.lease == lease_id and now.member == Member(ADDRESS, "p0", 3, DRAINING)
        assert not reg.lost
        # another agent's value: this epoch was reported lost by every watcher; the registration stops
        other.call("put", lambda c: c.put(P0.path, encode_member(thief)))
        assert wait_for(lambda: reg.lost, 2 * TTL_S)
        assert reg.lost_reason is not None and "agent p9 epoch 1" in reg.lost_reason
        with pytest.raises(SupersededError):
            reg.set_state(SERVING)
        assert reg.deregister() is Departure.SUPERSEDED
        now = holder_of(local_etcd, P0.path)
        assert now is not None and now.member == thief  # left alone
    finally:
        reg.close()
        other.close()
