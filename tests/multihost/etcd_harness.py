"""A real etcd (3.4, Debian's etcd-server) for the multi-host tests: one member, started inside a host namespace (or
on 127.0.0.1), with its data in a temp dir so a stop and a restart keep its keys and leases, as a real outage does.

Readiness is etcd's own "ready to serve client requests" line in its log, waited for with a bound.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns_harness import Host

READY_LINE = "ready to serve client requests"
START_TIMEOUT_S = 20.0


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class EtcdServer:
    data_dir: Path
    host: Host | None = None  # None: the current namespace, on 127.0.0.1
    client_port: int = 2379
    peer_port: int = 2380
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.data_dir.parent / f"{self.data_dir.name}.log"

    @property
    def address(self) -> str:
        return self.host.address if self.host is not None else "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.client_port}"

    def start(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError("etcd is running")
        client = f"http://{self.address}:{self.client_port}"
        peer = f"http://127.0.0.1:{self.peer_port}"  # one member: its peer port never leaves the host
        argv = ["etcd", "--name", "kvl", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"kvl={peer}"]  # a restart finds its data dir and ignores the cluster flags
        offset = self.log.stat().st_size if self.log.exists() else 0
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        if self.host is not None:
            self.proc = self.host.popen(argv, env=env, log=self.log)
        else:
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited ({self.proc.returncode}) at start: {self._tail(offset)}")
            if READY_LINE in self._tail(offset):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd not ready in {START_TIMEOUT_S}s: {self._tail(offset)}")

    def _tail(self, offset: int) -> str:
        try:
            with open(self.log, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")[-4000:]
        except FileNotFoundError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None
