"""P's host staging pool as a ledger: FREE → STAGING → STAGED ⇄ SERVING → FREE, per host slot.

A granted request whose lease nobody claimed can be copied to pinned host memory so that P's GPU blocks go back to
the engine while D is slow. The copy carries the GPU lease on: it is served under the same token (transfer,
generation), expires on the same clock, and ends through one release path. What the ledger guarantees, by its
machine (:data:`kvlifecycle.machines.STAGING_MACHINE`) and its commands:

- a slot is served only once its copy completed (STAGING has no ``serve`` edge: a half-written slot, or one left
  by a crash mid-copy, is never read) and only under a live lease (``serve`` past the expiry releases instead);
- a slot is reused only after its copy's lease ended with no read in flight (``release`` leaves SERVING only when
  the reader is gone: its lease expired, which D's read bound ends first, or its peer restarted);
- every command records one event (or a ``Refused``), so the log folds to the live state.

The GPU side of the hand-over (the lease released as ``staged`` only after :meth:`StagingLedger.copy_completed`
and only while unclaimed) is :mod:`kvlifecycle.staging`'s; ``replay --check`` verifies both logs together
(:mod:`kvlifecycle.staging_checks`). Slots are the ledger's blocks: the pool has ``num_blocks`` slots of one KV
block each.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.blockids import MAX_BLOCKS
from kvlifecycle.ledger_base import BlockBusyError, InvalidTransitionError, ReplayError, _Ledger
from kvlifecycle.machines import STAGING, HostSlotState

_H_STAGING = int(HostSlotState.STAGING)
_H_STAGED = int(HostSlotState.STAGED)
_H_SERVING = int(HostSlotState.SERVING)
# release reasons under which a read in flight is known to have ended: D's read bound ends a read before its lease
# expires; a peer that restarted has no read left
READER_GONE = frozenset({"expired", "peer_restarted"})
HOST_SUFFIX = "~host"  # a pool's worker name: its source worker's, with this suffix


@dataclass(slots=True)
class StagedCopy:
    """One transfer's copy in the pool: the slots it holds and the lease it carries on from the GPU."""

    blocks: np.ndarray  # host slot ids
    epoch: int  # allocation epoch of the slots
    state: int
    request: str
    transfer: str
    generation: int
    gpu_blocks: np.ndarray
    gpu_epoch: int
    consumers: int
    expires_at: float
    ttl_s: float
    readers: int = 0  # reads in flight
    done: set[int] = field(default_factory=set)
    peers: set[str] = field(default_factory=set)


class StagingLedger(_Ledger[StagedCopy]):
    """The host staging pool's ledger (its ``requests`` are the staged copies, keyed by transfer)."""

    side = "staging"
    _machine = STAGING
    _first_trigger = "stage"

    def __init__(self, num_blocks: int, *, source_worker: str = "", **kwargs: Any) -> None:
        """``source_worker``: the worker whose GPU leases the pool takes over (its source ledger's ``worker``); the
        pool's own worker name is derived from it (``P~host``), so its log is a track of its own."""
        self.requests: dict[str, StagedCopy] = {}
        self.source_worker = source_worker
        if source_worker and not kwargs.get("worker"):
            kwargs["worker"] = f"{source_worker}{HOST_SUFFIX}"
        super().__init__(num_blocks, **kwargs)
        self.stats = {"staged": 0, "aborted": 0, "served": 0, "completed": 0, "failed": 0, "cancelled": 0,
                      "expired": 0, "peer_restarted": 0}
        self._handlers = {
            ev.StgStarted: self._on_started,
            ev.StgCompleted: self._on_completed,
            ev.StgAborted: self._on_aborted,
            ev.StgServed: self._on_served,
            ev.StgRenewed: self._on_renewed,
            ev.StgReadEnded: self._on_read_ended,
            ev.StgReleased: self._on_released,
            ev.PeerEpochChanged: self._on_peer_epoch,
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }

    def _state_enum(self, value: int) -> HostSlotState:
        return HostSlotState(value)

    @classmethod
    def from_header(cls, header: Any) -> StagingLedger:
        """The empty pool a staging log's header describes; :class:`ReplayError` for one no ledger wrote."""
        if not isinstance(header, dict) or header.get("side") != cls.side:
            raise ReplayError(f"not a staging log header: {header!r}")
        slots, worker = header.get("num_blocks"), header.get("worker", "")
        if isinstance(slots, bool) or not isinstance(slots, int) or not 0 < slots <= MAX_BLOCKS:
            raise ReplayError(f"staging log header's num_blocks is not in [1, {MAX_BLOCKS}]: {slots!r}")
        source_worker = header.get("source_worker", "")
        if not isinstance(worker, str) or not isinstance(source_worker, str):
            raise ReplayError(f"staging log header's worker is not a name: {worker!r}, {source_worker!r}")
        return cls(slots, worker=worker, source_worker=source_worker)

    def header(self) -> dict[str, Any]:
        return {**super().header(), "source_worker": self.source_worker}

    # -- queries --------------------------------------------------------------------------------------------------
    def free_slots(self, n: int) -> np.ndarray | None:
        """``n`` FREE slots (the lowest ids), or None when the pool has fewer."""
        with self._lock:
            if self._lazy:
                self._materialize()
            free = np.flatnonzero(self._state == HostSlotState.FREE)
            return free[:n].astype(ev.BLOCK_DTYPE) if n > 0 and free.size >= n else None

    def occupancy(self) -> int:
        """Slots not FREE."""
        with self._lock:
            return sum(int(c.blocks.size) for c in self.requests.values())

    # -- commands -------------------------------------------------------------------------------------------------
    def stage(self, request: str, transfer: str, generation: int, slots: Iterable[int] | np.ndarray,
              gpu_blocks: np.ndarray, gpu_epoch: int, consumers: int, expires_at: float, ttl_s: float) -> int:
        """Post a copy of ``gpu_blocks`` into ``slots`` (each FREE) for the lease (transfer, generation); returns
        the slots' new epoch. :class:`BlockBusyError` (recorded) when a slot is not FREE or the transfer has one."""
        with self._lock:
            ids = self._command_blocks("stage", slots, request)
            self._check_name("stage", request)
            if transfer in self.requests:
                self._refuse("stage", "transfer already staged", request, transfer)
                raise BlockBusyError(f"transfer {transfer!r} already has a staged copy")
            if ids.size != np.asarray(gpu_blocks).size:
                self._refuse("stage", f"{ids.size} slots for {np.asarray(gpu_blocks).size} GPU blocks", request,
                             transfer)
                raise InvalidTransitionError("one slot per GPU block")
            busy = np.flatnonzero(self._state.take(ids) != HostSlotState.FREE)
            if busy.size:
                slot = int(ids[busy[0]])
                reason = f"slot {slot} is {HostSlotState(self._block_state(slot)).name}, no 'stage' edge from there"
                self._refuse("stage", reason, request, transfer)
                raise BlockBusyError(reason)
            hlc, at = self._stamp()
            self._record(ev.StgStarted(hlc, at, request, transfer, int(generation), ev.pack_blocks(ids),
                                       ev.pack_blocks(np.asarray(gpu_blocks)), int(gpu_epoch), int(consumers),
                                       float(expires_at), float(ttl_s)))
            return self.requests[transfer].epoch

    def copy_completed(self, transfer: str) -> bool:
        """The copy's stream event fired: every byte of the slots is written."""
        with self._lock:
            copy = self._copy_in("copy_completed", transfer, _H_STAGING)
            if copy is None:
                return False
            hlc, at = self._stamp()
            self._record(ev.StgCompleted(hlc, at, transfer))
            return True

    def abort(self, transfer: str, reason: str) -> bool:
        """Drop a copy still in flight (failed, the GPU copy was claimed first, P restarting): never served."""
        with self._lock:
            copy = self._copy_in("abort", transfer, _H_STAGING)
            if copy is None:
                return False
            hlc, at = self._stamp()
            self._record(ev.StgAborted(hlc, at, transfer, reason))
            return True

    def serve(self, transfer: str, generation: int, peer: str = "") -> bool:
        """A consumer claims the staged copy before reading it (renews the lease). False (recorded) when the token
        names no completed copy, or the lease expired (then released: the consumer must not read)."""
        with self._lock:
            live = self._live_whole_copy("serve", transfer, generation, "claim arrived after expiry")
            if live is None:
                return False
            copy, hlc, at = live
            self._record(ev.StgServed(hlc, at, transfer, at + copy.ttl_s, peer))
            return True

    def renew(self, transfer: str, generation: int, peer: str = "") -> bool:
        """Renew the staged copy's lease without starting a read (a keepalive, or the reader's renewal during its
        read). False (recorded) for a stale token, a copy not whole yet, or a lease past its expiry (then released
        if nobody reads it)."""
        with self._lock:
            live = self._live_whole_copy("renew", transfer, generation, "renewal arrived after expiry")
            if live is None:
                return False
            copy, hlc, at = live
            self._record(ev.StgRenewed(hlc, at, transfer, at + copy.ttl_s, peer))
            return True

    def _live_whole_copy(self, command: str, transfer: str, generation: int,
                         late: str) -> tuple[StagedCopy, int, float] | None:
        """The copy ``command`` may act on, with the stamp to record it at: its token current, the copy whole
        (STAGED or SERVING) and its lease not past expiry. Otherwise None, the refusal recorded, and a copy whose
        lease ran out released unless somebody reads it (``late`` says why)."""
        copy = self._token(command, transfer, generation)
        if copy is None:
            return None
        if copy.state not in (_H_STAGED, _H_SERVING):
            self._refuse(command, f"copy is {HostSlotState(copy.state).name}: not whole yet", copy.request,
                         transfer)
            return None
        hlc, at = self._stamp()
        if at >= copy.expires_at:
            self._refuse(command, "lease already expired", copy.request, transfer)
            if copy.readers == 0:
                self._release(copy, "expired", late)
            return None
        return copy, hlc, at

    def read_ended(self, transfer: str, generation: int, consumer: int = 0, *, ok: bool = True,
                   reason: str = "") -> bool:
        """A consumer's read ended. ``ok``: it completed; the last completion releases the copy. A failed read
        releases the copy once no other read is in flight."""
        with self._lock:
            copy = self._token("read_ended", transfer, generation)
            if copy is None:
                return False
            if copy.readers <= 0:
                self._refuse("read_ended", "no read in flight", copy.request, transfer)
                return False
            if not 0 <= consumer < copy.consumers or consumer in copy.done:
                self._refuse("read_ended", f"consumer {consumer} not pending", copy.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.StgReadEnded(hlc, at, transfer, consumer, ok, reason))
            if copy.readers == 0 and (not ok or len(copy.done) == copy.consumers):
                self._release(copy, "completed" if ok else "failed", reason)
            return True

    def cancel(self, transfer: str) -> bool:
        """End a staged copy nobody reads (the request was cancelled). A copy in flight is aborted; one being read
        is refused: it ends with its read, or at its expiry."""
        with self._lock:
            copy = self.requests.get(transfer)
            if copy is None:
                self._refuse("cancel", "no staged copy", transfer=transfer)
                return False
            if copy.state == _H_STAGING:
                hlc, at = self._stamp()
                self._record(ev.StgAborted(hlc, at, transfer, "cancelled"))
                return True
            if copy.readers:
                self._refuse("cancel", "a read is in flight: the copy ends with it", copy.request, transfer)
                return False
            self._release(copy, "cancelled")
            return True

    def sweep(self) -> list[str]:
        """Release every completed copy whose lease ran out (a read in flight ended by its bound); their
        transfers. Copies still in flight are left to their copy's completion or abort."""
        with self._lock:
            now = self.clock.now()
            expired = [c for c in self.requests.values() if c.expires_at <= now and c.state != _H_STAGING]
            for copy in expired:
                self._release(copy, "expired")
            return [c.transfer for c in expired]

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        """A consumer came back new: copies it claimed are released (its reads are gone)."""
        with self._lock:
            advanced, known = self._advance_peer_epoch(peer, epoch)
            if not advanced or known is None:
                return []
            dropped = [c for c in self.requests.values() if peer in c.peers and c.state != _H_STAGING]
            for copy in dropped:
                self._release(copy, "peer_restarted", f"{peer} epoch {known} -> {epoch}")
            return [c.transfer for c in dropped]

    # -- tokens and the one release path --------------------------------------------------------------------------
    def _copy_in(self, command: str, transfer: str, state: int) -> StagedCopy | None:
        copy = self.requests.get(transfer)
        if copy is None or copy.state != state:
            what = "no staged copy" if copy is None else f"copy is {HostSlotState(copy.state).name}"
            self._refuse(command, what, "" if copy is None else copy.request, transfer)
            return None
        return copy

    def _token(self, command: str, transfer: str, generation: int) -> StagedCopy | None:
        """(transfer, generation) must name a live staged copy: a stale or replayed token finds nothing."""
        copy = self.requests.get(transfer)
        if copy is None:
            self._refuse(command, "stale token: no staged copy for this transfer", transfer=transfer)
            return None
        if generation != copy.generation:
            self._refuse(command, f"stale token: generation {generation} != {copy.generation}", copy.request,
                         transfer)
            return None
        return copy

    def _release(self, copy: StagedCopy, reason: str, detail: str = "") -> None:
        hlc, at = self._stamp()
        self._record(ev.StgReleased(hlc, at, copy.transfer, reason, detail))

    # -- fold -----------------------------------------------------------------------------------------------------
    def _on_started(self, e: ev.StgStarted) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._replaying and not self._lazy:
            self._step("stage", ids)
        if e.transfer in self.requests:
            raise ValueError(f"transfer {e.transfer} staged twice")
        seq = self._new_allocation(ids, e.transfer)
        self.requests[e.transfer] = StagedCopy(
            ids, seq, _H_STAGING, e.request, e.transfer, e.generation, ev.unpack_blocks(e.gpu_blocks), e.gpu_epoch,
            e.consumers, e.expires_at, e.ttl_s)
        self.stats["staged"] += 1

    def _on_completed(self, e: ev.StgCompleted) -> None:
        copy = self.requests[e.transfer]
        copy.state = self._checked("staged", copy.state)

    def _on_aborted(self, e: ev.StgAborted) -> None:
        copy = self.requests[e.transfer]
        final = self._checked("abort", copy.state)
        del self.requests[e.transfer]
        self._released_blocks(copy, final)
        self.stats["aborted"] += 1

    def _on_served(self, e: ev.StgServed) -> None:
        copy = self.requests[e.transfer]
        copy.state = self._checked("serve", copy.state)
        copy.readers += 1
        copy.expires_at = e.expires_at
        if e.peer:
            copy.peers.add(e.peer)
        self.stats["served"] += 1

    def _on_renewed(self, e: ev.StgRenewed) -> None:
        copy = self.requests[e.transfer]
        if copy.state not in (_H_STAGED, _H_SERVING):
            raise ValueError(f"renewal of a copy that is {HostSlotState(copy.state).name}")
        copy.expires_at = e.expires_at
        if e.peer:
            copy.peers.add(e.peer)

    def _on_read_ended(self, e: ev.StgReadEnded) -> None:
        copy = self.requests[e.transfer]
        copy.state = self._checked("read_end", copy.state, copy.readers == 1)
        copy.readers -= 1
        if e.ok:
            copy.done.add(e.consumer)

    def _on_released(self, e: ev.StgReleased) -> None:
        copy = self.requests[e.transfer]
        final = self._checked("release", copy.state, e.reason in READER_GONE)
        del self.requests[e.transfer]
        self._released_blocks(copy, final)
        self.stats[e.reason] = self.stats.get(e.reason, 0) + 1

    def _checked(self, trigger: str, state: int, guard: bool = True) -> int:
        nxt = self._scalar(trigger, state, guard)
        if nxt < 0:  # a command checks its edge before recording: only a log can get here
            raise ReplayError(f"{trigger} is not an edge from {HostSlotState(state).name}")
        return nxt
