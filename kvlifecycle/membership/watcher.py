"""Watching the registered peers of one role: joins, state changes and losses, as callbacks.

A peer is *lost* when its key is deleted (its lease expired: it died or was cut off for longer than the TTL; or it
deregistered after draining) or when its key names a newer epoch (it restarted before its old lease ran out).
The watcher keeps a map key → :class:`Member` and diffs against it, so a DELETE (which carries no value) still
says which agent and epoch went.

etcd unavailable: the known peers stay as they are (established transfers go on: etcd is the control plane, not
the data path), the watcher retries with backoff, and on reconnect lists the prefix again and diffs, so what
happened meanwhile is reported once, then watches from the listed revision on. Callbacks run on the watcher's
thread in etcd's order: keep them short (hand long work, such as a handshake, to another thread).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from kvlifecycle.membership.etcd import Backoff, EtcdSession, EtcdUnavailableError
from kvlifecycle.membership.keys import Member, MemberKey, Role, decode_member, role_prefix

log = logging.getLogger("kvlifecycle.membership")

PeerCallback = Callable[[MemberKey, Member], None]
ConnectionCallback = Callable[[bool, str], None]  # (etcd reachable, why not)

_WATCH_POLL_S = 0.2  # how often the watcher thread looks at its stop flag while no event arrives


def _noop(_key: MemberKey, _member: Member) -> None:
    pass


class PeerWatcher:
    """Follows ``/kvlifecycle/v1/<cluster>/<role>/``; calls ``on_joined``, ``on_updated`` and ``on_lost``."""

    def __init__(self, session: EtcdSession, role: Role, *, on_joined: PeerCallback = _noop,
                 on_lost: PeerCallback = _noop, on_updated: PeerCallback = _noop,
                 on_connection: ConnectionCallback | None = None) -> None:
        """``on_connection(False, why)`` once when the watch breaks, ``(True, "")`` once it has resynced."""
        self.session, self.role = session, Role(role)
        self.on_connection = on_connection
        self.prefix = role_prefix(session.options.cluster, self.role)
        self.on_joined, self.on_lost, self.on_updated = on_joined, on_lost, on_updated
        self._peers: dict[MemberKey, Member] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.resyncs = 0
        self.connected = threading.Event()  # set while a watch stream is up

    def peers(self) -> dict[MemberKey, Member]:
        with self._lock:
            return dict(self._peers)

    def start(self, *, retry_for_s: float = 0.0) -> dict[MemberKey, Member]:
        """List the current peers (reported as joined), then watch. etcd unavailable: retries with backoff for
        ``retry_for_s``, then raises :class:`EtcdUnavailableError`."""
        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        deadline = time.monotonic() + retry_for_s
        while True:
            try:
                revision = self._resync()
                break
            except EtcdUnavailableError as exc:
                wait = backoff.next()
                if time.monotonic() + wait > deadline:
                    raise
                log.warning("listing %s failed, retrying in %.2fs: %s", self.prefix, wait, exc)
                time.sleep(wait)
        self._thread = threading.Thread(target=self._run, args=(revision,), name=f"etcd-watch-{self.role.value}",
                                        daemon=True)
        self._thread.start()
        return self.peers()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():  # a callback may close
            self._thread.join(self.session.options.request_timeout_s * 2 + 1)

    # -- the diff ---------------------------------------------------------------------------------------------------
    def _resync(self) -> int:
        """List the prefix, report the differences to what was known; returns the revision listed."""
        resp = self.session.call(f"list {self.prefix}", lambda c: c.get_prefix_response(self.prefix))
        seen: dict[MemberKey, Member | None] = {}
        for kv in resp.kvs:
            parsed = self._parse(kv.key, kv.value)
            if parsed is not None:
                seen[parsed[0]] = parsed[1]
        with self._lock:
            known = dict(self._peers)
        for key in sorted(set(known) - set(seen)):
            self._apply(key, None)
        for key in sorted(seen):
            self._apply(key, seen[key])
        return int(resp.header.revision)

    def _parse(self, raw_key: bytes, raw_value: bytes | None) -> tuple[MemberKey, Member | None] | None:
        try:
            key = MemberKey.parse(raw_key)
            return key, None if raw_value is None else decode_member(raw_value)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("ignoring malformed membership entry %r: %s", raw_key, exc)
            return None

    def _apply(self, key: MemberKey, member: Member | None) -> None:
        """One change of ``key``: ``member`` is its new value (None: deleted)."""
        with self._lock:
            old = self._peers.get(key)
            if member is None:
                self._peers.pop(key, None)
            elif old is not None and member.agent == old.agent and member.epoch < old.epoch:
                log.warning("%s: ignoring epoch %d older than known %d", key, member.epoch, old.epoch)
                return
            else:
                self._peers[key] = member
        if old is not None and (member is None or (member.agent, member.epoch) != (old.agent, old.epoch)):
            self._call(self.on_lost, key, old)
        if member is not None:
            if old is None or (member.agent, member.epoch) != (old.agent, old.epoch):
                self._call(self.on_joined, key, member)
            elif member != old:
                self._call(self.on_updated, key, member)

    def _connection(self, up: bool, why: str) -> None:
        if self.on_connection is not None:
            try:
                self.on_connection(up, why)
            except Exception:
                log.exception("membership connection callback failed for %s", self.prefix)

    def _call(self, fn: PeerCallback, key: MemberKey, member: Member) -> None:
        try:
            fn(key, member)
        except Exception:
            log.exception("membership callback %s failed for %s", getattr(fn, "__name__", fn), key)

    # -- the watch thread -------------------------------------------------------------------------------------------
    def _run(self, revision: int) -> None:
        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        while not self._stop.is_set():
            try:
                if revision < 0:
                    revision = self._resync()
                    self.resyncs += 1
                    log.info("membership of %s resynced at revision %d", self.prefix, revision)
                    self._connection(True, "")
                revision = self._watch_from(revision + 1)
                backoff.reset()
            except EtcdUnavailableError as exc:
                self.connected.clear()
                if revision >= 0:  # the first failure of this outage, not a failed resync
                    self._connection(False, str(exc))
                revision = -1
                wait = backoff.next()
                log.warning("watching %s: %s; known peers kept, retrying in %.2fs", self.prefix, exc, wait)
                self._stop.wait(wait)

    def _watch_from(self, start_revision: int) -> int:
        """Watch until the stream breaks (raises :class:`EtcdUnavailableError`) or :meth:`close`; returns the last
        revision applied."""
        events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        watch_id = self.session.call(
            f"watch {self.prefix}",
            lambda c: c.add_watch_prefix_callback(self.prefix, events.put, start_revision=start_revision))
        self.connected.set()
        revision = start_revision - 1
        try:
            while not self._stop.is_set():
                try:
                    response = events.get(timeout=_WATCH_POLL_S)
                except queue.Empty:
                    continue
                if response is None or isinstance(response, Exception):  # the stream ended: etcd went away, the
                    # client was reset after a failed call, or our revision was compacted
                    raise EtcdUnavailableError(f"watch of {self.prefix} ended: {type(response).__name__}: "
                                               f"{response}")
                for event in response.events:
                    parsed = self._parse(event.key, None if _is_delete(event) else event.value)
                    if parsed is not None:
                        self._apply(*parsed)
                    revision = max(revision, int(event.mod_revision))
            return revision
        finally:
            self.connected.clear()
            try:
                self.session.client().cancel_watch(watch_id)
            except Exception as exc:  # the stream may be gone already; nothing to cancel then
                log.debug("cancelling watch: %s", exc)


def _is_delete(event: Any) -> bool:
    return type(event).__name__ == "DeleteEvent"
