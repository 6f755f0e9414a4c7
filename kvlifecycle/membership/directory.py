"""Following the other side through etcd.

D's directory of P workers (:class:`ProducerDirectory`): each new P rank is connected (handshake, metadata, probe),
each lost one is invalidated in the :class:`~kvlifecycle.handoff.Consumer` at once. P's view of D workers
(:class:`ConsumerDirectory`): the leases bound to a lost D agent are released at once, not at their TTL.

The lost epoch of an agent is dead for good here: a registration that names it again (or an older one) is refused,
so a P cut off for longer than its TTL cannot slip back in with loads that D already failed; it returns as a new
epoch. Handshakes run on a thread per P rank being connected, retried while that rank stays registered, so a slow
or unreachable P never delays the watcher's report of another P's loss, nor another P's handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvlifecycle.membership.etcd import Backoff, EtcdSession
from kvlifecycle.membership.keys import Member, MemberKey, MemberState, Role
from kvlifecycle.membership.watcher import PeerWatcher

if TYPE_CHECKING:
    from kvlifecycle.handoff import Consumer, Producer

log = logging.getLogger("kvlifecycle.membership")


PeerEventKind = Literal["joined", "connected", "lost", "refused", "draining"]


@dataclass(frozen=True, slots=True)
class PeerEvent:
    """One change a directory acted on, for logs and tests."""

    kind: PeerEventKind
    key: MemberKey
    agent: str
    epoch: int
    at: float  # time.time() when the directory handled it
    detail: str = ""


class ProducerDirectory:
    """Follows the P ranks of the cluster for one :class:`Consumer`."""

    def __init__(self, consumer: Consumer, session: EtcdSession, *, push: bool = False,
                 connect_retry_for_s: float = 300.0) -> None:
        self.consumer, self.session, self.push = consumer, session, push
        self.connect_retry_for_s = connect_retry_for_s
        self.events: list[PeerEvent] = []
        self._dead: dict[str, int] = {}  # agent -> highest epoch declared lost
        self._connected: dict[MemberKey, Member] = {}
        self._lock = threading.Lock()
        self._connectors: list[threading.Thread] = []
        self._stop = threading.Event()
        self.watcher = PeerWatcher(session, Role.PREFILL, on_joined=self._joined, on_lost=self._lost,
                                   on_updated=self._updated)

    def start(self, *, retry_for_s: float = 0.0) -> None:
        self.watcher.start(retry_for_s=retry_for_s)

    def close(self) -> None:
        self._stop.set()
        self.watcher.close()
        with self._lock:
            connectors = list(self._connectors)
        for thread in connectors:  # each is at most one handshake (bounded by its request timeout) from its end
            thread.join(30)

    def serving(self) -> dict[MemberKey, Member]:
        """The P ranks connected and taking new grants (not draining): where new requests may go."""
        with self._lock:
            return {k: m for k, m in self._connected.items() if m.state is MemberState.SERVING}

    def _note(self, kind: PeerEventKind, key: MemberKey, member: Member, detail: str = "") -> None:
        with self._lock:
            self.events.append(PeerEvent(kind, key, member.agent, member.epoch, time.time(), detail))

    # -- watcher callbacks (watcher thread: short) ------------------------------------------------------------------
    def _joined(self, key: MemberKey, member: Member) -> None:
        with self._lock:
            dead = self._dead.get(member.agent)
        if dead is not None and member.epoch <= dead:
            self._note("refused", key, member, f"epoch {member.epoch} was declared lost (<= {dead})")
            log.warning("%s: refusing agent %s epoch %d, declared lost", key, member.agent, member.epoch)
            return
        self._note("joined", key, member)
        self._connect_soon(key, member)

    def _updated(self, key: MemberKey, member: Member) -> None:
        with self._lock:
            if key in self._connected:
                self._connected[key] = member
        if member.state is MemberState.DRAINING:
            self._note("draining", key, member)

    def _lost(self, key: MemberKey, member: Member) -> None:
        with self._lock:
            self._dead[member.agent] = max(member.epoch, self._dead.get(member.agent, member.epoch))
            self._connected.pop(key, None)
        why = "drained and left" if member.state is MemberState.DRAINING else "etcd lease gone"
        failed = self.consumer.invalidate_peer(member.agent, member.epoch, why)
        self._note("lost", key, member, f"{why}; failed {len(failed)} load(s)")

    # -- connector threads (one per P rank being connected) ---------------------------------------------------------
    def _connect_soon(self, key: MemberKey, member: Member) -> None:
        thread = threading.Thread(target=self._connect, args=(key, member), name=f"etcd-connect-{key.instance}",
                                  daemon=True)
        with self._lock:
            self._connectors = [t for t in self._connectors if t.is_alive()] + [thread]
        thread.start()

    def _current(self, key: MemberKey, member: Member) -> bool:
        """``member`` is still what etcd says ``key`` is, and not declared lost."""
        with self._lock:
            if self._dead.get(member.agent, -1) >= member.epoch:
                return False
        now = self.watcher.peers().get(key)
        return now is not None and (now.agent, now.epoch) == (member.agent, member.epoch)

    def _connect(self, key: MemberKey, member: Member) -> None:
        """Handshake until it works, the member goes (lost or replaced), a permanent refusal, or
        ``connect_retry_for_s``: a P that is registered but slow (a loaded host) is retried, not given up on."""
        from kvlifecycle.handshake import CompatMismatchError

        options = self.session.options
        backoff = Backoff(options.backoff_initial_s, options.backoff_max_s)
        deadline = time.monotonic() + self.connect_retry_for_s
        tries = 0
        while not self._stop.is_set() and self._current(key, member):
            tries += 1
            try:
                link = self.consumer.connect(member.address, push=self.push)
            except CompatMismatchError as exc:
                self._note("refused", key, member, f"incompatible: {exc}")
                log.error("%s: %s is incompatible: %s", key, member.address, exc)
                return
            except Exception as exc:  # refused, timed out, the transport: retried while the member is registered
                wait = backoff.next()
                if time.monotonic() + wait > deadline:
                    self._note("refused", key, member, f"connect failed {tries} time(s): {exc}")
                    log.warning("%s: gave up connecting to %s after %d tries: %s", key, member.address, tries, exc)
                    return
                log.info("%s: connect to %s failed (try %d), retrying in %.2fs: %s", key, member.address, tries,
                         wait, exc)
                self._stop.wait(wait)
                continue
            if link.epoch != member.epoch:
                log.warning("%s: %s answered epoch %d, etcd said %d", key, member.address, link.epoch, member.epoch)
            with self._lock:
                self._connected[key] = member
            self._note("connected", key, member, f"after {tries} try(s)")
            return


class ConsumerDirectory:
    """Follows the D ranks of the cluster for one :class:`Producer`: a lost D's leases are released at once (a
    lease bound to several D ranks goes with the first of them lost: its reads cannot all complete)."""

    def __init__(self, producer: Producer, session: EtcdSession) -> None:
        self.producer = producer
        self.events: list[PeerEvent] = []
        self._lock = threading.Lock()
        self.watcher = PeerWatcher(session, Role.DECODE, on_joined=self._joined, on_lost=self._lost)

    def start(self, *, retry_for_s: float = 0.0) -> None:
        self.watcher.start(retry_for_s=retry_for_s)

    def close(self) -> None:
        self.watcher.close()

    def _joined(self, key: MemberKey, member: Member) -> None:
        with self._lock:
            self.events.append(PeerEvent("joined", key, member.agent, member.epoch, time.time()))

    def _lost(self, key: MemberKey, member: Member) -> None:
        """The lost epoch is over: its leases end as at a restart of that D. The ledger records the peer at the next
        epoch (``epoch + 1``, the least that is not the lost one; a real restart's epoch is larger still), which
        releases every lease bound to it with reason ``peer_restarted``, so the log says why they ended and the
        replay checkers read it as the fence it is (the D side fences itself: :class:`ConsumerPresence`)."""
        released = self.producer.ledger.peer_restarted(member.agent, member.epoch + 1)
        with self._lock:
            self.events.append(PeerEvent("lost", key, member.agent, member.epoch, time.time(),
                                         f"released {len(released)} lease(s)"))
        log.warning("D %s (epoch %d) lost: released %d lease(s) bound to it", member.agent, member.epoch,
                    len(released))
