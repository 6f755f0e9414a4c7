"""The host fixture itself: namespaces and their processes go at the end, also when the body fails; a dead run's
leftovers are swept by their name; a host has no route beyond the test subnet."""

from __future__ import annotations

import subprocess
import sys

import netns_harness as nh
import pytest

pytestmark = pytest.mark.multihost


def test_a_failing_body_still_removes_namespaces_and_their_processes(swept: list[str]) -> None:
    made: list[str] = []
    sleeper = None
    with pytest.raises(RuntimeError, match="the test body failed"), nh.cluster() as c:
        host = c.add_host("a")
        c.add_host("b")
        made = c.namespaces()
        sleeper = host.popen(["sleep", "60"])
        assert nh.namespace_pids(host.netns) == [sleeper.pid]
        raise RuntimeError("the test body failed")
    assert sleeper is not None and sleeper.wait(5) is not None
    assert not set(made) & set(nh.list_namespaces())


def test_leftovers_of_a_dead_run_are_swept_and_a_live_runs_are_kept(swept: list[str]) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30, check=True)
    leftover = f"{nh.PREFIX}{int(dead.stdout)}-x"
    nh.ip("netns", "add", leftover)
    stray = subprocess.Popen(["ip", "netns", "exec", leftover, "sleep", "60"], start_new_session=True)
    try:
        with nh.cluster() as live:
            live.add_host("c")
            assert leftover in nh.sweep_leftovers()
            assert leftover not in nh.list_namespaces() and stray.wait(10) is not None
            assert set(live.namespaces()) <= set(nh.list_namespaces())  # ours (a live pid) untouched
    finally:
        if stray.poll() is None:
            stray.kill()
        nh.ip("netns", "del", leftover, check=False)


def test_a_host_reaches_the_test_subnet_only(cluster: nh.Cluster) -> None:
    host = cluster.add_host("r")
    routes = host.run(["ip", "-4", "route", "show"]).stdout.split("\n")
    assert [r.split()[0] for r in routes if r.strip()] == [f"{nh.SUBNET}.0/24"]  # no default route
    links = host.run(["ip", "-o", "link", "show"]).stdout
    assert "lo:" in links and f"{nh.DEVICE}@" in links and links.count(": <") == 2
