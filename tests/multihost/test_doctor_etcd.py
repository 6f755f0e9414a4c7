"""``kvlifecycle doctor --etcd`` against a real etcd, run as a user runs it (the CLI in a subprocess): each endpoint
checked on its own, the registrations listed with their lease's time left, the findings, and a clear failure line
and exit status 1 when no endpoint answers."""

from __future__ import annotations

import json
import subprocess
import sys

import etcd_harness as eh
import pytest

from kvlifecycle.membership import EtcdOptions, EtcdSession, Member, MemberKey, Registration, Role

pytestmark = pytest.mark.multihost

TTL_S = 5
CLUSTER = "doc"


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlifecycle", "doctor", "--etcd-timeout", "1", *args],
                          capture_output=True, text=True, timeout=60)


def test_doctor_lists_the_registrations_and_names_a_dead_endpoint(local_etcd: eh.EtcdServer) -> None:
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S))
    dead = f"127.0.0.1:{eh.free_port()}"  # nothing listens there
    regs = [Registration(session, MemberKey(CLUSTER, Role.PREFILL, "p0", 1, 2),
                         Member("tcp://10.213.0.2:5600", "p0-agent", 7, api="10.213.0.2:8100")),
            Registration(session, MemberKey(CLUSTER, Role.DECODE, "d0"), Member("", "d0-agent", 3))]
    try:
        for reg in regs:
            reg.register()
        out = doctor("--etcd", f"{dead},{local_etcd.endpoint}", "--etcd-cluster", CLUSTER, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert [(e["endpoint"], e["ok"]) for e in report["endpoints"]] == [(dead, False), (local_etcd.endpoint, True)]
        assert dead in report["endpoints"][0]["detail"]
        rows = {(r["role"], r["instance"]): r for r in report["registrations"]}
        assert set(rows) == {("prefill", "p0"), ("decode", "d0")}
        p0 = rows[("prefill", "p0")]
        assert (p0["dp"], p0["tp"], p0["address"], p0["api"], p0["agent"], p0["epoch"], p0["state"]) == (
            1, 2, "tcp://10.213.0.2:5600", "10.213.0.2:8100", "p0-agent", 7, "serving")
        assert p0["lease"] == f"{regs[0].lease_id:x}"
        assert 0 < p0["ttl_left_s"] <= TTL_S
        assert report["findings"] == ["decode d0: no rank names an HTTP api (kvlifecycle proxy --etcd cannot route "
                                      "to it)"]
        text = doctor("--etcd", local_etcd.endpoint, "--etcd-cluster", CLUSTER)
        assert text.returncode == 0
        assert "2 registration(s)" in text.stdout and "tcp://10.213.0.2:5600" in text.stdout
        assert text.stdout.rstrip().endswith("etcd OK")
    finally:
        for reg in regs:
            reg.deregister()
        session.close()


def test_doctor_fails_with_a_clear_line_when_etcd_is_unreachable(local_etcd: eh.EtcdServer) -> None:
    local_etcd.stop()
    out = doctor("--etcd", local_etcd.endpoint)
    assert out.returncode == 1
    assert f"{local_etcd.endpoint}: FAILED: etcd at {local_etcd.endpoint} unavailable" in out.stdout
    assert f"etcd FAILED: no endpoint of {local_etcd.endpoint} answered" in out.stdout
