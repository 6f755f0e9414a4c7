"""The prefill-side ledger: ALLOCATED → READY → PINNED_FOR_TRANSFER → RELEASABLE → FREE | PREFIX_CACHED, with
leases, consumers and the one release path. Import it from :mod:`kvlifecycle.ledger`."""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.machines import INVALID, SOURCE, SourceState

if TYPE_CHECKING:
    pass

from kvlifecycle.ledger_base import (
    DEFAULT_TTL_S,
    MIXED,
    BlockBusyError,
    Grant,
    InvalidTransitionError,
    Lease,
    Released,
    ReplayError,
    UnknownRequestError,
    _Ledger,
    _SourceRequest,
)

_S_ALLOCATED = int(SourceState.ALLOCATED)
_S_READY = int(SourceState.READY)
HELD_SUFFIX = "#own"  # the companion of a request :meth:`SourceLedger.hold` gave shared and fresh blocks


class SourceLedger(_Ledger[_SourceRequest]):
    """Prefill-side ledger: ALLOCATED → READY → PINNED_FOR_TRANSFER → RELEASABLE → FREE | PREFIX_CACHED."""

    side = "source"
    _machine = SOURCE
    _first_trigger = "allocate"

    def __init__(self, num_blocks: int, *, default_ttl_s: float = DEFAULT_TTL_S, **kwargs: Any) -> None:
        self.requests: dict[str, _SourceRequest] = {}
        super().__init__(num_blocks, **kwargs)
        self.default_ttl_s = float(default_ttl_s)
        self._pins = np.zeros(self.num_blocks, dtype=np.uint16)  # pins of shared blocks (the rest: from leases)
        self.refs = np.zeros(self.num_blocks, dtype=np.uint16)  # requests referencing a shared block
        self.leases: dict[str, Lease] = {}
        self.generation = 0
        self.stats = {
            "granted": 0,
            "renewed": 0,
            "completed": 0,
            "failed": 0,
            "cancelled": 0,
            "expired": 0,
            "peer_restarted": 0,
        }
        self._released: list[Released] = []
        self._handlers = {
            ev.SrcAllocated: self._on_allocated,
            ev.SrcShared: self._on_shared,
            ev.SrcPrefillDone: self._on_prefill_done,
            ev.SrcGranted: self._on_granted,
            ev.SrcLeaseRenewed: self._on_renewed,
            ev.SrcCancelDeferred: self._on_cancel_deferred,
            ev.SrcConsumerDone: self._on_consumer_done,
            ev.SrcLeaseReleased: self._on_released,
            ev.SrcFreed: self._on_freed,
            ev.SrcAborted: self._on_aborted,
            ev.SrcEvicted: self._on_evicted,
            ev.PeerEpochChanged: self._on_peer_epoch,
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }
        self._evictions: list[tuple[np.ndarray, np.ndarray]] = []  # lazy replay only

    def _state_enum(self, value: int) -> SourceState:
        return SourceState(value)

    @property
    def pins(self) -> np.ndarray:
        """Live leases pinning each block, as a new array."""
        view: np.ndarray = self._pins.copy()  # numpy types copy() as Any
        for req in self.requests.values():
            if req.leases and not req.shared:
                view[req.blocks] = len(req.leases)
        return view

    # -- commands -------------------------------------------------------------------------------------------------
    def allocate(self, request: str, block_ids: Iterable[int] | np.ndarray) -> int:
        """The engine's allocator gives ``block_ids`` to ``request``. Returns the blocks' new epoch (one number for the
        whole allocation: every block of it gets the same, larger than any it had).

        Raises :class:`BlockBusyError` (after recording the refusal) when a block is not free — in particular when
        it is still pinned for a transfer: the allocator must not reuse it.
        """
        with self._lock:
            ids = self._command_blocks("allocate", block_ids, request)
            self._check_allocatable("allocate", request, ids)
            hlc, at = self._stamp()
            self._record(ev.SrcAllocated(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epoch

    def share(self, request: str, block_ids: Iterable[int] | np.ndarray) -> np.ndarray:
        """``request`` references blocks another request already holds (a prefix-cache hit): no new epoch."""
        with self._lock:
            ids = self._command_blocks("share", block_ids, request)
            self._check_name("share", request)
            if request in self.requests:
                self._refuse("share", "duplicate request id", request)
                raise BlockBusyError(f"request {request!r} already holds blocks")
            if (self._state[ids] == SourceState.FREE).any():
                self._refuse("share", "a shared block is FREE: allocate it instead", request)
                raise InvalidTransitionError("cannot share a FREE block")
            hlc, at = self._stamp()
            self._record(ev.SrcShared(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epochs

    def hold(self, request: str, block_ids: Iterable[int] | np.ndarray) -> None:
        """The engine gives ``block_ids`` to ``request`` where some may already be held by another request (prefix
        caching, e.g. pinned for that one's handoff): those are shared (no new epoch), the others allocated. A
        request is either allocated or shared, so a mix puts the fresh blocks under a companion request
        ``<request>#own`` (allocated and prefilled at once) and shares them all. Free with :meth:`free_held`."""
        ids = np.asarray(block_ids, dtype=np.int32)
        with self._lock:
            states = self.block_states(ids)
            fresh = ((states == SourceState.FREE) | (states == SourceState.PREFIX_CACHED)) & (self.refs[ids] == 0)
            if fresh.all():
                self.allocate(request, ids)
                return
            if fresh.any():
                own = request + HELD_SUFFIX
                self.allocate(own, ids[fresh])
                self.prefill_done(own)
            self.share(request, ids)

    def free_held(self, request: str, *, cache: bool = False) -> None:
        """Free (or cache) what :meth:`hold` gave ``request``: the request and its companion, if it has one."""
        with self._lock:
            for name in (request, request + HELD_SUFFIX):
                if name in self.requests:
                    self.free(name, cache=cache)

    def prefill_done(self, request: str) -> None:
        with self._lock:
            req = self._request("prefill_done", request)
            if not req.shared and self._next["prefill_done"][0][req.state] < 0:
                reason = f"request is {SourceState(req.state).name}, no 'prefill_done' edge from there"
                self._refuse("prefill_done", reason, request)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(ev.SrcPrefillDone(hlc, at, request))

    def grant(
        self,
        request: str,
        *,
        consumers: int = 1,
        ttl_s: float | None = None,
        transfer: str | None = None,
        peer: str = "",
    ) -> Grant:
        """Pin the request's blocks for ``consumers`` readers under a lease (the descriptor may be published)."""
        with self._lock:
            if consumers < 1:
                self._refuse("grant", f"consumers must be >= 1: got {consumers}", request)
                raise ValueError("consumers must be >= 1")
            req = self._request("grant", request)
            if req.shared:
                nxt = self._machine.triggers["grant"].when_true[self._state[req.blocks]]
                reason = self._first_invalid("grant", req.blocks, nxt) if nxt.size and nxt.min() < 0 else ""
            else:
                reason = (
                    ""
                    if self._next["grant"][0][req.state] >= 0
                    else (f"request is {SourceState(req.state).name}, no 'grant' edge from there")
                )
            if reason:
                self._refuse("grant", reason, request)
                raise InvalidTransitionError(reason)
            generation = self.generation + 1
            transfer = transfer or f"{self.worker}.{self.incarnation:08x}.{generation}"
            if transfer in self.leases:
                self._refuse("grant", "transfer id already has a lease", request, transfer)
                raise InvalidTransitionError(f"transfer {transfer!r} already has a lease")
            ttl = self.default_ttl_s if ttl_s is None else float(ttl_s)
            hlc, at = self._stamp()
            self._record(ev.SrcGranted(hlc, at, request, transfer, generation, consumers, at + ttl, peer))
            return Grant(request, transfer, generation, self.worker, req.blocks, req.epoch, consumers, ttl, at + ttl)

    def heartbeat(self, transfer: str, generation: int, peer: str = "", claim: bool = True) -> bool:
        """Renew (and claim) a lease. A consumer claims the lease with a heartbeat before it posts a read, so that a
        cancel racing the read defers the release. ``claim=False`` renews only: a keepalive from a consumer that
        has not started reading, so a cancel still releases at once. A lease already past its expiry is not
        renewed: it is released as expired, and the consumer must not read. ``peer`` names the consumer (its
        side-channel identity): the lease is bound to it, so that :meth:`peer_restarted` releases it when that
        consumer comes back new."""
        with self._lock:
            lease = self._live_lease("heartbeat", transfer, generation)
            if lease is None:
                return False
            hlc, at = self._stamp()
            if at >= lease.expires_at:
                self._refuse("heartbeat", "lease already expired", lease.request, transfer)
                self._release(lease, "expired", "heartbeat arrived after expiry")
                return False
            self._record(ev.SrcLeaseRenewed(hlc, at, transfer, at + lease.ttl_s, peer, claim))
            return True

    def consumer_done(self, transfer: str, generation: int, consumer: int = 0) -> bool:
        """A consumer finished reading (pull) or P's write completed (push). The last one releases the lease."""
        with self._lock:
            lease = self._live_lease("consumer_done", transfer, generation)
            if lease is None:
                return False
            if not 0 <= consumer < lease.consumers:
                self._refuse(
                    "consumer_done", f"consumer {consumer} not in [0, {lease.consumers})", lease.request, transfer
                )
                return False
            if consumer in lease.done:
                self._refuse("consumer_done", f"duplicate completion from consumer {consumer}", lease.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.SrcConsumerDone(hlc, at, transfer, consumer))
            if len(lease.done) == lease.consumers:
                self._release(lease, "cancelled" if lease.cancel_deferred else "completed")
            return True

    def fail(self, transfer: str, generation: int, reason: str = "") -> bool:
        with self._lock:
            lease = self._live_lease("fail", transfer, generation)
            if lease is None:
                return False
            self._release(lease, "failed", reason)
            return True

    def hand_over_staged(self, transfer: str, generation: int) -> bool:
        """The lease's copy in the host staging pool completed: release the GPU blocks (reason ``staged``) so the
        engine can free them. Refused (recorded, False) when a consumer claimed the lease — it may be reading the
        GPU copy, which stays pinned until that read ends — or already completed: the staged copy is dropped."""
        with self._lock:
            lease = self._live_lease("hand_over_staged", transfer, generation)
            if lease is None:
                return False
            if lease.claimed or lease.done:
                self._refuse("hand_over_staged", "claimed: a consumer may be reading the GPU copy", lease.request,
                             transfer)
                return False
            self._release(lease, "staged")
            return True

    def cancel(self, request: str) -> bool:
        """Cancel a request wherever it is: before grant (abort), during a transfer (an unclaimed lease is released
        now; a claimed one when its consumer finishes or the lease ends), or after completion (nothing left to
        cancel: refused, recorded)."""
        with self._lock:
            req = self.requests.get(request)
            if req is None:
                self._refuse("cancel", "unknown request", request)
                return False
            if req.leases:
                for transfer in list(req.leases):
                    lease = self.leases[transfer]
                    if lease.cancel_deferred:
                        continue
                    if lease.claimed:
                        hlc, at = self._stamp()
                        self._record(ev.SrcCancelDeferred(hlc, at, transfer))
                    else:
                        self._release(lease, "cancelled")
                return True
            if req.shared:
                states = self._state[req.blocks]
                abortable = bool((self._machine.triggers["abort"].when_true[states] >= 0).all())
            else:
                abortable = self._next["abort"][0][req.state] >= 0
            if abortable:
                hlc, at = self._stamp()
                self._record(ev.SrcAborted(hlc, at, request))
                return True
            self._refuse("cancel", "nothing in flight to cancel (already released)", request)
            return False

    def sweep(self, keep: Container[str] = ()) -> list[str]:
        """Release every lease whose TTL ran out, except those of ``keep`` (the caller still has a transfer that
        reads them in flight: they are released once it settled); returns their transfer ids."""
        with self._lock:
            now = self.clock.now()
            expired = [lease for lease in self.leases.values()
                       if lease.expires_at <= now and lease.transfer not in keep]
            for lease in expired:
                self._release(lease, "expired")
            return [lease.transfer for lease in expired]

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        """A peer came back with a new agent epoch: leases bound to it are released (its reads are gone), unless
        another consumer is bound to the lease too (D ranks reading their head slices of the same blocks): that one
        may still be reading, so the lease waits for its completion or its expiry."""
        with self._lock:
            advanced, known = self._advance_peer_epoch(peer, epoch)
            if not advanced:
                return []
            dropped = [lease for lease in self.leases.values()
                       if peer in lease.peers and lease.peers <= {peer}] if known is not None else []
            for lease in dropped:
                self._release(lease, "peer_restarted", f"{peer} epoch {known} -> {epoch}")
            return [lease.transfer for lease in dropped]

    def take_released(self) -> list[Released]:
        """Leases that ended since the last call (vLLM: ``finished_sending``)."""
        with self._lock:
            out, self._released = self._released, []
            return out

    def free(self, request: str, *, cache: bool = False) -> None:
        """The engine frees (or caches) the request's blocks. Blocks another lease still pins stay pinned."""
        with self._lock:
            req = self._request("free", request)
            if req.leases:
                reason = f"request still holds lease(s) {req.leases}: cancel first"
                self._refuse("free", reason, request)
                raise InvalidTransitionError(reason)
            if req.state == _S_ALLOCATED or (req.shared and (self._state[req.blocks] == _S_ALLOCATED).any()):
                self._refuse("free", "blocks still ALLOCATED (prefill not done): use cancel", request)
                raise InvalidTransitionError("free before prefill_done: use cancel()")
            hlc, at = self._stamp()
            self._record(ev.SrcFreed(hlc, at, request, cache))

    def evict(self, block_ids: Iterable[int] | np.ndarray) -> None:
        with self._lock:
            ids = self._command_blocks("evict", block_ids)
            nxt = self._machine.triggers["evict"].when_true[self._state[ids]]
            busy = (nxt < 0) | (self.refs[ids] > 0)
            if busy.any():
                block = int(ids[int(np.argmax(busy))])
                refs = int(self.refs[block])
                held = f" (referenced by {refs} requests)" if refs else ""
                reason = f"block {block} is {SourceState(self._block_state(block)).name}{held}, not evictable"
                self._refuse("evict", reason)
                raise BlockBusyError(reason)
            hlc, at = self._stamp()
            self._record(ev.SrcEvicted(hlc, at, ev.pack_blocks(ids)))

    # -- tokens and the one release path --------------------------------------------------------------------------
    def _request(self, command: str, request: str) -> _SourceRequest:
        req = self.requests.get(request)
        if req is None:
            self._refuse(command, "unknown request", request)
            raise UnknownRequestError(request)
        return req

    def _live_lease(self, command: str, transfer: str, generation: int) -> Lease | None:
        """The token check: (transfer, generation) must name a live lease. Leases end on release and generations
        never repeat, so a late, duplicate or replayed token finds nothing and is refused."""
        lease = self.leases.get(transfer)
        if lease is None:
            self._refuse(
                command, "stale token: no live lease for this transfer (released or never granted)", transfer=transfer
            )
            return None
        if generation != lease.generation:
            self._refuse(
                command, f"stale token: generation {generation} != {lease.generation}", lease.request, transfer
            )
            return None
        return lease

    def _release(self, lease: Lease, reason: str, detail: str = "") -> None:
        hlc, at = self._stamp()
        self._record(ev.SrcLeaseReleased(hlc, at, lease.transfer, reason, detail))

    # -- fold -----------------------------------------------------------------------------------------------------
    def _on_allocated(self, e: ev.SrcAllocated) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._replaying and not self._lazy:
            self._step("allocate", ids)
        seq = self._new_allocation(ids, e.request)
        self.requests[e.request] = _SourceRequest(ids, seq, _S_ALLOCATED)

    def _on_shared(self, e: ev.SrcShared) -> None:
        if self._lazy:
            self._materialize()
        ids = self._logged_blocks(e.blocks)
        for other in self.requests.values():  # owners of these blocks switch to per-block handling
            if not other.shared and np.isin(other.blocks, ids).any():
                other.shared = True
                other.block_epochs = self.epoch[other.blocks]
                self.refs[other.blocks] += 1
                self._state[other.blocks] = other.state  # from now on kept exactly, block by block
                self._pins[other.blocks] = len(other.leases)
                self._owner.pop(other.epoch, None)
                other.state = MIXED
                for transfer in other.leases:
                    self.leases[transfer].block_epochs = other.block_epochs
        self.refs[ids] += 1
        self.requests[e.request] = _SourceRequest(
            ids, int(self.epoch[ids].max(initial=0)), MIXED, shared=True, block_epochs=self.epoch[ids]
        )

    def _on_prefill_done(self, e: ev.SrcPrefillDone) -> None:
        req = self.requests[e.request]
        if req.shared:  # shared blocks another request already made READY (or pinned) keep their state
            ids = req.blocks
            mask = self._state[ids] == _S_ALLOCATED
            self._state[ids[mask]] = _S_READY
            return
        req.state = self._scalar("prefill_done", req.state)

    def _on_granted(self, e: ev.SrcGranted) -> None:
        req = self.requests[e.request]
        ids = req.blocks
        if req.shared:
            self._state[ids] = self._step("grant", ids)
            self._pins[ids] += 1
        else:
            req.state = self._scalar("grant", req.state)
        self.generation = max(self.generation, e.generation)
        self.leases[e.transfer] = Lease(
            e.transfer,
            e.request,
            e.generation,
            ids,
            req.epoch,
            e.consumers,
            e.expires_at,
            e.expires_at - e.at,
            {e.peer} if e.peer else set(),
            e.at,
            block_epochs=req.block_epochs,
        )
        req.leases.append(e.transfer)
        self.stats["granted"] += 1

    def _on_renewed(self, e: ev.SrcLeaseRenewed) -> None:
        lease = self.leases[e.transfer]
        lease.expires_at = e.expires_at
        lease.claimed = lease.claimed or e.claims
        if e.peer:
            lease.peers.add(e.peer)
        self.stats["renewed"] += 1

    def _on_cancel_deferred(self, e: ev.SrcCancelDeferred) -> None:
        self.leases[e.transfer].cancel_deferred = True

    def _on_consumer_done(self, e: ev.SrcConsumerDone) -> None:
        self.leases[e.transfer].done.add(e.consumer)

    def _on_released(self, e: ev.SrcLeaseReleased) -> None:
        lease = self.leases.pop(e.transfer)
        req = self.requests[lease.request]
        req.leases.remove(e.transfer)
        ids = lease.blocks
        if req.shared:
            self._pins[ids] -= 1
            self._state[ids] = self._step("release", ids, self._pins[ids] == 0)
        else:
            req.state = self._scalar("release", req.state, not req.leases)
        self.stats[e.reason] = self.stats.get(e.reason, 0) + 1
        if not self._replaying:
            self._released.append(Released(lease.request, e.transfer, e.reason))

    def _on_freed(self, e: ev.SrcFreed) -> None:
        self._remove(e.request, "cache" if e.cached else "free")

    def _on_aborted(self, e: ev.SrcAborted) -> None:
        self._remove(e.request, "abort")

    def _remove(self, request: str, trigger: str) -> None:
        req = self.requests.pop(request)
        ids = req.blocks
        if not req.shared:
            final = self._scalar(trigger, req.state)
            if final < 0:  # e.g. free of a request still ALLOCATED: the command refuses this before recording
                raise ReplayError(f"{trigger} from {SourceState(req.state).name}")
            self._released_blocks(req, final)
            return
        self.refs[ids] -= 1
        # only blocks nobody else references and no lease pins leave; the rest stay as they are
        last = ids[(self.refs[ids] == 0) & (self._pins[ids] == 0)]
        if last.size:
            nxt = self._machine.step(trigger, self._state[last])
            movable = nxt != INVALID
            self._state[last[movable]] = nxt[movable]

    def _on_evicted(self, e: ev.SrcEvicted) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._lazy:
            self._evictions.append((ids, self.epoch[ids]))
            return
        self._state[ids] = self._step("evict", ids)

    def _after_materialize(self) -> None:
        for ids, epochs in self._evictions:
            unchanged = ids[self.epoch[ids] == epochs]  # not reallocated since the eviction
            self._state[unchanged] = SourceState.FREE
        self._evictions = []


