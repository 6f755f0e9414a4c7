"""P and D on separate hosts (network namespaces): real etcd on a host of its own, real NIXL over UCX TCP on the
veth links, the side channel bound to each host's address with HMAC on.

Every wait is bounded; times (how long D took to learn of a dead P) are printed, not asserted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import etcd_harness as eh
import netns_harness as nh
import pytest
from host_worker import HostWorker

from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.tools.workers import WorkerConfig

pytestmark = [pytest.mark.multihost, pytest.mark.nixl, pytest.mark.slow]

TTL_S = 3  # etcd lease TTL of every worker (2 is etcd's least; 3 leaves a starved keep-alive thread room)
CLUSTER = "mh"
SECRET = "multihost-test-secret"
SHAPE = {"regions": 4, "blocks": 32, "block_bytes": 4096}
CONNECT_S = 60.0  # bound on D finding a P through etcd and finishing the handshake (a loaded machine is slow)
LOSS_S = 10 * TTL_S + 10  # bound on seeing a loss (about one TTL when the machine is idle; printed, not asserted)


def wait_for(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every_s)


@dataclass
class Site:
    """The hosts of one test: etcd, two P hosts, one D host, and the workers running on them."""

    cluster: nh.Cluster
    etcd: eh.EtcdServer
    logs: Path
    workers: dict[str, HostWorker] = field(default_factory=dict)

    def start(self, host: str, side: str, name: str, *, log_name: str = "", **kw: Any) -> HostWorker:
        """Start worker ``name`` on ``host``; its event log goes to ``logs/<log_name or name>``."""
        h = self.cluster.hosts[host]
        log_name = log_name or name
        cfg = WorkerConfig(side, name, log_dir=str(self.logs / log_name), host=h.address, secret=SECRET,
                           **{**SHAPE, **kw})
        worker = HostWorker(h, cfg, log=self.logs / f"{log_name}.out")
        self.workers[log_name] = worker
        return worker

    def join(self, p: HostWorker, instance: str) -> None:
        p.call("join", [self.etcd.endpoint], CLUSTER, instance, TTL_S)

    def follow(self, d: HostWorker) -> None:
        d.call("follow", [self.etcd.endpoint], CLUSTER, TTL_S)

    def stop_all(self) -> None:
        for w in reversed(list(self.workers.values())):
            if w.proc.is_alive():
                w.stop()


@pytest.fixture
def site(cluster: nh.Cluster, tmp_path: Path) -> Iterator[Site]:
    for name in ("etcd", "p0", "p1", "d0"):
        cluster.add_host(name)
    server = eh.EtcdServer(tmp_path / "etcd", host=cluster.hosts["etcd"])
    s = Site(cluster, server, tmp_path)
    try:
        server.start()
        yield s
    finally:
        s.stop_all()
        server.close()


def shape(host: nh.Host, rate: str | None, *, exempt: str | None = None) -> None:
    """Slow the host's uplink to ``rate`` (a token bucket on its veth), or lift that (None). ``exempt``: an address
    whose traffic bypasses the bucket (etcd's, where a test slows the KV and not the control plane: a link kept
    full for a minute otherwise queues and drops the member's keep-alives until its etcd lease lapses)."""
    dev = host.device
    if rate is None:
        host.run(["tc", "qdisc", "del", "dev", dev, "root"])
        return
    bucket = ["tbf", "rate", rate, "burst", "64kb", "latency", "500ms"]
    if exempt is None:
        commands = [["tc", "qdisc", "add", "dev", dev, "root", *bucket]]
    else:  # htb only sorts (two unlimited classes; this kernel has no prio qdisc): the bucket holds class 1:20,
        # where everything goes but what the filter sends to 1:10
        unlimited = ["htb", "rate", "10gbit", "quantum", "60000"]
        commands = [["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"],
                    ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", *unlimited],
                    ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", *unlimited],
                    ["tc", "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", *bucket],
                    ["tc", "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                     "match", "ip", "dst", f"{exempt}/32", "flowid", "1:10"]]
    for command in commands:
        out = host.run(command)
        assert out.returncode == 0, f"{' '.join(command)}: {out.stderr}"


def serving_agents(d: HostWorker) -> list[tuple[str, int]]:
    return [(s["agent"], s["epoch"]) for s in d.call("serving")]


def wait_serving(d: HostWorker, want: list[tuple[str, int]]) -> None:
    """Wait (bounded) until D serves exactly ``want`` (agent, epoch) pairs; else fail with D's directory events."""
    if not wait_for(lambda: sorted(serving_agents(d)) == sorted(want), CONNECT_S):
        pytest.fail(f"D serves {serving_agents(d)}, not {want}; its directory saw {d.call('peer_events')}")


def collect_released(p: HostWorker, want: int, timeout_s: float = 20.0) -> list:
    released: list = []
    deadline = time.monotonic() + timeout_s
    while len(released) < want and time.monotonic() < deadline:
        released += p.call("free_released")
        if len(released) < want:
            time.sleep(0.02)
    return released


def handoff(p: HostWorker, d: HostWorker, request: str, src: list[int], dst: list[int], mode: str = "pull") -> None:
    addr = p.hello["address"]
    grant = p.call("alloc_grant", request, src)
    d.call("reserve", request, dst)
    if mode == "pull":
        d.call("pull", request, [[addr, grant]])
    else:
        d.call("push", request, grant, addr)
    assert d.call("wait", 30.0)
    assert d.call("request_state", request) == "READY_FOR_ATTENTION"
    assert d.call("digest", dst) == p.call("digest", src)
    d.call("finish", request)
    assert collect_released(p, 1) == [[request, grant["transfer"], "completed"]]  # P frees its blocks


def assert_logs_clean(logs: Path, names: list[str], *, quiescent: bool = True) -> None:
    results = [replay(logs / n) for n in names]
    problems = [str(v) for r in results for v in check(r, quiescent=quiescent)] + [str(v) for v in check_pair(results)]
    assert problems == []


def test_two_p_hosts_one_d_host_discovered_through_etcd(site: Site) -> None:
    p0 = site.start("p0", "producer", "p0", seed=1)
    p1 = site.start("p1", "producer", "p1", seed=2)
    d = site.start("d0", "consumer", "d0")
    assert p0.hello["address"].startswith(f"tcp://{site.cluster.hosts['p0'].address}:")
    site.join(p0, "prefill-a")
    site.join(p1, "prefill-b")
    site.follow(d)
    want = sorted([("p0", p0.hello["epoch"]), ("p1", p1.hello["epoch"])])
    wait_serving(d, want)
    links = d.call("links")
    assert [(x["agent"], x["address"]) for x in links] == [("p0", p0.hello["address"]), ("p1", p1.hello["address"])]
    assert [x["probe_backend"] for x in links] == ["UCX", "UCX"]  # UCX_TLS=tcp: over the veth links
    print("\nprobe over UCX TCP between namespaces: " + ", ".join(f"{x['agent']} {x['probe_gbps']:.2f} GB/s"
                                                                for x in links))
    for i in range(6):
        p = (p0, p1)[i % 2]
        handoff(p, d, f"r{i}", [i, i + 8], [31 - i, 20 - i], "pull" if i < 4 else "push")
    site.stop_all()
    assert_logs_clean(site.logs, ["p0", "p1", "d0"])


def lost_events(d: HostWorker) -> list[dict[str, Any]]:
    return [e for e in d.call("peer_events") if e["kind"] == "lost"]


def test_p_killed_mid_transfer_d_learns_through_etcd_fails_the_load_and_the_restart_serves(site: Site) -> None:
    big = {"regions": 32, "blocks": 128, "block_bytes": 16384}  # 64 MiB in one grant: still in flight at the kill
    # block leases far longer than the etcd lease: what tells D is etcd (or the transport), not a lease running out
    p0 = site.start("p0", "producer", "p0", log_name="p0-first", seed=1, ttl_s=60.0, **big)
    d = site.start("d0", "consumer", "d0", **big)
    site.join(p0, "prefill-a")
    site.follow(d)
    first_epoch = p0.hello["epoch"]
    wait_serving(d, [("p0", first_epoch)])
    shape(site.cluster.hosts["p0"], "40mbit")  # the 64 MiB read surely outlives the kill
    blocks = list(range(big["blocks"]))
    grant = p0.call("alloc_grant", "doomed", blocks)
    d.call("reserve", "doomed", blocks)
    out = d.call("pull_and_kill", "doomed", [[p0.hello["address"], grant]], p0.proc.pid)
    assert out["posted"]  # the READ was posted before the kill
    p0.proc.join(10)
    assert p0.proc.exitcode == -9
    lost = wait_for(lambda: lost_events(d), LOSS_S)
    assert [(e["agent"], e["epoch"]) for e in lost] == [("p0", first_epoch)]
    print(f"\nP SIGKILLed mid-transfer: D saw its etcd key go {lost[0]['at'] - out['killed_at']:.2f}s later "
          f"(etcd lease TTL {TTL_S}s, keep-alive every {TTL_S / 3:.2f}s)")
    # the load failed (policy "fail": the reservation is gone, its blocks FREE), nothing left in flight or linked
    assert d.call("wait", 10.0)
    assert d.call("request_state", "doomed") is None
    state = d.call("state")
    assert state["loads"] == [] and state["stats"].get("failed", 0) + state["stats"].get("cancelled", 0) == 1
    assert state["counts"]["FREE"] == big["blocks"]
    assert d.call("links") == [] and serving_agents(d) == []

    # P restarts on its host: a new agent epoch registers under the same key and serves
    shape(site.cluster.hosts["p0"], None)
    p0b = site.start("p0", "producer", "p0", log_name="p0-second", seed=2, **big)
    assert p0b.hello["epoch"] > first_epoch
    site.join(p0b, "prefill-a")
    wait_serving(d, [("p0", p0b.hello["epoch"])])
    handoff(p0b, d, "after", [3, 4, 5], [10, 11, 12])
    site.stop_all()
    assert_logs_clean(site.logs, ["p0-second", "d0"])
    first = replay(site.logs / "p0-first")  # killed: its log replays to the lease it held, nothing broken
    assert check(first) == []


def test_partition_mid_transfer_d_fails_the_load_through_etcd_then_heals_without_leaks(site: Site) -> None:
    big = {"regions": 32, "blocks": 128, "block_bytes": 16384}
    p0 = site.start("p0", "producer", "p0", log_name="p0-first", seed=1, ttl_s=4.0, **big)
    d = site.start("d0", "consumer", "d0", **big)
    site.join(p0, "prefill-a")
    site.follow(d)
    epoch = p0.hello["epoch"]
    wait_serving(d, [("p0", epoch)])
    handoff(p0, d, "before", [1, 2], [3, 4])
    host = site.cluster.hosts["p0"]
    shape(host, "40mbit")  # the 64 MiB read is surely still in flight when the link goes down
    blocks = list(range(big["blocks"]))
    grant = p0.call("alloc_grant", "cut", blocks)
    d.call("reserve", "cut", blocks)
    assert d.call("pull_posted", "cut", [[p0.hello["address"], grant]])["posted"]
    host.link(False)  # partition: no reset, no error, the read just stalls; P cannot reach etcd either
    cut_at = time.time()
    lost = wait_for(lambda: lost_events(d), LOSS_S)
    assert [(e["agent"], e["epoch"]) for e in lost] == [("p0", epoch)]
    print(f"\npartition: D saw P's etcd key go {lost[0]['at'] - cut_at:.2f}s after the link went down")
    assert d.call("wait", 10.0)
    assert any("etcd lease gone" in why for why in d.call("failures"))  # failed by etcd, not by the transport
    assert d.call("request_state", "cut") is None and d.call("state")["counts"]["FREE"] == big["blocks"]

    host.link(True)  # healed: P learns its lease is gone; its epoch is dead for D
    assert wait_for(lambda: p0.call("registration")["lost"], LOSS_S)
    released = collect_released(p0, 1, timeout_s=30.0)  # P's block lease ends once (D's heartbeats stopped)
    assert [r[0] for r in released] == ["cut"]
    assert p0.call("state")["leases"] == []
    shape(host, None)
    p0.stop()
    # service resumes with P's next incarnation
    p0b = site.start("p0", "producer", "p0", log_name="p0-second", seed=2, **big)
    site.join(p0b, "prefill-a")
    wait_serving(d, [("p0", p0b.hello["epoch"])])
    handoff(p0b, d, "after", [5, 6], [7, 8])
    site.stop_all()
    assert_logs_clean(site.logs, ["p0-first", "d0"])
    assert_logs_clean(site.logs, ["p0-second", "d0"])


def send(worker: HostWorker, name: str, *args: Any, **kwargs: Any) -> None:
    """Start a command without waiting for its answer (collect it with ``worker._reply``)."""
    import msgspec

    worker.conn.send_bytes(msgspec.msgpack.encode([name, list(args), kwargs]))


def test_scale_out_then_drain_with_requests_in_flight_fails_none(site: Site) -> None:
    big = {"regions": 32, "blocks": 128, "block_bytes": 16384}
    p0 = site.start("p0", "producer", "p0", seed=1, **big)
    d = site.start("d0", "consumer", "d0", **big)
    site.join(p0, "prefill-a")
    site.follow(d)
    wait_serving(d, [("p0", p0.hello["epoch"])])
    # scale-out: a second P host joins and D connects to it
    p1 = site.start("p1", "producer", "p1", seed=2, **big)
    site.join(p1, "prefill-b")
    both = sorted([("p0", p0.hello["epoch"]), ("p1", p1.hello["epoch"])])
    wait_serving(d, both)
    host = site.cluster.hosts["p0"]
    shape(host, "80mbit")
    addr = p0.hello["address"]
    inflight = []
    for i in range(2):  # two 24 MiB reads from p0, in flight over its slowed link while it drains
        src = list(range(i * 48, (i + 1) * 48))
        grant = p0.call("alloc_grant", f"inflight{i}", src)
        d.call("reserve", f"inflight{i}", src)
        assert d.call("pull_posted", f"inflight{i}", [[addr, grant]])["posted"]
        inflight.append((f"inflight{i}", src, grant))
    send(p0, "drain", 60.0)  # scale-in: p0 stops taking grants, lets its leases finish, leaves
    # D sees p0 draining: new requests go to p1 only
    assert wait_for(lambda: serving_agents(d) == [("p1", p1.hello["epoch"])], LOSS_S)
    handoff(p1, d, "during-drain", [0, 1], [100, 101])  # waits for p0's in-flight reads too
    assert d.call("wait", 60.0)
    assert p0._reply(60.0, "drain") is True  # no lease was left when it deregistered
    lost = wait_for(lambda: lost_events(d), LOSS_S)
    assert [e["agent"] for e in lost] == ["p0"] and "drained and left" in lost[0]["detail"]
    assert d.call("failures") == []  # none of the in-flight requests failed
    for request, src, _grant in inflight:
        assert d.call("request_state", request) == "READY_FOR_ATTENTION"
        assert d.call("digest", src) == p0.call("digest", src)
        d.call("finish", request)
    assert sorted(r[0] for r in collect_released(p0, 2)) == ["inflight0", "inflight1"]
    shape(host, None)
    handoff(p1, d, "after-drain", [4, 5], [110, 111])
    site.stop_all()
    assert_logs_clean(site.logs, ["p0", "p1", "d0"])


def test_etcd_stopped_and_restarted_under_load(site: Site) -> None:
    p0 = site.start("p0", "producer", "p0", seed=1)
    d = site.start("d0", "consumer", "d0")
    site.join(p0, "prefill-a")
    site.follow(d)
    wait_serving(d, [("p0", p0.hello["epoch"])])
    site.etcd.stop()
    # established peers keep transferring with etcd down, for longer than the etcd lease TTL
    deadline = time.monotonic() + TTL_S + 2
    moved = 0
    while time.monotonic() < deadline:
        handoff(p0, d, f"down{moved}", [moved % 16], [31 - moved % 16])
        moved += 1
    assert moved >= 2
    # a new P cannot register while etcd is down: a clear error names the endpoint
    p1 = site.start("p1", "producer", "p1", seed=2)
    with pytest.raises(Exception, match=f"EtcdUnavailableError: etcd at {site.etcd.endpoint} unavailable"):
        p1.call("join", [site.etcd.endpoint], CLUSTER, "prefill-b", TTL_S, 0.0)
    assert p0.call("registration")["keepalive_failures"] >= 1
    send(p1, "join", [site.etcd.endpoint], CLUSTER, "prefill-b", TTL_S, 30.0)  # retries with backoff meanwhile
    time.sleep(1.0)
    site.etcd.start()
    p1._reply(40.0, "join")
    both = sorted([("p0", p0.hello["epoch"]), ("p1", p1.hello["epoch"])])
    wait_serving(d, both)
    assert lost_events(d) == []  # etcd's outage expired no one
    assert wait_for(lambda: p0.call("registration")["keepalive_failures"] == 0, 10.0)
    handoff(p0, d, "after0", [20], [0])
    handoff(p1, d, "after1", [21], [1])
    site.stop_all()
    assert_logs_clean(site.logs, ["p0", "p1", "d0"])


def test_d_killed_mid_transfer_p_releases_its_lease_through_etcd_before_the_lease_ttl(site: Site) -> None:
    import msgspec

    big = {"regions": 32, "blocks": 128, "block_bytes": 16384}
    p0 = site.start("p0", "producer", "p0", seed=1, ttl_s=60.0, **big)  # block lease: a minute
    d = site.start("d0", "consumer", "d0", log_name="d0-first", **big)
    site.join(p0, "prefill-a")
    site.join(d, "decode-a")
    site.follow(p0)
    site.follow(d)
    wait_serving(d, [("p0", p0.hello["epoch"])])
    assert wait_for(lambda: [e["kind"] for e in p0.call("peer_events")] == ["joined"], 10.0)
    shape(site.cluster.hosts["p0"], "40mbit")
    blocks = list(range(big["blocks"]))
    grant = p0.call("alloc_grant", "orphan", blocks)
    d.call("reserve", "orphan", blocks)
    d.conn.send_bytes(msgspec.msgpack.encode(["pull_then_die", ["orphan", [[p0.hello["address"], grant]]], {}]))
    d.proc.join(30)
    died = time.time()
    assert d.proc.exitcode == 9
    released = collect_released(p0, 1, timeout_s=LOSS_S)
    assert released == [["orphan", grant["transfer"], "peer_restarted"]]  # by etcd: its TTL is a minute
    lost = [e for e in p0.call("peer_events") if e["kind"] == "lost"]
    assert [(e["agent"], e["detail"]) for e in lost] == [("d0", "released 1 lease(s)")]
    print(f"\nD SIGKILLed mid-transfer: P released its 60 s lease {lost[0]['at'] - died:.2f}s later, through etcd")
    shape(site.cluster.hosts["p0"], None)
    site.stop_all()
    assert_logs_clean(site.logs, ["p0"])
    d_log = replay(site.logs / "d0-first")  # D crashed: its log replays to the load it had in flight
    assert check(d_log) == []
    assert check_pair([replay(site.logs / "p0"), d_log]) == []
