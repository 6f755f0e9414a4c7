"""The engine instances of the cluster as a router sees them: which P and D instances are registered, which of
them take new requests, and where their OpenAI-compatible HTTP servers listen.

A router routes to instances, not ranks: the ranks of one instance (its DP and TP ranks) register one key each,
and the rank that hosts the instance's HTTP server writes its address in :attr:`Member.api`. An instance is
*routable* while one of its ranks names an ``api`` and none of them is draining (a draining P finishes what it
has and must get nothing new). Its ranks' etcd leases are its liveness: when the last rank's key goes, so does the
instance.

etcd unavailable: the last known instances stay routable (the watchers keep what they knew; the data path does not
need etcd) and one warning says so; the watchers retry with backoff and, once etcd answers, resync and report the
difference. At start, an etcd that does not answer is retried in the background (bounded backoff), so a router
can serve a static list meanwhile.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from kvlifecycle.membership.etcd import Backoff, EtcdSession, EtcdUnavailableError
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, Role
from kvlifecycle.membership.watcher import PeerWatcher

log = logging.getLogger("kvlifecycle.membership")


@dataclass(frozen=True, slots=True, order=True)
class Instance:
    """One routable engine instance."""

    role: Role
    name: str
    api: str  # host:port of its HTTP server
    ranks: int  # how many of its ranks are registered


Routable = dict[Role, tuple[Instance, ...]]
ChangeCallback = Callable[[Routable], None]


def routable_instances(role: Role, peers: dict[MemberKey, Member]) -> tuple[Instance, ...]:
    """Group ``peers`` (one role's registered ranks) by instance; keep those with an ``api`` and no rank
    draining. Sorted by name, so every router of the cluster sees one order."""
    ranks: dict[str, list[tuple[MemberKey, Member]]] = {}
    for key, member in peers.items():
        ranks.setdefault(key.instance, []).append((key, member))
    out = []
    for name, members in sorted(ranks.items()):
        if any(m.state is MemberState.DRAINING for _, m in members):
            continue
        apis = [m.api for _, m in sorted(members, key=lambda km: km[0]) if m.api]
        if apis:
            out.append(Instance(Role(role), name, apis[0], len(members)))
    return tuple(out)


class InstanceDirectory:
    """Follows the P and D instances of one cluster; ``on_change`` gets the routable sets whenever they change
    (on a watcher thread: keep it short)."""

    def __init__(self, session: EtcdSession, *, on_change: ChangeCallback | None = None) -> None:
        self.session = session
        self.on_change = on_change
        self._lock = threading.Lock()
        self._last: Routable = {role: () for role in Role}
        self._down: set[Role] = set()
        self._stop = threading.Event()
        self._starter: threading.Thread | None = None
        self.watchers = {role: PeerWatcher(session, role, on_joined=self._changed, on_lost=self._changed,
                                           on_updated=self._changed,
                                           on_connection=functools.partial(self._connection, role))
                         for role in Role}
        self.started = threading.Event()  # set once both watchers have listed etcd

    def routable(self) -> Routable:
        return {role: routable_instances(role, watcher.peers()) for role, watcher in self.watchers.items()}

    def start(self) -> None:
        """Start following etcd on a background thread: it retries (bounded backoff, each call bounded by the
        session's timeout) until both roles are listed, then the watchers take over."""
        self._starter = threading.Thread(target=self._start_watchers, name="etcd-instances-start", daemon=True)
        self._starter.start()

    def close(self) -> None:
        self._stop.set()
        if self._starter is not None:
            self._starter.join(self.session.options.request_timeout_s * 2 + 1)
        for watcher in self.watchers.values():
            watcher.close()

    def _start_watchers(self) -> None:
        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        pending = list(Role)
        tries = 0
        while pending and not self._stop.is_set():
            try:
                self.watchers[pending[0]].start()
                pending.pop(0)
                continue
            except EtcdUnavailableError as exc:
                tries += 1
                wait = backoff.next()
                if tries == 1 or tries % 20 == 0:
                    log.warning("etcd unavailable at start (try %d): no instance discovered yet, retrying with "
                                "backoff: %s", tries, exc)
                self._stop.wait(wait)
        if not pending:
            if tries:
                log.info("etcd answered after %d failed tr%s: following its instances", tries,
                         "y" if tries == 1 else "ies")
            self.started.set()
            self._changed()

    # -- watcher callbacks ------------------------------------------------------------------------------------------
    def _changed(self, _key: MemberKey | None = None, _member: Member | None = None) -> None:
        routable = self.routable()
        with self._lock:
            if routable == self._last:
                return
            self._last = routable
        log.info("routable instances: prefill %s; decode %s", _names(routable[Role.PREFILL]),
                 _names(routable[Role.DECODE]))
        if self.on_change is not None:
            try:
                self.on_change(routable)
            except Exception:
                log.exception("instance change callback failed")

    def _connection(self, role: Role, up: bool, why: str) -> None:
        with self._lock:
            was_down = bool(self._down)
            (self._down.discard if up else self._down.add)(role)
            now_down = bool(self._down)
            last = self._last
        if now_down and not was_down:
            log.warning("etcd unavailable: routing over the last known %d prefill and %d decode instance(s) "
                        "until it answers again (retrying with backoff): %s", len(last[Role.PREFILL]),
                        len(last[Role.DECODE]), why)
        elif was_down and not now_down:
            log.info("etcd reachable again: instances resynced")


def _names(instances: tuple[Instance, ...]) -> str:
    return ", ".join(f"{i.name}@{i.api}" for i in instances) or "(none)"
