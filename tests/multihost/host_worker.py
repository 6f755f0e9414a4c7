"""A P or D worker inside a host namespace, with membership commands: the handoff worker (kvlifecycle.tools.workers)
plus registration, draining and D's etcd-fed directory.

The test process starts it as ``ip netns exec <ns> python host_worker.py <fd> <config hex>`` (see
:class:`HostWorker`); commands travel over the inherited socket ``fd`` exactly as over the harness's pipe.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from kvlifecycle.tools.workers import COMMAND_TIMEOUT_S, HandoffWorker, WorkerConfig, WorkerProcess, worker_main

HERE = Path(__file__).resolve().parent
# a start imports torch and NIXL: on a loaded 2-core machine that has taken over a minute
START_TIMEOUT_S = max(COMMAND_TIMEOUT_S, 180.0)


class MemberWorker(HandoffWorker):
    """Commands a multi-host test needs beyond the handoff worker's."""

    presence: Any = None
    directory: Any = None

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg)
        from kvlifecycle import events as ev

        self._failures: list[str] = []
        self._sessions: list[Any] = []
        self.ledger.listeners.append(
            lambda e: self._failures.append(e.reason) if isinstance(e, ev.TgtLoadFailed) else None)

    def _session(self, endpoints: list[str], cluster: str, ttl_s: int) -> Any:
        from kvlifecycle.membership import EtcdOptions, EtcdSession

        session = EtcdSession(EtcdOptions(tuple(endpoints), cluster=cluster, lease_ttl_s=ttl_s,
                                          request_timeout_s=1.0, backoff_max_s=0.5))
        self._sessions.append(session)
        return session

    # -- both: register in etcd, follow the other side --------------------------------------------------------------
    def join(self, endpoints: list[str], cluster: str, instance: str, ttl_s: int = 2,
             retry_for_s: float = 10.0) -> dict[str, Any]:
        from kvlifecycle.membership import ConsumerPresence, ProducerPresence

        if self.presence is None:
            session = self._session(endpoints, cluster, ttl_s)
            kind = ProducerPresence if self.cfg.side == "producer" else ConsumerPresence
            self.presence = kind(self.role, session, instance)
        self.presence.register(retry_for_s=retry_for_s)
        return {"key": self.presence.registration.key.path, "lease": self.presence.registration.lease_id}

    def alloc_grant(self, request: str, blocks: list[int], consumers: int = 1, ttl_s: float | None = None) -> dict:
        if self.presence is not None and self.presence.draining:
            from kvlifecycle.membership import DrainingError

            raise DrainingError(f"draining: no new grant for {request!r}")
        return super().alloc_grant(request, blocks, consumers, ttl_s)

    def registration(self) -> dict[str, Any]:
        reg = self.presence.registration
        return {"lost": reg.lost, "keepalives": reg.keepalives, "keepalive_failures": reg.keepalive_failures}

    def drain(self, timeout_s: float = 30.0) -> bool:
        return bool(self.presence.drain(timeout_s=timeout_s))

    def follow(self, endpoints: list[str], cluster: str, ttl_s: int = 2, push: bool = True) -> None:
        """D follows the P ranks (connects, invalidates); P follows the D ranks (releases a lost one's leases)."""
        from kvlifecycle.membership import ConsumerDirectory, ProducerDirectory

        session = self._session(endpoints, cluster, ttl_s)
        if self.cfg.side == "producer":
            self.directory = ConsumerDirectory(self.role, session)
        else:
            self.directory = ProducerDirectory(self.role, session, push=push)
        self.directory.start(retry_for_s=10.0)

    # -- D ----------------------------------------------------------------------------------------------------------
    def peer_events(self) -> list[dict[str, Any]]:
        return [{"kind": e.kind, "key": e.key.path, "agent": e.agent, "epoch": e.epoch, "at": e.at,
                 "detail": e.detail} for e in list(self.directory.events)]

    def serving(self) -> list[dict[str, Any]]:
        return [{"key": k.path, "agent": m.agent, "epoch": m.epoch, "address": m.address}
                for k, m in sorted(self.directory.serving().items())]

    def links(self) -> list[dict[str, Any]]:
        return sorted(({"agent": link.agent, "epoch": link.epoch, "address": link.address,
                        "probe_backend": link.probe.backend if link.probe else None,
                        "probe_gbps": link.probe.gbps if link.probe else None} for link in self.role.links.values()),
                      key=lambda x: x["agent"])

    def pull_posted(self, request: str, grants: list[list[Any]]) -> dict[str, Any]:
        """Start a pull and return once its READ is posted (or the load ended first: ``posted`` False)."""
        transfer = self.pull(request, grants)
        deadline = time.monotonic() + 10.0
        posted = False
        while time.monotonic() < deadline:
            load = self.role._loads.get(transfer)
            if load is None or load.handles:
                posted = load is not None
                break
            time.sleep(0)
        return {"transfer": transfer, "posted": posted, "at": time.time()}

    def pull_and_kill(self, request: str, grants: list[list[Any]], pid: int) -> dict[str, Any]:
        """Start a pull and SIGKILL the P process ``pid`` as soon as the READ is posted (mid-transfer)."""
        out = self.pull_posted(request, grants)
        out["killed_at"] = time.time()
        os.kill(pid, signal.SIGKILL)
        return out

    def failures(self) -> list[str]:
        """The reasons of D's failed loads, as its ledger recorded them."""
        return list(self._failures)

    def stop(self) -> dict[str, Any]:
        if self.directory is not None:
            self.directory.close()
        if self.presence is not None:
            self.presence.close()
        for session in self._sessions:
            session.close()
        return super().stop()


class _PopenProcess:
    """The slice of multiprocessing.Process that :class:`WorkerProcess` uses, over a Popen."""

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, signal.SIGKILL)

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()


class HostWorker(WorkerProcess):
    """A :class:`WorkerProcess` whose process runs inside ``host`` (its namespace), NIXL over UCX TCP on its veth."""

    def __init__(self, host: Any, cfg: WorkerConfig, *, log: Path, start_timeout_s: float = START_TIMEOUT_S,
                 script: Path = HERE / "host_worker.py") -> None:
        """``script``: the worker's module (one with a ``main`` like this one's, for more commands)."""
        parent, child = socket.socketpair()
        self.cfg, self.host = cfg, host
        env = {**os.environ, **host.ucx_env()}
        argv = [sys.executable, str(script), str(child.fileno()),
                msgspec.msgpack.encode(asdict(cfg)).hex()]
        try:
            popen = host.popen(argv, env=env, log=log, pass_fds=[child.fileno()])
        finally:
            child.close()
        self.conn = Connection(parent.detach())
        self.proc = _PopenProcess(popen)  # type: ignore[assignment]
        self.hello = self._reply(start_timeout_s, "start")


def main() -> None:
    fd, cfg_hex = int(sys.argv[1]), sys.argv[2]
    worker_main(bytes.fromhex(cfg_hex), Connection(fd), MemberWorker)


if __name__ == "__main__":
    main()
