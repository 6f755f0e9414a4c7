"""A real etcd (3.4, Debian's etcd-server) for the multi-host tests: one member, started inside a host namespace (or
on 127.0.0.1), with its data in a temp dir so a stop and a restart keep its keys and leases, as a real outage does.

Readiness is etcd's own "ready to serve client requests" line in its log, waited for with a bound.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from netns_harness import Host

READY_LINE = "ready to serve client requests"
START_TIMEOUT_S = 90.0  # etcd opens and fsyncs its WAL: slow on a loaded machine


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def free_port() -> int:
    """A free port on 127.0.0.1 *below* the ephemeral range: the kernel hands ephemeral ports to outgoing
    connections at any time, so one of those taken for etcd could be in use by the time etcd restarts."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")


TMPFS = Path("/dev/shm")


def sweep_leftovers() -> list[str]:
    """Remove the tmpfs data dirs of earlier runs whose process is gone (``kvl-<pid>-etcd-*``)."""
    swept = []
    for path in TMPFS.glob("kvl-*-etcd-*") if TMPFS.is_dir() else []:
        pid = path.name.split("-")[1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            swept.append(str(path))
    return swept


@dataclass
class EtcdServer:
    """``work`` holds etcd's log; its data goes to a tmpfs when there is one (its fsyncs then cost nothing on a
    loaded disk) and :meth:`close` removes it."""

    work: Path
    host: Host | None = None  # None: the current namespace, on 127.0.0.1
    client_port: int = 2379
    peer_port: int = 2380
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    data_dir: Path = field(init=False)
    log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.log = self.work / "etcd.log"
        base = TMPFS if TMPFS.is_dir() and os.access(TMPFS, os.W_OK) else self.work
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"kvl-{os.getpid()}-etcd-", dir=base))

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

    def close(self) -> None:
        """Stop etcd and remove its data."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
