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
from kvlifecycle.tools.demo import WorkerConfig

pytestmark = [pytest.mark.multihost, pytest.mark.nixl, pytest.mark.slow]

TTL_S = 2  # etcd lease TTL of every worker
CLUSTER = "mh"
SECRET = "multihost-test-secret"
SHAPE = {"regions": 4, "blocks": 32, "block_bytes": 4096}


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

    def start(self, host: str, side: str, name: str, **kw: Any) -> HostWorker:
        h = self.cluster.hosts[host]
        cfg = WorkerConfig(side, name, log_dir=str(self.logs / name), host=h.address, secret=SECRET,
                           **{**SHAPE, **kw})
        worker = HostWorker(h, cfg, log=self.logs / f"{name}.out")
        self.workers[name] = worker
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
    server = eh.EtcdServer(tmp_path / "etcd-data", host=cluster.hosts["etcd"])
    server.start()
    s = Site(cluster, server, tmp_path)
    try:
        yield s
    finally:
        s.stop_all()
        server.stop()


def serving_agents(d: HostWorker) -> list[tuple[str, int]]:
    return [(s["agent"], s["epoch"]) for s in d.call("serving")]


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
    assert wait_for(lambda: sorted(serving_agents(d)) == want, 30.0)
    links = d.call("links")
    assert [(x["agent"], x["address"]) for x in links] == [("p0", p0.hello["address"]), ("p1", p1.hello["address"])]
    assert [x["probe_backend"] for x in links] == ["UCX", "UCX"]  # UCX_TLS=tcp: over the veth links
    print("\nprobe over UCX TCP between namespaces: " + ", ".join(f"{x['agent']} {x['probe_gbps']:.2f} GB/s"
                                                                for x in links))
    for i in range(6):
        p = (p0, p1)[i % 2]
        handoff(p, d, f"r{i}", [i, i + 8], [31 - i, 20 - i], "pull" if i < 4 else "push")
    assert len(collect_released(p0, 3)) == 3 and len(collect_released(p1, 3)) == 3
    site.stop_all()
    assert_logs_clean(site.logs, ["p0", "p1", "d0"])
