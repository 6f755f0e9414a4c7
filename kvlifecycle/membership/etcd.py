"""The one place that talks to etcd: a small session over ``etcd-sdk-python`` (import name ``pyetcd``), imported
lazily so the core stays light (``pip install kvlifecycle[etcd]``).

Why this client: it is synchronous over gRPC with a thread per watch, which matches the handoff's threads (no
asyncio loop to host inside an engine); it speaks etcd's v3 gRPC API directly (no grpc-gateway, whose paths moved
between etcd 3.3 and 3.5); it installs with the grpcio/protobuf wheels here and works against etcd 3.4. ``aetcd``
is asyncio-only; ``etcd3gw`` goes through the HTTP gateway and pulls in requests, futurist and pbr.

The client marks an endpoint failed for minutes after one error; a session therefore drops its client after any
failed call and builds a fresh one on the next (an etcd that comes back is used at once). Every call is bounded
by ``request_timeout_s``. A failed call raises :class:`EtcdUnavailableError`, which names the endpoints and the
operation.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

log = logging.getLogger("kvlifecycle.membership")

T = TypeVar("T")

# A watch stream to an etcd that went silent (its host cut off, no reset) must break, so the watcher resyncs
# instead of waiting on a dead stream: gRPC pings every 10 s and gives up 5 s later. Not more often: etcd answers
# pings below its --grpc-keepalive-min-time (5 s), or any ping while no stream is open, with "too many pings" and
# closes the connection: so pings only while a call (the watch) is open.
GRPC_KEEPALIVE = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000),
                  ("grpc.keepalive_permit_without_calls", 0)]


class MembershipError(RuntimeError):
    pass


class EtcdUnavailableError(MembershipError):
    """etcd could not be reached (or answered an error) for a registration, a keep-alive or a discovery."""


class EtcdClientMissingError(MembershipError, ImportError):
    """The etcd client is not installed."""


@dataclass(frozen=True, slots=True)
class EtcdOptions:
    """How to reach etcd and how long a registration lives without a keep-alive."""

    endpoints: tuple[str, ...]  # "host:port" or "http://host:port"
    cluster: str = "default"
    lease_ttl_s: int = 5  # etcd lease TTL: a dead worker's key goes within this (plus etcd's expiry tick)
    keepalive_every_s: float | None = None  # default: a third of the TTL
    request_timeout_s: float = 2.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(e for e in self.endpoints.split(",") if e.strip()))
        if not self.endpoints:
            raise ValueError("at least one etcd endpoint is needed")
        for endpoint in self.endpoints:
            parse_endpoint(endpoint)
        if int(self.lease_ttl_s) != self.lease_ttl_s or self.lease_ttl_s < 2:
            raise ValueError(f"lease_ttl_s must be a whole number of seconds >= 2 (etcd's minimum), "
                             f"got {self.lease_ttl_s}")
        if self.keepalive_every_s is not None and not 0 < self.keepalive_every_s < self.lease_ttl_s:
            raise ValueError("keepalive_every_s must be within (0, lease_ttl_s)")
        if not 0 < self.backoff_initial_s <= self.backoff_max_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")

    @property
    def keepalive_interval_s(self) -> float:
        return self.keepalive_every_s or self.lease_ttl_s / 3


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            if scheme == "https://":
                raise ValueError(f"{endpoint!r}: TLS endpoints are not supported yet")
            text = text[len(scheme):]
    host, sep, port = text.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


class Backoff:
    """Exponential backoff with jitter, capped: ``next()`` is the wait before the next try."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        self.initial_s, self.max_s = initial_s, max_s
        self._current = initial_s

    def next(self) -> float:
        wait = self._current * (0.5 + random.random() / 2)
        self._current = min(self._current * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self._current = self.initial_s


def _import_client() -> Any:
    try:
        import pyetcd
    except ImportError as exc:
        raise EtcdClientMissingError(
            "the etcd client is not installed: pip install 'kvlifecycle[etcd]' (etcd-sdk-python)") from exc
    return pyetcd


class EtcdSession:
    """A thread-safe handle on etcd: ``call(what, fn)`` runs ``fn(client)`` with a bounded timeout."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self._client: Any = None
        self.failures = 0

    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                pyetcd = _import_client()
                endpoints = [pyetcd.Endpoint(*parse_endpoint(e), secure=False, time_retry=self.options.backoff_max_s,
                                             opts=GRPC_KEEPALIVE) for e in self.options.endpoints]
                self._client = pyetcd.MultiEndpointEtcd3Client(
                    endpoints=endpoints, timeout=self.options.request_timeout_s, failover=True)
            return self._client

    def call(self, what: str, fn: Callable[[Any], T]) -> T:
        try:
            return fn(self.client())
        except EtcdClientMissingError:
            raise
        except Exception as exc:  # grpc.RpcError, pyetcd's own errors, its "failed node" ValueError: all mean unusable
            self.failures += 1
            self.reset()
            raise EtcdUnavailableError(
                f"etcd at {','.join(self.options.endpoints)} unavailable during {what}: "
                f"{type(exc).__name__}: {exc}") from exc

    def reset(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception as exc:  # closing a broken channel may fail too; it is dropped either way
                log.debug("closing etcd client: %s", exc)

    def close(self) -> None:
        self.reset()
