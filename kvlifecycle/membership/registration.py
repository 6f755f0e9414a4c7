"""A worker's presence in etcd: its key, under an etcd lease that a bounded thread keeps alive.

- ``register`` grants a lease of ``lease_ttl_s`` and puts the key on it, as a compare-and-swap on the key as read
  (:mod:`.fencing`): a key already holding a *newer* epoch of the same agent refuses the registration (an old
  incarnation never overwrites its successor); an older epoch is replaced (the restart of a worker whose previous
  lease has not run out yet): watchers see the epoch change and drop the old one.
- Every later write (``set_state``, ``deregister``, a re-registration) applies only while the key is still on this
  registration's lease. An incarnation that was replaced can neither overwrite nor delete its successor's key: the
  write is refused, says who holds the key now, and the lease, which holds nothing any more, is revoked.
- The keep-alive thread refreshes every ``keepalive_interval_s`` and then reads the key to check it is still ours,
  so a key that vanished or changed owner is noticed within one keep-alive interval (a third of the TTL unless
  set) plus a round trip. etcd unavailable: it keeps trying with backoff and the worker keeps serving its
  established peers; etcd extends every lease when it comes back, so an outage of etcd alone never expires anyone.
- This epoch is *lost* — ``on_lease_lost`` fires, :attr:`Registration.lost_reason` says why in words, and the
  registration stops — when the lease is gone (this worker was cut off for longer than the TTL), when the key
  vanished (someone deleted it), or when it names another agent or a newer epoch. Watchers have reported that
  epoch lost in each case and its peers have failed it; re-registering the dead epoch would resurrect it, so the
  worker must come back with a new agent epoch. The one case re-registered in place: the key holds this agent
  at this epoch or an older one under another lease (no watcher dropped this epoch: they ignore an older epoch
  of a known agent), put back on this lease by compare-and-swap.
- ``set_state(DRAINING)`` rewrites the value on the same lease; ``deregister`` deletes the key and revokes the
  lease (best effort: without etcd the lease runs out by itself) and returns how it left (:class:`Departure`).
"""

from __future__ import annotations

import enum
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvlifecycle.membership.etcd import Backoff, EtcdSession, EtcdUnavailableError, MembershipError
from kvlifecycle.membership.fencing import (
    Holder,
    delete_if_owned,
    put_if_owned,
    put_if_unchanged,
    read_holder,
)
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, encode_member

log = logging.getLogger("kvlifecycle.membership")

REGISTER_ATTEMPTS = 5  # compare-and-swaps tried while the key keeps changing under the registration


class StaleRegistrationError(MembershipError):
    """The key already names a newer epoch of this rank."""


class SupersededError(MembershipError):
    """The key is no longer on this registration's lease (another incarnation holds it, or it vanished): the write
    was refused and nothing changed."""


class Departure(str, enum.Enum):
    """How :meth:`Registration.deregister` left."""

    DELETED = "deleted"  # the key was ours and is gone
    SUPERSEDED = "superseded"  # another incarnation holds the key: left alone
    ALREADY_GONE = "already_gone"  # the key had vanished before
    UNREACHABLE = "unreachable"  # etcd did not answer: the key goes with the lease
    NOT_REGISTERED = "not_registered"  # never registered, or already deregistered


class Registration:
    """``key`` → ``member`` in etcd for as long as this worker lives (or until :meth:`deregister`)."""

    def __init__(self, session: EtcdSession, key: MemberKey, member: Member, *,
                 on_lease_lost: Callable[[MemberKey, Member], None] | None = None) -> None:
        self.session, self.key, self.member = session, key, member
        self.on_lease_lost = on_lease_lost
        self.lease_id: int | None = None
        self.lost = False
        self.lost_reason: str | None = None  # why this epoch is no longer registered, in words
        self.departure: Departure | None = None  # set by deregister
        self.keepalive_failures = 0
        self.keepalives = 0
        self.reregistrations = 0
        self._lease_revoked = False  # revoked or expired: nothing left to revoke
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
        path, value = self.key.path, encode_member(self.member)
        lease_id: int | None = None
        try:
            for _ in range(REGISTER_ATTEMPTS):
                holder = self.session.call(f"read {path}", lambda c: read_holder(c, path))
                if holder is not None and holder.member is not None and holder.member.agent == self.member.agent \
                        and holder.member.epoch > self.member.epoch:
                    raise StaleRegistrationError(f"{path} already holds epoch {holder.member.epoch} > "
                                                 f"{self.member.epoch}")
                if lease_id is None:
                    lease_id = int(self.session.call(f"grant a {ttl}s lease", lambda c: c.lease(ttl)).id)
                revision = 0 if holder is None else holder.revision
                outcome = self.session.call(f"put {path}", functools.partial(
                    put_if_unchanged, path=path, value=value, lease_id=lease_id, revision=revision))
                if outcome.applied:
                    self.lease_id = lease_id
                    log.info("registered %s (agent %s epoch %d) under lease %x, TTL %ds", path, self.member.agent,
                             self.member.epoch, lease_id, ttl)
                    return
            raise MembershipError(f"{path} changed under each of {REGISTER_ATTEMPTS} registration attempts")
        except EtcdUnavailableError:
            # Not revoked: the put may have applied unseen, and revoking would delete the key, which watchers would
            # take for this epoch's death. The retry reads the key back as our own epoch and moves it to its lease.
            raise
        except MembershipError:
            if lease_id is not None:  # ours, holding nothing: without this it would live out its TTL
                self._revoke(lease_id, path)
            raise

    def set_state(self, state: MemberState) -> None:
        """Rewrite the value (same lease) with ``state``, only while the key is still on this lease. Raises
        :class:`SupersededError` when it is not (nothing written), :class:`EtcdUnavailableError`."""
        member = msgspec.structs.replace(self.member, state=state)
        if self.lease_id is None:
            raise MembershipError(f"{self.key} is not registered")
        path, lease_id = self.key.path, self.lease_id
        outcome = self.session.call(f"put {path}", functools.partial(
            put_if_owned, path=path, value=encode_member(member), lease_id=lease_id))
        if not outcome.applied:
            why = self._not_ours(outcome.holder, lease_id)
            log.warning("%s not marked %s: %s", path, state.value, why)
            raise SupersededError(f"{path} not marked {state.value}: {why}")
        self.member = member

    def deregister(self) -> Departure:
        """Stop the keep-alive, delete the key if it is still on this lease, revoke the lease (each best effort,
        bounded). A key that another incarnation holds is left alone, and the return value says so."""
        self.close()
        if self.lease_id is None:
            return Departure.NOT_REGISTERED
        path, lease_id, self.lease_id = self.key.path, self.lease_id, None
        try:
            outcome = self.session.call(f"delete {path}", functools.partial(
                delete_if_owned, path=path, lease_id=lease_id))
        except EtcdUnavailableError as exc:
            log.warning("deregistering %s: %s (the lease runs out by itself)", path, exc)
            self.departure = Departure.UNREACHABLE
            return self.departure
        if outcome.applied:
            self.departure = Departure.DELETED
        else:
            self.departure = Departure.ALREADY_GONE if outcome.holder is None else Departure.SUPERSEDED
            log.warning("deregistering %s: key left as it is: %s", path, self._not_ours(outcome.holder, lease_id))
        if not self._lease_revoked:
            self._revoke(lease_id, path)
        return self.departure

    def close(self) -> None:
        """Stop the keep-alive only (the key goes when the lease runs out)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(self.session.options.request_timeout_s * 2 + 1)

    def _not_ours(self, holder: Holder | None, lease_id: int) -> str:
        mine = f"agent {self.member.agent} epoch {self.member.epoch} under lease {lease_id:x}"
        if holder is None:
            return f"the key is gone (deleted by someone else, or expired); {mine} is not registered any more"
        return f"the key now holds {holder.describe()}, not {mine}"

    def _revoke(self, lease_id: int, path: str) -> None:
        try:
            self.session.call("revoke the lease", lambda c: c.revoke_lease(lease_id))
            self._lease_revoked = True
        except EtcdUnavailableError as exc:
            log.warning("revoking the lease of %s: %s (it runs out by itself)", path, exc)

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
                if replies and replies[0].TTL > 0 and not self._still_ours(lease_id):
                    return
            except EtcdUnavailableError as exc:
                self.keepalive_failures += 1
                wait = min(backoff.next(), options.keepalive_interval_s)
                if self.keepalive_failures == 1 or self.keepalive_failures % 20 == 0:
                    log.warning("keep-alive of %s failed %d time(s); established peers keep working: %s",
                                self.key, self.keepalive_failures, exc)
                continue
            if not replies or replies[0].TTL <= 0:
                self._lease_revoked = True
                self._lose(f"its etcd lease {lease_id:x} expired: peers have dropped this epoch")
                return
            if self.keepalive_failures:
                log.info("keep-alive of %s recovered after %d failure(s)", self.key, self.keepalive_failures)
            self.keepalives += 1
            self.keepalive_failures = 0
            backoff.reset()
            wait = options.keepalive_interval_s

    def _still_ours(self, lease_id: int) -> bool:
        """Check the key is on our lease; re-register in place when that is safe (see the module's docstring), else
        revoke the lease and report the loss. False: the registration has stopped."""
        path = self.key.path
        holder = self.session.call(f"read {path}", lambda c: read_holder(c, path))
        if holder is not None and holder.lease == lease_id:
            return True
        mine = self.member
        if holder is not None and holder.member is not None and holder.member.agent == mine.agent \
                and holder.member.epoch <= mine.epoch and not self._stop.is_set():
            value = encode_member(msgspec.structs.replace(mine, state=holder.member.state)
                                  if holder.member.epoch == mine.epoch else mine)
            outcome = self.session.call(f"re-register {path}", functools.partial(
                put_if_unchanged, path=path, value=value, lease_id=lease_id, revision=holder.revision))
            if outcome.applied:
                self.reregistrations += 1
                log.warning("%s held %s: re-registered agent %s epoch %d under lease %x", path, holder.describe(),
                            mine.agent, mine.epoch, lease_id)
            return True  # a lost swap is looked at again on the next keep-alive
        why = self._not_ours(holder, lease_id)
        self._revoke(lease_id, path)
        self._lose(why)
        return False

    def _lose(self, why: str) -> None:
        self.lost, self.lost_reason = True, why
        log.error("%s (agent %s epoch %d) is no longer registered: %s; restart the agent with a new epoch",
                  self.key, self.member.agent, self.member.epoch, why)
        if self.on_lease_lost is not None:
            try:
                self.on_lease_lost(self.key, self.member)
            except Exception:
                log.exception("on_lease_lost hook failed")
