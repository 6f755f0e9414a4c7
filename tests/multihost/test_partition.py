"""A read never outlives its lease on a real network (docs/design.md): P and D on hosts of their own (network
namespaces), a real etcd on a third, NIXL over UCX TCP on the veth links, and the link between P and D cut with
iptables before the claim, mid-read, or between the last byte and its notification; one way or both; with etcd
reachable or cut off; or P's cable pulled (everything P sends or receives dropped, etcd too).

Each scenario asserts, on one clock, that D ended its read (the load failed or completed, its pending read
released) strictly before P released the lease, and that no block D was reading was allocated again before D's
read ended. P reuses a released lease's blocks at once (:mod:`partition_worker`), the adversary a read that
outlives its lease would meet. One clock: the namespaces share the host's CLOCK_MONOTONIC, and both ledgers stamp
their events (``at``) with ``time.monotonic()``, as do the workers' own records and this process's cut times.
Both logs are then replayed and checked, by the library and by ``kvlifecycle replay --check``. The mutant test
moves D's read bound past P's expiry and expects the one-clock check to fail.

Times (cut → D's end of the read, P's release, D's etcd invalidation) are printed against the TTLs, not asserted.
Every wait is bounded; every iptables rule is removed in a finalizer (and goes with its namespace).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import etcd_harness as eh
import netns_harness as nh
import numpy as np
import pytest
from host_worker import HostWorker
from partition_harness import Faults, iptables_missing

from kvlifecycle import events as ev
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.tools.workers import WorkerConfig

pytestmark = [pytest.mark.multihost, pytest.mark.nixl, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
LEASE_TTL_S = 2.5  # P's block leases: D renews every TTL/6 and must end a read by 0.9 TTL after its last renewal
ETCD_TTL_S = 3  # every member's etcd lease
CLUSTER = "part"
SECRET = "partition-test-secret"
SHAPE = {"regions": 16, "blocks": 64, "block_bytes": 16384}  # 16 MiB per grant of every block
SLOW_LINK = "40mbit"  # P's uplink while a read must stay in flight: 16 MiB take about 3 s, the cut comes first
CONNECT_S = 60.0  # bound on D finding P through etcd (a loaded machine is slow)
SETTLE_S = LEASE_TTL_S + 15.0  # bound on D ending the load and P releasing the lease (a claim times out in 5 s)
LOSS_S = 4 * ETCD_TTL_S + 10  # bound on D's directory seeing P's key go (printed, not asserted)


def wait_for(predicate: Callable[[], Any], timeout_s: float, every_s: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(every_s)


def require_iptables() -> None:
    reason = iptables_missing()
    if reason is None:
        return
    if os.environ.get("KVL_REQUIRE_ALL") == "1":
        pytest.fail(f"{reason} [KVL_REQUIRE_ALL=1: not skipping]")
    pytest.skip(reason)


When = Literal["before_claim", "mid_read", "after_last_byte"]
# p_to_d: only what P sends to D is dropped; p_cable: everything P sends or receives (etcd too)
Cut = Literal["two_way", "p_to_d", "d_to_p", "p_cable"]
EtcdReach = Literal["up", "down"]  # down: etcd's host cut off from P and D as well


@dataclass(frozen=True)
class Scenario:
    when: When
    cut: Cut
    etcd: EtcdReach = "up"
    # D pulls a second request of the cut-off P during the cut: its claim, unanswered, must not hold the first
    # read past its bound
    second_pull: bool = False

    @property
    def id(self) -> str:
        return f"{self.when}-{self.cut}-etcd_{self.etcd}" + ("-second_pull" if self.second_pull else "")


SCENARIOS = [
    Scenario("before_claim", "two_way"),
    Scenario("before_claim", "p_to_d"),
    Scenario("before_claim", "d_to_p"),
    Scenario("mid_read", "two_way"),
    Scenario("mid_read", "p_to_d"),
    Scenario("mid_read", "d_to_p"),
    Scenario("mid_read", "two_way", "down"),
    Scenario("mid_read", "d_to_p", "down"),
    Scenario("mid_read", "p_cable"),
    Scenario("mid_read", "two_way", second_pull=True),
    Scenario("mid_read", "p_cable", second_pull=True),
    Scenario("after_last_byte", "d_to_p"),
    Scenario("after_last_byte", "two_way", "down"),
]


@dataclass
class Site:
    cluster: nh.Cluster
    etcd: eh.EtcdServer
    logs: Path
    faults: Faults = field(default_factory=Faults)
    workers: list[HostWorker] = field(default_factory=list)

    def host(self, name: str) -> nh.Host:
        return self.cluster.hosts[name]

    def start(self, host: str, side: str, name: str, **kw: Any) -> HostWorker:
        h = self.host(host)
        cfg = WorkerConfig(side, name, log_dir=str(self.logs / name), host=h.address, secret=SECRET,
                           **{**SHAPE, **kw})
        worker = HostWorker(h, cfg, log=self.logs / f"{name}.out", script=HERE / "partition_worker.py")
        self.workers.append(worker)
        return worker

    def stop_all(self) -> None:
        for w in reversed(self.workers):
            if w.proc.is_alive():
                try:
                    w.stop()
                except Exception:  # a finalizer: kill what does not stop
                    w.proc.kill()


@pytest.fixture
def site(cluster: nh.Cluster, tmp_path: Path) -> Iterator[Site]:
    require_iptables()
    for name in ("etcd", "p0", "d0"):
        cluster.add_host(name)
    server = eh.EtcdServer(tmp_path / "etcd", host=cluster.hosts["etcd"])
    s = Site(cluster, server, tmp_path)
    try:
        server.start()
        yield s
    finally:
        s.faults.clear()
        shape(cluster.hosts["p0"], None)
        s.stop_all()
        server.close()


def shape(host: nh.Host, rate: str | None) -> None:
    """Slow the host's uplink to ``rate`` (a token bucket on its veth), or lift that (None)."""
    if rate is None:
        host.run(["tc", "qdisc", "del", "dev", host.device, "root"])
        return
    out = host.run(["tc", "qdisc", "add", "dev", host.device, "root", "tbf", "rate", rate, "burst", "64kb",
                    "latency", "500ms"])
    assert out.returncode == 0, out.stderr


def apply_cut(site: Site, sc: Scenario) -> None:
    p, d, etcd = site.host("p0"), site.host("d0"), site.host("etcd")
    if sc.cut == "p_cable":
        site.faults.isolate(p, [d, etcd])
        return
    if sc.cut in ("two_way", "p_to_d"):
        site.faults.drop(p, d)
    if sc.cut in ("two_way", "d_to_p"):
        site.faults.drop(d, p)
    if sc.etcd == "down":
        site.faults.isolate(etcd, [p, d])


@dataclass
class Outcome:
    """One scenario's facts, every time on the one monotonic clock."""

    cut_at: float
    started: float | None  # D's TgtLoadStarted
    ended: float | None  # D's end of the load: TgtLoadFailed, or its last TgtPartDone
    end_kind: str
    read_released: float | None  # when D released a read still in flight (cancelled it)
    released: float | None  # P's SrcLeaseReleased
    release_reason: str
    reused: float | None  # P's first allocation of one of the granted blocks after the grant
    lost_after_s: float | None  # cut → D's directory invalidating P (wall clock, same host)
    log_violations: list[str] = field(default_factory=list)  # replay's checks of both logs
    second: Outcome | None = None  # the request pulled during the cut (second_pull)


def first(events: list[Any], kind: type, pred: Callable[[Any], bool]) -> Any:
    return next((e for e in events if isinstance(e, kind) and pred(e)), None)


def outcome(p_events: list[Any], d_events: list[Any], transfer: str, request: str, blocks: list[int],
            cut_at: float, read_releases: dict[str, list[Any]], lost_after_s: float | None) -> Outcome:
    start = first(d_events, ev.TgtLoadStarted, lambda e: e.transfer == transfer)
    failed = first(d_events, ev.TgtLoadFailed, lambda e: e.transfer == transfer)
    parts_done = [e for e in d_events if isinstance(e, ev.TgtPartDone) and e.transfer == transfer]
    if failed is not None:
        ended, end_kind = failed.at, f"failed ({failed.reason})"
    elif start is not None and len(parts_done) == start.parts:
        ended, end_kind = max(e.at for e in parts_done), "completed"
    else:
        cancelled = first(d_events, ev.TgtCancelled, lambda e: e.request == request)
        ended, end_kind = (None, "never started") if cancelled is None else (cancelled.at, "abandoned (no read)")
    granted = first(p_events, ev.SrcGranted, lambda e: e.transfer == transfer)
    rel = first(p_events, ev.SrcLeaseReleased, lambda e: e.transfer == transfer)
    wanted = set(blocks)
    reuse = first(p_events, ev.SrcAllocated, lambda e: e.request != request and granted is not None
                  and e.hlc > granted.hlc and bool(wanted & set(ev.unpack_blocks(e.blocks).tolist())))
    cancelled_read = read_releases.get(transfer)
    return Outcome(cut_at, start.at if start else None, ended, end_kind,
                   cancelled_read[0] if cancelled_read else None, rel.at if rel else None,
                   rel.reason if rel else "", reuse.at if reuse else None, lost_after_s)


def report(sc: Scenario, o: Outcome) -> str:
    def since(t: float | None) -> str:
        return "-" if t is None else f"{t - o.cut_at:+.3f}s"

    margin = "-" if o.ended is None or o.released is None else f"{o.released - o.ended:+.3f}s"
    lost = "-" if o.lost_after_s is None else f"{o.lost_after_s:.2f}s"
    return (f"{sc.id}: cut→D ended {since(o.ended)} [{o.end_kind}], cut→D cancelled read "
            f"{since(o.read_released)}, cut→P released {since(o.released)} [{o.release_reason}], P released − D "
            f"ended {margin}, cut→reuse {since(o.reused)}, cut→etcd invalidation {lost} "
            f"(lease TTL {LEASE_TTL_S}s, D's bound 0.9 TTL after its last renewal, etcd TTL {ETCD_TTL_S}s)")


def lost_events(d: HostWorker, agent: str) -> list[dict[str, Any]]:
    return [e for e in d.call("peer_events") if e["kind"] == "lost" and e["agent"] == agent]


def replay_cli_check(*logs: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", "--check", *map(str, logs)],
                          capture_output=True, text=True, timeout=120)


def run_scenario(site: Site, sc: Scenario, *, read_bound_fraction: float | None = None) -> Outcome:
    """Start P and D, hand off one request with the link cut as ``sc`` says, heal, stop both; the facts, from
    their logs. ``read_bound_fraction``: a mutant of D's read bound (its fraction of the TTL)."""
    with ThreadPoolExecutor(2) as pool:  # a start imports torch and NIXL: both at once
        pf = pool.submit(site.start, "p0", "producer", "p", seed=1, ttl_s=LEASE_TTL_S)
        df = pool.submit(site.start, "d0", "consumer", "d")
        p, d = pf.result(), df.result()
    if read_bound_fraction is not None:
        d.call("set_read_bound_fraction", read_bound_fraction)
    p.call("join", [site.etcd.endpoint], CLUSTER, "prefill-a", ETCD_TTL_S)
    d.call("follow", [site.etcd.endpoint], CLUSTER, ETCD_TTL_S)
    agent, epoch = p.hello["agent"], p.hello["epoch"]
    if not wait_for(lambda: [(s["agent"], s["epoch"]) for s in d.call("serving")] == [(agent, epoch)], CONNECT_S):
        pytest.fail(f"D does not serve P; its directory saw {d.call('peer_events')}")
    p.call("reuse_released")
    split = SHAPE["blocks"] * 3 // 4
    request, blocks = "r", list(range(split if sc.second_pull else SHAPE["blocks"]))
    second_blocks = list(range(split, SHAPE["blocks"]))
    src_digest = p.call("digest", blocks)
    grant = p.call("alloc_grant", request, blocks)
    transfer = grant["transfer"]
    grants = [[p.hello["address"], grant]]
    d.call("reserve", request, blocks)
    second_grant = None
    if sc.second_pull:
        second_grant = p.call("alloc_grant", "r2", second_blocks)
        d.call("reserve", "r2", second_blocks)
    p_host = site.host("p0")

    if sc.when == "before_claim":
        apply_cut(site, sc)
        cut_at, cut_wall = time.monotonic(), time.time()
        d.call("pull", request, grants)
    elif sc.when == "mid_read":
        shape(p_host, SLOW_LINK)
        assert d.call("pull_posted", request, grants)["posted"]  # the READ is out, its bytes still on the way
        apply_cut(site, sc)
        cut_at, cut_wall = time.monotonic(), time.time()
        if second_grant is not None:
            time.sleep(LEASE_TTL_S / 6)  # after a renewal went unanswered
            d.call("pull", "r2", [[p.hello["address"], second_grant]])
    else:  # after the last byte, before the notification: the read completes, P is not told yet
        d.call("hold_notifications")
        d.call("pull", request, grants)
        assert d.call("wait", 30.0)
        assert d.call("request_state", request) == "READY_FOR_ATTENTION"
        apply_cut(site, sc)
        cut_at, cut_wall = time.monotonic(), time.time()
        assert d.call("send_held") == 1  # into the cut: lost, or late once the link heals

    # the cut holds until D ended the load and P released the lease (bounded), then heals
    assert d.call("wait", SETTLE_S), "D's load did not end"
    assert wait_for(lambda: p.call("lease", transfer) is None, SETTLE_S), "P did not release the lease"
    if second_grant is not None:
        assert wait_for(lambda: p.call("lease", second_grant["transfer"]) is None, SETTLE_S)
    lost_after_s = None
    if sc.cut == "p_cable":  # P's etcd key expires: D's directory invalidates P (measured, not asserted)
        lost = wait_for(lambda: lost_events(d, agent), LOSS_S)
        lost_after_s = lost[0]["at"] - cut_wall if lost else None
    site.faults.clear()
    shape(p_host, None)
    time.sleep(0.3)  # a held notification or a hand-back still in a socket lands now: P must ignore it
    read_releases = d.call("releases")
    assert d.call("state")["loads"] == []
    if sc.when == "after_last_byte":
        assert d.call("digest", blocks) == src_digest  # the bytes read are the granted ones, not the reuser's
    site.stop_all()

    p_log, d_log = replay(site.logs / "p"), replay(site.logs / "d")
    o = outcome(p_log.events, d_log.events, transfer, request, blocks, cut_at, read_releases, lost_after_s)
    o.log_violations = [str(v) for v in check(p_log) + check(d_log) + check_pair([p_log, d_log])]
    print("\n" + report(sc, o))
    if second_grant is not None:
        o.second = outcome(p_log.events, d_log.events, second_grant["transfer"], "r2", second_blocks, cut_at, {},
                           None)
        print(report(Scenario("before_claim", sc.cut, sc.etcd), o.second).replace("before_claim", "  its r2", 1))
    return o


def assert_read_ended_first(sc: Scenario, o: Outcome) -> None:
    """D ended its read before P released the lease, and no block was allocated again while D read it."""
    assert o.released is not None  # P released the lease (and its reuser took the blocks)
    if sc.when == "mid_read":
        assert o.read_released is not None  # D cancelled a read that was in flight at the cut
    if sc.when == "before_claim":
        assert o.started is None  # no claim answered, no read posted: D's reservation went back unread
    if o.started is not None:  # a load that read: its end came first, on one clock
        assert o.ended is not None
        assert o.ended < o.released, f"D ended its read {o.ended - o.released:.3f}s after P released the lease"
        if o.read_released is not None:
            assert o.read_released < o.released, "D released its pending read after P released the lease"
        assert o.reused is None or o.ended < o.reused, "a block was allocated again while D was reading it"


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda sc: sc.id)
def test_a_cut_link_never_lets_a_read_outlive_its_lease(site: Site, sc: Scenario) -> None:
    o = run_scenario(site, sc)
    assert_read_ended_first(sc, o)
    if o.second is not None:  # its claim went into the cut: no read, and the first read still ended in time
        assert_read_ended_first(Scenario("before_claim", sc.cut, sc.etcd), o.second)
    assert o.log_violations == []
    cli = replay_cli_check(site.logs / "p", site.logs / "d")  # the logs merged by HLC check clean
    assert cli.returncode == 0, cli.stdout + cli.stderr


@pytest.mark.mutants
def test_mutant_a_read_bound_past_the_lease_is_caught(site: Site) -> None:
    """D's read bound moved past P's expiry (1.1 TTL instead of 0.9): the scenario's one-clock check fails."""
    sc = Scenario("mid_read", "two_way")
    o = run_scenario(site, sc, read_bound_fraction=1.1)
    with pytest.raises(AssertionError, match="after P released the lease"):
        assert_read_ended_first(sc, o)
    print(f"the logs' own checks on the mutant's run: {o.log_violations or 'clean'}")


def test_the_one_clock_check_catches_a_read_that_outlived_its_lease() -> None:
    """The check above, fed logs in which D's load failed after P released the lease and reused a block, fails."""
    blocks = ev.pack_blocks(np.asarray([1, 2], dtype=np.int32))
    p_events = [ev.SrcAllocated(1, 0.0, "r", blocks), ev.SrcGranted(2, 0.1, "r", "t", 1, 1, 2.6),
                ev.SrcLeaseReleased(5, 2.6, "t", "expired"), ev.SrcAllocated(6, 2.61, "x", blocks)]
    d_events = [ev.TgtReserved(3, 0.2, "r", blocks), ev.TgtLoadStarted(4, 0.3, "r", "t", 1, 1),
                ev.TgtLoadFailed(7, 2.65, "t", "late", False)]
    o = outcome(p_events, d_events, "t", "r", [1, 2], 0.5, {"t": [2.64, "PENDING"]}, None)
    assert o.ended is not None and o.released is not None and o.reused is not None
    assert not o.ended < o.released and not o.ended < o.reused and not o.read_released < o.released
