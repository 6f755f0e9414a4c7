"""Hosts as Linux network namespaces, for the multi-host tests.

Each host is a namespace ``kvl-<pid>-<host>`` with one veth link (``kvl0`` inside) to a bridge that lives in a
namespace of its own (``kvl-<pid>-br``), so nothing is added to the root namespace: its links, routes and
addresses are untouched and the test range (10.213.0.0/24) exists only inside these namespaces, with no route out.
Deleting the namespaces removes every link. The ``<pid>`` of the pytest process that made them lets a later run
sweep what a killed run left behind (:func:`sweep_leftovers`).

Processes run inside a host through ``ip netns exec`` (which also gives them the namespace's own ``/sys``, where
UCX reads its devices). Every command and wait here is bounded.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "kvl-"
SUBNET = "10.213.0"  # /24, inside the test namespaces only
DEVICE = "kvl0"  # the host's end of its veth pair, inside its namespace
COMMAND_TIMEOUT_S = 10.0


class NetnsUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no ``ip``, or the kernel refuses)."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def list_namespaces() -> list[str]:
    out = ip("netns", "list", check=False)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def namespace_pids(netns: str) -> list[int]:
    out = ip("netns", "pids", netns, check=False)
    return [int(tok) for tok in out.stdout.split() if tok.isdigit()]


def _kill_all_in(netns: str, timeout_s: float = 5.0) -> None:
    """SIGTERM every process in ``netns``, then SIGKILL what is still there (bounded)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = namespace_pids(netns)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            pids = namespace_pids(netns)
            time.sleep(0.05)
        if not pids:
            return


def delete_namespace(netns: str) -> None:
    _kill_all_in(netns)
    ip("netns", "del", netns, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_leftovers() -> list[str]:
    """Delete the namespaces (and their processes) of earlier runs whose pytest process is gone."""
    swept = []
    for name in list_namespaces():
        parts = name.split("-")
        if name.startswith(PREFIX) and len(parts) >= 3 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
            delete_namespace(name)
            swept.append(name)
    return swept


@dataclass
class Host:
    """One host: a namespace with one address on the test bridge."""

    name: str
    netns: str
    address: str
    device: str = DEVICE
    bridge_port: str = ""  # its veth's other end, in the bridge namespace
    bridge_netns: str = ""

    def exec_argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.netns, *argv]

    def popen(self, argv: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside this host (its own process group, so it can be killed whole; not a session of
        its own, which would be a scheduler autogroup of its own: vllm_harness.ManagedProcess says why)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (kept by the child)
        try:
            return subprocess.Popen(self.exec_argv(argv), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, pass_fds=tuple(pass_fds), process_group=0)
        finally:
            if log is not None:
                out.close()  # type: ignore[union-attr]

    def run(self, argv: Sequence[str], timeout_s: float = COMMAND_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.exec_argv(argv), capture_output=True, text=True, timeout=timeout_s)

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore this host's only link: a partition of the host from all others."""
        ip("link", "set", self.bridge_port, "up" if up else "down", netns=self.bridge_netns)

    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's veth only (no shared memory, no loopback device)."""
        return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.device}


@dataclass
class Cluster:
    """Hosts on one bridge; :meth:`close` removes every namespace (and every process left in them)."""

    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    bridge_netns: str = ""

    def __post_init__(self) -> None:
        self.bridge_netns = f"{self.tag}-br"
        ip("netns", "add", self.bridge_netns)
        ip("link", "set", "lo", "up", netns=self.bridge_netns)
        ip("link", "add", "br0", "type", "bridge", netns=self.bridge_netns)
        ip("link", "set", "br0", "up", netns=self.bridge_netns)

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists")
        index = len(self.hosts) + 1
        if index > 250:
            raise ValueError("the test /24 holds 250 hosts")
        netns = f"{self.tag}-{name}"
        port = f"v{index}"
        ip("netns", "add", netns)
        # both ends are made in the bridge namespace, then the host's end moves into the host
        ip("link", "add", port, "type", "veth", "peer", "name", DEVICE, "netns", netns, netns=self.bridge_netns)
        ip("link", "set", port, "master", "br0", netns=self.bridge_netns)
        ip("link", "set", port, "up", netns=self.bridge_netns)
        address = f"{SUBNET}.{index}"
        ip("addr", "add", f"{address}/24", "dev", DEVICE, netns=netns)
        ip("link", "set", DEVICE, "up", netns=netns)
        ip("link", "set", "lo", "up", netns=netns)
        host = Host(name, netns, address, DEVICE, port, self.bridge_netns)
        self.hosts[name] = host
        return host

    def namespaces(self) -> list[str]:
        return [h.netns for h in self.hosts.values()] + [self.bridge_netns]

    def close(self) -> None:
        for netns in self.namespaces():
            delete_namespace(netns)
        self.hosts.clear()


@contextlib.contextmanager
def cluster() -> Iterator[Cluster]:
    c = Cluster()
    try:
        yield c
    finally:
        c.close()
