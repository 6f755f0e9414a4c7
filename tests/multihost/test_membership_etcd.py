"""Membership against a real etcd (on 127.0.0.1 here; the host tests put it in a namespace of its own).

Every wait is bounded (a few lease TTLs); the loss latency is printed, not asserted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import etcd_harness as eh
import pytest

from kvlifecycle.membership import (
    EtcdOptions,
    EtcdSession,
    EtcdUnavailableError,
    Member,
    MemberKey,
    MemberState,
    PeerWatcher,
    Registration,
    Role,
    StaleRegistrationError,
    decode_member,
    encode_member,
)

TTL_S = 2


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, MemberKey, Member, float]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str) -> Callable[[MemberKey, Member], None]:
        def record(key: MemberKey, member: Member) -> None:
            with self.lock:
                self.events.append((kind, key, member, time.monotonic()))
        return record

    def kinds(self) -> list[tuple[str, str, int]]:
        with self.lock:
            return [(kind, member.agent, member.epoch) for kind, _, member, _ in self.events]


def session_for(server: eh.EtcdServer, **kw: object) -> EtcdSession:
    return EtcdSession(EtcdOptions((server.endpoint,), cluster="t", lease_ttl_s=TTL_S, request_timeout_s=1.0,
                                   backoff_max_s=0.5, **kw))


def watch(session: EtcdSession, rec: Recorder) -> PeerWatcher:
    watcher = PeerWatcher(session, Role.PREFILL, on_joined=rec("joined"), on_lost=rec("lost"),
                          on_updated=rec("updated"))
    watcher.start()
    return watcher


P0 = MemberKey("t", Role.PREFILL, "p0", 0, 1)


def test_key_and_value_round_trip_and_validation() -> None:
    assert P0.path == "/kvlifecycle/v1/t/prefill/p0/0/1"
    assert MemberKey.parse(P0.path.encode()) == P0
    member = Member("tcp://10.0.0.1:5600", "p0", 7)
    assert decode_member(encode_member(member)) == member
    for bad in ("a/b", "", "x" * 200):
        with pytest.raises(ValueError):
            MemberKey("t", Role.PREFILL, bad)
    with pytest.raises(ValueError, match="lease_ttl_s"):
        EtcdOptions(("127.0.0.1:2379",), lease_ttl_s=1)
    with pytest.raises(ValueError, match="host:port"):
        EtcdOptions(("nowhere",))
    assert EtcdOptions("a:1,b:2").endpoints == ("a:1", "b:2")


@pytest.mark.multihost
def test_dead_worker_is_reported_lost_when_its_lease_expires(local_etcd: eh.EtcdServer) -> None:
    rec = Recorder()
    session, watcher_session = session_for(local_etcd), session_for(local_etcd)
    reg = Registration(session, P0, Member("tcp://h:1", "p0", 1))
    reg.register()
    watcher = watch(watcher_session, rec)
    try:
        assert rec.kinds() == [("joined", "p0", 1)]
        assert wait_for(lambda: reg.keepalives >= 2, 5 * TTL_S)  # kept alive past its TTL
        assert rec.kinds() == [("joined", "p0", 1)]
        reg.close()  # the worker dies: no more keep-alives, no goodbye
        died = time.monotonic()
        assert wait_for(lambda: len(rec.kinds()) == 2, 4 * TTL_S)
        assert rec.kinds()[1] == ("lost", "p0", 1)
        print(f"\nlease TTL {TTL_S}s: loss seen {rec.events[1][3] - died:.2f}s after the last keep-alive stopped")
        assert watcher.peers() == {}
    finally:
        watcher.close()
        reg.close()


@pytest.mark.multihost
def test_restart_before_expiry_replaces_the_old_epoch_and_an_old_epoch_is_refused(
        local_etcd: eh.EtcdServer) -> None:
    rec = Recorder()
    session = session_for(local_etcd)
    old = Registration(session, P0, Member("tcp://h:1", "p0", 1))
    old.register()
    watcher = watch(session_for(local_etcd), rec)
    new = Registration(session, P0, Member("tcp://h:1", "p0", 2))
    try:
        old.close()  # crashed; its lease has not run out yet
        new.register()
        assert wait_for(lambda: len(rec.kinds()) == 3, 4 * TTL_S)
        assert rec.kinds() == [("joined", "p0", 1), ("lost", "p0", 1), ("joined", "p0", 2)]
        with pytest.raises(StaleRegistrationError):
            Registration(session, P0, Member("tcp://h:1", "p0", 1)).register()
        # the old lease running out later deletes nothing of the new epoch's
        time.sleep(TTL_S + 1.5)
        assert [m.epoch for m in watcher.peers().values()] == [2]
        new.set_state(MemberState.DRAINING)
        assert wait_for(lambda: len(rec.kinds()) == 4, 4 * TTL_S)
        assert rec.events[3][0] == "updated" and rec.events[3][2].state is MemberState.DRAINING
        new.deregister()
        assert wait_for(lambda: len(rec.kinds()) == 5, 4 * TTL_S)
        assert rec.events[4][0] == "lost" and rec.events[4][2].state is MemberState.DRAINING
    finally:
        watcher.close()
        new.close()


@pytest.mark.multihost
def test_etcd_outage_keeps_peers_fails_new_registrations_clearly_and_recovers(local_etcd: eh.EtcdServer) -> None:
    rec = Recorder()
    reg = Registration(session_for(local_etcd), P0, Member("tcp://h:1", "p0", 1))
    reg.register()
    watcher = watch(session_for(local_etcd), rec)
    late_key = MemberKey("t", Role.PREFILL, "p1")
    late = Registration(session_for(local_etcd), late_key, Member("tcp://h:2", "p1", 5))
    try:
        local_etcd.stop()
        assert wait_for(lambda: reg.keepalive_failures >= 2, 10 * TTL_S)
        assert wait_for(lambda: not watcher.connected.is_set(), 10 * TTL_S)
        with pytest.raises(EtcdUnavailableError, match=local_etcd.endpoint):
            late.register()
        time.sleep(TTL_S + 1)  # longer than the TTL: etcd down must not expire anyone
        assert rec.kinds() == [("joined", "p0", 1)] and not reg.lost
        # the late registration retries with backoff until etcd is back
        retrying = threading.Thread(target=late.register, kwargs={"retry_for_s": 30.0}, daemon=True)
        retrying.start()
        time.sleep(0.5)
        local_etcd.start()
        retrying.join(30)
        assert late.lease_id is not None
        assert wait_for(lambda: reg.keepalive_failures == 0 and reg.keepalives > 0, 10 * TTL_S)
        assert wait_for(lambda: len(rec.kinds()) == 2, 10 * TTL_S)
        assert rec.kinds() == [("joined", "p0", 1), ("joined", "p1", 5)]  # p0 never lost
        assert watcher.resyncs >= 1 and not reg.lost
    finally:
        watcher.close()
        reg.close()
        late.close()


class _FakeProducer:
    """What ProducerPresence reads of a Producer: its address, agent, epoch, TP rank, leases and grant()."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.address, self.tp_rank = "tcp://h:9", 0
        self.transport = SimpleNamespace(agent="pf", epoch=3, name="nixl")
        self.ledger = SimpleNamespace(leases={"t1": object()})
        self.granted: list[str] = []

    def grant(self, request: str, **_kw: object) -> str:
        self.granted.append(request)
        return request


@pytest.mark.multihost
def test_drain_refuses_new_grants_waits_for_live_leases_then_leaves(local_etcd: eh.EtcdServer) -> None:
    from kvlifecycle.membership import DrainingError, ProducerPresence

    rec = Recorder()
    producer = _FakeProducer()
    presence = ProducerPresence(producer, session_for(local_etcd), "pf")  # type: ignore[arg-type]
    presence.register()
    watcher = watch(session_for(local_etcd), rec)
    try:
        assert presence.grant("before") == "before"
        result: list[bool] = []
        drainer = threading.Thread(target=lambda: result.append(presence.drain(timeout_s=20.0)), daemon=True)
        drainer.start()
        assert wait_for(lambda: presence.draining and len(rec.kinds()) == 2, 4 * TTL_S)
        assert rec.events[1][0] == "updated" and rec.events[1][2].state is MemberState.DRAINING
        with pytest.raises(DrainingError):
            presence.grant("during")
        assert producer.granted == ["before"] and drainer.is_alive()  # the live lease holds the drain
        producer.ledger.leases.clear()  # the last lease ends
        drainer.join(10)
        assert result == [True]
        assert wait_for(lambda: len(rec.kinds()) == 3, 4 * TTL_S)
        assert rec.events[2][0] == "lost" and watcher.peers() == {}
    finally:
        watcher.close()
        presence.close()


def test_an_ordered_drain_marks_every_rank_by_compare_and_swap_on_its_own_lease(local_etcd: eh.EtcdServer) -> None:
    from kvlifecycle.membership import MembershipError, instance_ranks, order_drain
    from kvlifecycle.membership.drain import _mark

    session = session_for(local_etcd)
    regs = [Registration(session, MemberKey("t", Role.PREFILL, "p0", 0, tp), Member(f"tcp://h:{tp}", f"a{tp}", 1))
            for tp in range(2)]
    other = Registration(session, MemberKey("t", Role.PREFILL, "p1"), Member("tcp://h:5700", "b", 1))
    try:
        for reg in [*regs, other]:
            reg.register()
        with pytest.raises(MembershipError, match="no prefill instance 'nope' is registered"):
            order_drain(session, "nope")
        with pytest.raises(MembershipError, match="only a prefill instance drains"):
            order_drain(session, "p0", role=Role.DECODE)
        stale = instance_ranks(session, "p0")[0]
        regs[0].set_state(MemberState.SERVING)  # the rank rewrites its key after our read
        assert session.call("swap", lambda c: _mark(c, stale)) is False  # nothing overwritten
        marked = order_drain(session, "p0")
        assert [(r.key.tp, r.member.state, r.member.agent) for r in marked] == [
            (0, MemberState.DRAINING, "a0"), (1, MemberState.DRAINING, "a1")]
        assert [r.lease for r in marked] == [reg.lease_id for reg in regs]  # each on its rank's own lease
        assert [r.member.state for r in instance_ranks(session, "p1")] == [MemberState.SERVING]
        assert order_drain(session, "p0") == instance_ranks(session, "p0")  # already draining: nothing to do
    finally:
        for reg in [*regs, other]:
            reg.deregister()
        session.close()
