#!/usr/bin/env python3
"""P and D on two hosts with etcd, shown step by step: each host a network namespace (root needed), a real etcd on a
third, NIXL over UCX TCP between them, the side channel on each host's address with HMAC on.

    sudo .venv/bin/python scripts/demo_hosts.py [--requests N] [--out DIR]

It registers P in etcd, lets D find it there, hands off requests (bytes checked), kills P mid-transfer and shows D
learning it through etcd, restarts P (a new agent epoch) and hands off again; then it replays and checks the logs.
Everything it made (namespaces, processes) is removed at the end. The hosts and etcd come from the multi-host test
harness (tests/multihost), so the demo and the tests run the same way.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "multihost"))

import etcd_harness as eh  # noqa: E402  (the harness lives beside the tests)
import netns_harness as nh  # noqa: E402
from host_worker import HostWorker  # noqa: E402

from kvlifecycle.replay import check, check_pair, replay  # noqa: E402
from kvlifecycle.tools.workers import WorkerConfig  # noqa: E402

TTL_S = 2
SHAPE = {"regions": 16, "blocks": 64, "block_bytes": 16384}


def wait_for(predicate, timeout_s: float):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--out", default=None, help="directory for logs (default: a temp dir)")
    args = parser.parse_args()
    reason = nh.unavailable_reason() or (None if eh.etcd_binary() else "etcd is missing: scripts/setup-etcd.sh")
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    out = Path(args.out or tempfile.mkdtemp(prefix="kvl-hosts-"))
    out.mkdir(parents=True, exist_ok=True)
    nh.sweep_leftovers()
    ok = True
    with nh.cluster() as cluster:
        hosts = {name: cluster.add_host(name) for name in ("etcd", "p", "d")}
        for h in hosts.values():
            print(f"  host {h.name:<4} namespace {h.netns:<18} {h.address} on {h.device}")
        etcd = eh.EtcdServer(out / "etcd", host=hosts["etcd"])
        etcd.start()
        workers: list[HostWorker] = []

        def start(host: str, side: str, log: str, **kw: object) -> HostWorker:
            h = hosts[host]
            cfg = WorkerConfig(side, host, log_dir=str(out / log), host=h.address, secret="demo", **{**SHAPE, **kw})
            w = HostWorker(h, cfg, log=out / f"{log}.out")
            workers.append(w)
            return w

        try:
            print(f"  etcd {etcd.endpoint} ready")
            p = start("p", "producer", "p-first", seed=1)
            d = start("d", "consumer", "d")
            key = p.call("join", [etcd.endpoint], "demo", "prefill-0", TTL_S)["key"]
            print(f"  P registered {key} -> {p.hello['address']} epoch {p.hello['epoch']} (lease TTL {TTL_S}s)")
            d.call("follow", [etcd.endpoint], "demo", TTL_S)
            assert wait_for(lambda: d.call("links"), 30.0), "D did not connect to P"
            link = d.call("links")[0]
            print(f"  D found P in etcd and connected: probe {link['probe_gbps']:.2f} GB/s over "
                  f"{link['probe_backend']} (UCX_TLS=tcp on the veth links)")
            per = 4
            for i in range(args.requests):
                src, dst = [i * per + k for k in range(per)], [63 - i * per - k for k in range(per)]
                grant = p.call("alloc_grant", f"r{i}", src)
                d.call("reserve", f"r{i}", dst)
                d.call("pull", f"r{i}", [[p.hello["address"], grant]])
                ok &= bool(d.call("wait", 30.0)) and d.call("digest", dst) == p.call("digest", src)
                d.call("finish", f"r{i}")
                wait_for(lambda: p.call("free_released"), 10.0)
            print(f"  {args.requests} requests P -> D, bytes {'match' if ok else 'DIFFER'}")
            hosts["p"].run(["tc", "qdisc", "add", "dev", nh.DEVICE, "root", "tbf", "rate", "40mbit",
                            "burst", "64kb", "latency", "500ms"])  # slow P's link: the next read is long
            blocks = list(range(SHAPE["blocks"]))
            grant = p.call("alloc_grant", "doomed", blocks)
            d.call("reserve", "doomed", blocks)
            killed = d.call("pull_and_kill", "doomed", [[p.hello["address"], grant]], p.proc.pid)
            lost = wait_for(lambda: [e for e in d.call("peer_events") if e["kind"] == "lost"], 5 * TTL_S + 5)
            ok &= bool(lost)
            if lost:
                print(f"  P SIGKILLed with a read in flight: D saw its key go through etcd "
                      f"{lost[0]['at'] - killed['killed_at']:.2f}s later; the load "
                      f"{'failed cleanly' if d.call('request_state', 'doomed') is None else 'DID NOT FAIL'}")
            hosts["p"].run(["tc", "qdisc", "del", "dev", nh.DEVICE, "root"])
            p2 = start("p", "producer", "p-second", seed=2)
            p2.call("join", [etcd.endpoint], "demo", "prefill-0", TTL_S)
            ok &= bool(wait_for(lambda: [x for x in d.call("links") if x["epoch"] == p2.hello["epoch"]], 30.0))
            grant = p2.call("alloc_grant", "after", [1, 2])
            d.call("reserve", "after", [5, 6])
            d.call("pull", "after", [[p2.hello["address"], grant]])
            ok &= bool(d.call("wait", 30.0)) and d.call("digest", [5, 6]) == p2.call("digest", [1, 2])
            d.call("finish", "after")
            wait_for(lambda: p2.call("free_released"), 10.0)
            print(f"  P restarted as epoch {p2.hello['epoch']}: D connected to it through etcd and pulled again")
        finally:
            for w in reversed(workers):
                if w.proc.is_alive():
                    w.stop()
            etcd.close()
    problems = [str(v) for n in ("p-second", "d") for v in check(replay(out / n), quiescent=True)]
    problems += [str(v) for v in check_pair([replay(out / "p-second"), replay(out / "d")])]
    for line in problems:
        print(f"  VIOLATION {line}")
    ok &= not problems
    print(f"demo --hosts {'OK' if ok else 'FAILED'}: logs in {out}; namespaces left: "
          f"{[n for n in nh.list_namespaces() if n.startswith(nh.PREFIX)] or 'none'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
