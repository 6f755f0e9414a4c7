"""A worker's presence in etcd: its key, under an etcd lease that a bounded thread keeps alive.

- ``register`` grants a lease of ``lease_ttl_s`` and puts the key on it. A key already holding a *newer* epoch
  refuses the registration (an old incarnation never overwrites its successor); an older epoch is replaced (the
  restart of a worker whose previous lease has not run out yet): watchers see the epoch change and drop the old one.
- The keep-alive thread refreshes every ``keepalive_interval_s``. etcd unavailable: it keeps trying with backoff
  and the worker keeps serving its established peers; etcd extends every lease when it comes back, so an outage
  of etcd alone never expires anyone. If the lease is gone when etcd answers again (this worker was cut off for
  longer than the TTL), peers have already invalidated this epoch: ``on_lease_lost`` fires and the registration
  stops. The worker must come back with a new agent epoch; re-registering the dead epoch would resurrect a peer
  that its consumers have already failed.
- ``set_state(DRAINING)`` rewrites the value on the same lease; ``deregister`` deletes the key and revokes the
  lease (best effort: without etcd the lease runs out by itself).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvlifecycle.membership.etcd import Backoff, EtcdSession, EtcdUnavailableError, MembershipError
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, decode_member, encode_member

log = logging.getLogger("kvlifecycle.membership")


class StaleRegistrationError(MembershipError):
    """The key already names a newer epoch of this rank."""


class Registration:
    """``key`` → ``member`` in etcd for as long as this worker lives (or until :meth:`deregister`)."""

    def __init__(self, session: EtcdSession, key: MemberKey, member: Member, *,
                 on_lease_lost: Callable[[MemberKey, Member], None] | None = None) -> None:
        self.session, self.key, self.member = session, key, member
        self.on_lease_lost = on_lease_lost
        self.lease_id: int | None = None
        self.lost = False
        self.keepalive_failures = 0
        self.keepalives = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------------
    def register(self, *, retry_for_s: float = 0.0) -> None:
        """Put the key under a fresh lease and start the keep-alive. etcd unavailable: retries with backoff for
        ``retry_for_s`` (0: one try), then raises :class:`EtcdUnavailableError`."""
        if self._thread is not None:
            raise MembershipError(f"{self.key} is already registered")
        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                self._register_once()
                break
            except EtcdUnavailableError as exc:
                wait = backoff.next()
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("registering %s failed, retrying in %.2fs: %s", self.key, wait, exc)
                if self._stop.wait(wait):
                    raise
        self._thread = threading.Thread(target=self._keepalive, name=f"etcd-lease-{self.key.instance}", daemon=True)
        self._thread.start()

    def _register_once(self) -> None:
        ttl = self.session.options.lease_ttl_s
        path = self.key.path
        current = self.session.call(f"read {path}", lambda c: c.get(path))[0]
        if current is not None:
            try:
                known = decode_member(current)
            except (msgspec.DecodeError, msgspec.ValidationError):
                known = None
            if known is not None and known.agent == self.member.agent and known.epoch > self.member.epoch:
                raise StaleRegistrationError(f"{path} already holds epoch {known.epoch} > {self.member.epoch}")
        lease = self.session.call(f"grant a {ttl}s lease", lambda c: c.lease(ttl))
        self.session.call(f"put {path}", lambda c: c.put(path, encode_member(self.member), lease=lease.id))
        self.lease_id = lease.id
        log.info("registered %s (agent %s epoch %d) under lease %x, TTL %ds", path, self.member.agent,
                 self.member.epoch, lease.id, ttl)

    def set_state(self, state: MemberState) -> None:
        """Rewrite the value (same lease) with ``state``; raises :class:`EtcdUnavailableError`."""
        member = msgspec.structs.replace(self.member, state=state)
        if self.lease_id is None:
            raise MembershipError(f"{self.key} is not registered")
        path, lease_id = self.key.path, self.lease_id
        self.session.call(f"put {path}", lambda c: c.put(path, encode_member(member), lease=lease_id))
        self.member = member

    def deregister(self) -> None:
        """Stop the keep-alive, delete the key, revoke the lease (each best effort, bounded)."""
        self.close()
        if self.lease_id is None:
            return
        path, lease_id, self.lease_id = self.key.path, self.lease_id, None
        try:
            self.session.call(f"delete {path}", lambda c: c.delete(path))
            self.session.call("revoke the lease", lambda c: c.revoke_lease(lease_id))
        except EtcdUnavailableError as exc:
            log.warning("deregistering %s: %s (the lease runs out by itself)", path, exc)

    def close(self) -> None:
        """Stop the keep-alive only (the key goes when the lease runs out)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.session.options.request_timeout_s * 2 + 1)

    # -- keep-alive thread ------------------------------------------------------------------------------------------
    def _refresh(self, lease_id: int) -> list[Any]:
        """One keep-alive round trip: etcd's replies (none, or a TTL of 0: the lease is gone)."""
        return self.session.call("keep the lease alive", lambda c: list(c.refresh_lease(lease_id)))

    def _keepalive(self) -> None:
        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        wait = options.keepalive_interval_s
        while not self._stop.wait(wait):
            lease_id = self.lease_id
            if lease_id is None:
                return
            try:
                replies = self._refresh(lease_id)
            except EtcdUnavailableError as exc:
                self.keepalive_failures += 1
                wait = min(backoff.next(), options.keepalive_interval_s)
                if self.keepalive_failures == 1 or self.keepalive_failures % 20 == 0:
                    log.warning("keep-alive of %s failed %d time(s); established peers keep working: %s",
                                self.key, self.keepalive_failures, exc)
                continue
            if not replies or replies[0].TTL <= 0:
                self._lease_lost()
                return
            if self.keepalive_failures:
                log.info("keep-alive of %s recovered after %d failure(s)", self.key, self.keepalive_failures)
            self.keepalives += 1
            self.keepalive_failures = 0
            backoff.reset()
            wait = options.keepalive_interval_s

    def _lease_lost(self) -> None:
        self.lost = True
        log.error("the etcd lease of %s (agent %s epoch %d) expired: peers have dropped this epoch; restart the "
                  "agent with a new epoch", self.key, self.member.agent, self.member.epoch)
        if self.on_lease_lost is not None:
            try:
                self.on_lease_lost(self.key, self.member)
            except Exception:
                log.exception("on_lease_lost hook failed")
