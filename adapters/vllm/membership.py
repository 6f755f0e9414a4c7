"""The vLLM workers in etcd: each worker registers (P with its side channel) and follows the other side's workers,
so ``kvlifecycle proxy --etcd`` finds the instances, a D learns of a lost P and a P of a lost D within the etcd
lease TTL, and ``kvlifecycle drain`` scales a P in.

Used only when etcd endpoints are configured (``etcd_endpoints``, else ``KVL_ETCD_ENDPOINTS``); without them the
connector runs as before, the addresses travelling in ``kv_transfer_params`` alone.

- P: :class:`~kvlifecycle.membership.ProducerPresence` under ``prefill/<engine_id>/<dp>/<tp>`` (side-channel
  address, agent, agent epoch, and ``api_address``: vLLM does not tell its workers where its API server listens,
  so the launcher passes it), and a :class:`~kvlifecycle.membership.ConsumerDirectory` following the
  ``decode/...`` keys of the cluster: when a D's key goes (D killed, its etcd lease expired) the leases bound to
  that D's agent end at once (``peer_restarted``: vLLM frees their blocks in its next step) instead of pinning
  them until their TTL.
- P drains in two ways. Ordered (``kvlifecycle drain --instance <engine_id>`` marks the keys draining; P follows its
  own key): the proxy and D route nothing new to it, the requests it already has run to their end (those still in
  their prefill reach their grant within ``drain_quiet_s``), and once it has held no lease for ``drain_quiet_s``
  (at most ``drain_timeout_s``) P deletes its key; the server keeps running, unrouted, until it is stopped. At
  shutdown: P marks itself draining, waits at most ``drain_timeout_s`` for its live leases, then deletes its key.
  vLLM calls the worker's shutdown only when ``--shutdown-timeout`` gives it time (its default 0 force-kills the
  workers at SIGTERM): else the key goes with its lease.
- D: :class:`~kvlifecycle.membership.ConsumerPresence` under ``decode/...`` and a
  :class:`~kvlifecycle.membership.ProducerDirectory`: each registered P is connected ahead of its first request,
  each lost one is invalidated in the :class:`~kvlifecycle.handoff.Consumer` at once (its loads fail per
  ``kv_load_failure_policy``, its late messages are refused) instead of when its block leases run out.

Joining runs on a thread of its own, retried with backoff while etcd does not answer: an etcd that is down when
vLLM starts delays the registration (and says so in the log), never the engine. The heavy parts (the lease
keep-alive, the watch) are the membership package's own threads.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from kvlifecycle.membership import (
    ConsumerDirectory,
    ConsumerPresence,
    EtcdOptions,
    EtcdSession,
    MembershipError,
    ProducerDirectory,
    ProducerPresence,
)

if TYPE_CHECKING:
    from kvlifecycle.handoff import Consumer, Producer

    from .config import AdapterConfig

log = logging.getLogger("kvlifecycle.adapters.vllm")

JOIN_RETRY_S = 600.0  # how long a worker keeps trying to reach etcd at start before it gives up (and says so)


class WorkerMembership:
    """One worker's registration (P or D) and its directory of the other side's workers."""

    def __init__(self, config: AdapterConfig, instance: str, *, dp: int = 0, producer: Producer | None = None,
                 consumer: Consumer | None = None) -> None:
        if (producer is None) == (consumer is None):
            raise ValueError("a worker registers as a producer or as a consumer (kv_both: one membership each)")
        self.config = config
        self.session = EtcdSession(EtcdOptions(config.etcd_endpoints, cluster=config.etcd_cluster,
                                               lease_ttl_s=config.etcd_lease_ttl_s))
        api = config.api_address or ""
        self.presence: ProducerPresence | ConsumerPresence
        self.directory: ProducerDirectory | ConsumerDirectory
        if producer is not None:
            self.presence = ProducerPresence(producer, self.session, instance, dp=dp, api=api)
            self.directory = ConsumerDirectory(producer, self.session)
        else:
            assert consumer is not None
            self.presence = ConsumerPresence(consumer, self.session, instance, dp=dp, api=api)
            self.directory = ProducerDirectory(consumer, self.session, push=config.mode == "push")
        self.joined = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, config: AdapterConfig, instance: str, *, dp: int = 0, producer: Producer | None = None,
              consumer: Consumer | None = None) -> list[WorkerMembership]:
        """The memberships of one worker (none without etcd endpoints; P and D each for ``kv_both``), joining in
        the background."""
        if not config.etcd_endpoints:
            return []
        out = []
        if producer is not None:
            out.append(cls(config, instance, dp=dp, producer=producer))
        if consumer is not None:
            out.append(cls(config, instance, dp=dp, consumer=consumer))
        for membership in out:
            membership.join_in_background()
        return out

    @property
    def key(self) -> str:
        return self.presence.registration.key.path

    def join_in_background(self) -> None:
        role = self.presence.registration.key.role.value
        self._thread = threading.Thread(target=self._join, name=f"kvl-etcd-join-{role}", daemon=True)
        self._thread.start()

    def _join(self) -> None:
        try:
            self.presence.register(retry_for_s=JOIN_RETRY_S)
            self.directory.start(retry_for_s=JOIN_RETRY_S)
            if isinstance(self.presence, ProducerPresence):
                self.presence.follow_drain_orders(timeout_s=self.config.drain_timeout_s,
                                                  quiet_s=self.config.drain_quiet_s, retry_for_s=JOIN_RETRY_S)
        except MembershipError as exc:
            log.error("KVLifecycleConnector: %s not registered in etcd at %s: %s", self.key,
                      ",".join(self.config.etcd_endpoints), exc)
            return
        member = self.presence.registration.member
        log.info("KVLifecycleConnector: registered %s in etcd (agent %s, epoch %d, api %s)", self.key, member.agent,
                 member.epoch, member.api or "none")
        self.joined.set()

    def stop(self) -> None:
        """P drains (bounded by ``drain_timeout_s``; an ordered drain under way is waited for) and leaves; D leaves;
        then the watches and the session close."""
        registration = self.presence.registration
        if self._thread is not None and self._thread.is_alive():
            registration.close()  # ends a join still retrying (a key put meanwhile is deleted below)
            self._thread.join(self.session.options.request_timeout_s * 2 + 1)
        try:
            self.directory.close()
            if isinstance(self.presence, ProducerPresence):
                ordered = self.presence.drain_thread
                if ordered is not None:  # keeps the lease alive meanwhile; deletes the key at its end
                    ordered.join(self.config.drain_timeout_s + self.session.options.request_timeout_s * 4 + 1)
                if registration.lease_id is None:
                    return  # never registered, or the ordered drain already left
                self.presence.drain(timeout_s=self.config.drain_timeout_s)  # keeps the lease alive meanwhile
            else:
                if registration.lease_id is None:
                    return  # never registered: nothing to delete
                registration.deregister()
            log.info("KVLifecycleConnector: %s left etcd", self.key)
        finally:
            self.presence.close()
            self.session.close()
