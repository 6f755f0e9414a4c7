"""The vLLM workers' etcd wiring (adapters/vllm/membership.py) against a real etcd, without vLLM: the module is
loaded on its own (the package's ``__init__`` imports vLLM) and driven with doubles of the Producer and Consumer
that record what the membership asked of them. The real vLLM P and D on two hosts are in test_vllm_etcd.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import etcd_harness as eh
import pytest
from vllm_adapter_modules import load_vllm_adapter_module

from kvlifecycle.membership import EtcdOptions, EtcdSession, MemberState, Role
from kvlifecycle.membership.instances import Instance, routable_instances
from kvlifecycle.membership.watcher import PeerWatcher

pytestmark = pytest.mark.multihost

ADAPTER = Path(__file__).resolve().parents[2] / "adapters" / "vllm"
TTL_S = 2


config_module, membership_module = load_vllm_adapter_module("config"), load_vllm_adapter_module("membership")
WorkerMembership = membership_module.WorkerMembership


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def transport(agent: str, epoch: int) -> SimpleNamespace:
    return SimpleNamespace(agent=agent, epoch=epoch, name="nixl")


@dataclass
class SourceLedgerDouble:
    leases: dict[str, Any] = field(default_factory=dict)
    restarted: list[tuple[str, int]] = field(default_factory=list)

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        self.restarted.append((peer, epoch))
        out, self.leases = list(self.leases), {}
        return out


@dataclass
class ProducerDouble:
    address: str
    transport: SimpleNamespace
    tp_rank: int = 0
    ledger: SourceLedgerDouble = field(default_factory=SourceLedgerDouble)


@dataclass
class ConsumerDouble:
    transport: SimpleNamespace
    tp_rank: int = 0
    links: dict[str, Any] = field(default_factory=dict)
    connected: list[tuple[str, bool]] = field(default_factory=list)
    invalidated: list[tuple[str, int, str]] = field(default_factory=list)
    epochs: dict[str, int] = field(default_factory=dict)  # address -> the epoch a handshake answers

    def connect(self, address: str, *, push: bool = True) -> SimpleNamespace:
        self.connected.append((address, push))
        return SimpleNamespace(epoch=self.epochs.get(address, 1))

    def invalidate_peer(self, agent: str, epoch: int, reason: str = "") -> list[str]:
        self.invalidated.append((agent, epoch, reason))
        return []


def adapter_config(server: eh.EtcdServer, api: str, **extra: Any) -> Any:
    return config_module.AdapterConfig.from_extra({"etcd_endpoints": server.endpoint, "etcd_cluster": "vllm",
                                                   "etcd_lease_ttl_s": TTL_S, "api_address": api, **extra})


def test_without_etcd_endpoints_no_worker_registers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_ETCD_ENDPOINTS", raising=False)
    cfg = config_module.AdapterConfig.from_extra({})
    assert cfg.etcd_endpoints == ()
    producer = ProducerDouble("tcp://127.0.0.1:5700", transport("p", 1))
    assert WorkerMembership.start(cfg, "engine", producer=producer) == []


def test_p_and_d_workers_register_d_connects_to_p_and_invalidates_it_when_its_lease_goes(
        local_etcd: eh.EtcdServer) -> None:
    producer = ProducerDouble("tcp://127.0.0.1:5700", transport("p-agent", 7))
    consumer = ConsumerDouble(transport("d-agent", 3), epochs={producer.address: 7})
    p_side = WorkerMembership.start(adapter_config(local_etcd, "127.0.0.1:8100"), "eng-p", producer=producer)
    d_side = WorkerMembership.start(adapter_config(local_etcd, "127.0.0.1:8200", mode="push"), "eng-d",
                                    consumer=consumer)
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="vllm", lease_ttl_s=TTL_S))
    watchers = [PeerWatcher(session, role) for role in Role]
    try:
        assert len(p_side) == len(d_side) == 1
        assert p_side[0].joined.wait(20) and d_side[0].joined.wait(20)
        assert p_side[0].key == "/kvlifecycle/v1/vllm/prefill/eng-p/0/0"
        found = {role: w.start() for role, w in zip(Role, watchers, strict=True)}
        p_member = next(iter(found[Role.PREFILL].values()))
        assert (p_member.address, p_member.agent, p_member.epoch, p_member.api) == (
            producer.address, "p-agent", 7, "127.0.0.1:8100")
        assert routable_instances(Role.DECODE, found[Role.DECODE]) == (
            Instance(Role.DECODE, "eng-d", "127.0.0.1:8200", 1),)
        assert wait_for(lambda: consumer.connected == [(producer.address, True)], 10)  # push mode: D's metadata
        p_side[0].presence.registration.close()  # P dies: no keep-alive, its lease runs out
        assert wait_for(lambda: bool(consumer.invalidated), 4 * TTL_S + 5)
        assert consumer.invalidated[0][:2] == ("p-agent", 7)
        assert "etcd lease gone" in consumer.invalidated[0][2]
    finally:
        for w in watchers:
            w.close()
        session.close()
        for m in d_side + p_side:
            m.stop()
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="vllm", lease_ttl_s=TTL_S))
    try:
        resp = session.call("list", lambda c: c.get_prefix_response("/kvlifecycle/v1/vllm/"))
        assert list(resp.kvs) == []  # D deregistered at stop; P's key went with its lease
    finally:
        session.close()


def test_p_drains_at_stop_marked_draining_until_its_leases_end_then_leaves(local_etcd: eh.EtcdServer) -> None:
    producer = ProducerDouble("tcp://127.0.0.1:5701", transport("p-agent", 1))
    producer.ledger.leases["lease-1"] = object()
    [p_side] = WorkerMembership.start(adapter_config(local_etcd, "127.0.0.1:8100", drain_timeout_s=30.0), "eng-p",
                                      producer=producer)
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="vllm", lease_ttl_s=TTL_S))
    watcher = PeerWatcher(session, Role.PREFILL)
    try:
        assert p_side.joined.wait(20)
        watcher.start()
        stopper = threading.Thread(target=p_side.stop)
        stopper.start()
        assert wait_for(lambda: [m.state for m in watcher.peers().values()] == [MemberState.DRAINING], 10)
        time.sleep(TTL_S + 1)  # past the TTL: a draining P keeps its lease alive while its leases run
        assert [m.state for m in watcher.peers().values()] == [MemberState.DRAINING]
        producer.ledger.leases.clear()  # the last lease ends: P leaves
        stopper.join(20)
        assert not stopper.is_alive()
        assert wait_for(lambda: watcher.peers() == {}, 10)
    finally:
        watcher.close()
        session.close()


def test_p_worker_releases_the_leases_of_a_d_whose_etcd_lease_expired(local_etcd: eh.EtcdServer) -> None:
    producer = ProducerDouble("tcp://127.0.0.1:5702", transport("p-agent", 2))
    producer.ledger.leases["bound-to-d"] = object()
    consumer = ConsumerDouble(transport("d-agent", 4))
    [p_side] = WorkerMembership.start(adapter_config(local_etcd, "127.0.0.1:8100"), "eng-p", producer=producer)
    [d_side] = WorkerMembership.start(adapter_config(local_etcd, "127.0.0.1:8200"), "eng-d", consumer=consumer)
    try:
        assert p_side.joined.wait(20) and d_side.joined.wait(20)
        assert wait_for(lambda: [e.kind for e in p_side.directory.events] == ["joined"], 10)
        d_side.presence.registration.close()  # D dies: no keep-alive, its etcd lease runs out
        assert wait_for(lambda: bool(producer.ledger.restarted), 4 * TTL_S + 5)
        # the epoch after the lost one: the ledger ends every lease bound to that D as at its restart
        assert producer.ledger.restarted == [("d-agent", 5)]
        assert producer.ledger.leases == {}
        lost = [e for e in p_side.directory.events if e.kind == "lost"]
        assert [(e.agent, e.epoch, e.detail) for e in lost] == [("d-agent", 4, "released 1 lease(s)")]
    finally:
        for m in (d_side, p_side):
            m.stop()


def drain_cli(server: eh.EtcdServer, instance: str, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "kvlifecycle", "drain", "--etcd", server.endpoint,
                             "--etcd-cluster", "vllm", "--instance", instance, "--json", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_kvlifecycle_drain_orders_a_running_p_out_once_its_leases_ended(local_etcd: eh.EtcdServer) -> None:
    producer = ProducerDouble("tcp://127.0.0.1:5703", transport("p-agent", 1))
    producer.ledger.leases["in-flight"] = object()
    config = adapter_config(local_etcd, "127.0.0.1:8100", drain_timeout_s=60.0, drain_quiet_s=0.5)
    [p_side] = WorkerMembership.start(config, "eng-p", producer=producer)
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="vllm", lease_ttl_s=TTL_S))
    watcher = PeerWatcher(session, Role.PREFILL)
    try:
        assert p_side.joined.wait(20)
        watcher.start()
        unknown = drain_cli(local_etcd, "no-such-p")
        _, err = unknown.communicate(timeout=60)
        assert unknown.returncode == 1 and "no prefill instance 'no-such-p' is registered" in err
        cli = drain_cli(local_etcd, "eng-p", "--wait", "60")
        assert wait_for(lambda: [m.state for m in watcher.peers().values()] == [MemberState.DRAINING], 20)
        assert routable_instances(Role.PREFILL, watcher.peers()) == ()  # the proxy routes nothing new to it
        assert wait_for(lambda: p_side.presence.draining, 10)  # P saw the order on its own key
        time.sleep(TTL_S + 1)  # past the etcd TTL: a draining P keeps its key while a lease lives
        assert [m.state for m in watcher.peers().values()] == [MemberState.DRAINING]
        assert cli.poll() is None and p_side.presence.drained is None
        producer.ledger.leases.clear()  # the last lease ends: P leaves after its quiet time
        out, err = cli.communicate(timeout=60)
        assert cli.returncode == 0, err
        assert json.loads(out) == {"instance": "eng-p", "draining": ["/kvlifecycle/v1/vllm/prefill/eng-p/0/0"],
                                   "departed": True}
        assert watcher.peers() == {}
        assert wait_for(lambda: p_side.presence.drained is True, 10)  # set once drain() returned
    finally:
        watcher.close()
        session.close()
        p_side.stop()  # the ordered drain already left: nothing more to do


def test_an_ordered_drain_waits_for_the_grant_of_a_request_still_in_its_prefill(local_etcd: eh.EtcdServer) -> None:
    """No lease when the order comes (the one request is still prefilling); its grant arrives within the quiet
    time, and P stays until that lease ended too."""
    producer = ProducerDouble("tcp://127.0.0.1:5704", transport("p-agent", 1))
    config = adapter_config(local_etcd, "127.0.0.1:8100", drain_timeout_s=60.0, drain_quiet_s=10.0)
    [p_side] = WorkerMembership.start(config, "eng-p", producer=producer)
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster="vllm", lease_ttl_s=TTL_S))
    watcher = PeerWatcher(session, Role.PREFILL)
    try:
        assert p_side.joined.wait(20)
        watcher.start()
        cli = drain_cli(local_etcd, "eng-p")
        cli.communicate(timeout=60)
        assert cli.returncode == 0
        assert wait_for(lambda: p_side.presence.draining, 10)
        producer.ledger.leases["granted-after-its-prefill"] = object()  # well within the 10 s quiet time
        time.sleep(TTL_S + 1)
        assert [m.state for m in watcher.peers().values()] == [MemberState.DRAINING]  # still here: a lease lives
        producer.ledger.leases.clear()
        assert wait_for(lambda: watcher.peers() == {}, 30)
        assert wait_for(lambda: p_side.presence.drained is True, 10)  # set once drain() returned
    finally:
        watcher.close()
        session.close()
        p_side.stop()
