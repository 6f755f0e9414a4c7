"""The decode-side ledger: RESERVED → LOADING → READY_FOR_ATTENTION → FREE (a failed load never becomes READY).
Import it from :mod:`kvlifecycle.ledger`.

A layer-wise streaming load (``start_load(..., layers=n)``) fills while P still computes: each layer batch is one
``TgtLayersLanded`` (:meth:`TargetLedger.layers_landed`), and the ledger itself records a part's ``TgtPartDone``
when the last layer of the last block of that part landed; a caller's ``part_done`` on such a load is refused.
So a block never becomes READY_FOR_ATTENTION with a layer missing, and a failed layer fails the load (``fail``)
like any failed part."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.blockids import parse_block_ids
from kvlifecycle.choices import LoadFailurePolicy, LoadFailurePolicyName, TransferMode, TransferModeName
from kvlifecycle.layer_progress import MAX_LAYERS, LayerProgress
from kvlifecycle.machines import TARGET, TargetState

if TYPE_CHECKING:
    pass

from kvlifecycle.ledger_base import (
    _MODE_SPELLINGS,
    BlockBusyError,
    InvalidTransitionError,
    Load,
    UnknownRequestError,
    _Ledger,
    _TargetRequest,
)

_T_RESERVED = int(TargetState.RESERVED)


class TargetLedger(_Ledger[_TargetRequest]):
    """Decode-side ledger: RESERVED → LOADING → READY_FOR_ATTENTION → FREE; a failed load never becomes READY."""

    side = "target"
    _machine = TARGET
    _first_trigger = "reserve"

    def __init__(
        self,
        num_blocks: int,
        *,
        failure_policy: LoadFailurePolicy | LoadFailurePolicyName = LoadFailurePolicy.FAIL,
        **kwargs: Any,
    ) -> None:
        policy = LoadFailurePolicy.parse(failure_policy, "failure_policy")
        self.requests: dict[str, _TargetRequest] = {}
        self.failure_policy = policy  # before the base's __init__: a log handed in takes the header, which names it
        super().__init__(num_blocks, **kwargs)
        self.loads: dict[str, Load] = {}
        self.layer_progress: dict[str, LayerProgress] = {}  # transfer -> landed flags, for streaming loads only
        # D block id -> (until, transfer): a block whose landed bytes failed their digest stays out of any
        # reservation until then (docs/design.md, "Digests")
        self.quarantine: dict[int, tuple[float, str]] = {}
        self.mismatched: set[str] = set()  # live loads with a TgtDigestMismatch: only a failure ends them
        # live loads from a source incarnation that restarted (transfer -> why): only a failure ends them, once
        # their reads settled (:meth:`peer_restarted`)
        self.doomed: dict[str, str] = {}
        self.stats = {"loaded": 0, "failed": 0, "recompute": 0, "cancelled": 0, "discarded": 0}
        self._handlers = {
            ev.TgtReserved: self._on_reserved,
            ev.TgtLoadStarted: self._on_load_started,
            ev.TgtLayersLanded: self._on_layers_landed,
            ev.TgtLoadDeclined: self._on_load_declined,
            ev.TgtPartDone: self._on_part_done,
            ev.TgtLoadFailed: self._on_load_failed,
            ev.TgtDigestMismatch: self._on_digest_mismatch,
            ev.TgtCancelled: self._on_cancelled,
            ev.TgtLocalFilled: self._on_local_filled,
            ev.TgtFinished: self._on_finished,
            ev.PeerEpochChanged: self._on_peer_epoch,
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }

    def header(self) -> dict[str, Any]:
        return {**super().header(), "failure_policy": self.failure_policy.value}

    def _state_enum(self, value: int) -> TargetState:
        return TargetState(value)

    # -- commands -------------------------------------------------------------------------------------------------
    def reserve(self, request: str, block_ids: Iterable[int] | np.ndarray) -> int:
        """D's scheduler reserves ``block_ids`` for ``request``; returns their new epoch (as ``allocate`` does)."""
        with self._lock:
            ids = self._command_blocks("reserve", block_ids, request)
            if self.quarantine:
                self._check_quarantine(request, ids)
            self._check_allocatable("reserve", request, ids)
            hlc, at = self._stamp()
            self._record(ev.TgtReserved(hlc, at, request, ev.pack_blocks(ids)))
            return self.requests[request].epoch

    def start_load(
        self,
        request: str,
        transfer: str,
        *,
        parts: int = 1,
        generation: int = 0,
        peer: str = "",
        peer_epoch: int = 0,
        mode: TransferMode | TransferModeName = TransferMode.PULL,
        layers: int = 0,
    ) -> None:
        """The request's blocks start receiving bytes; ``parts`` completions (shards, P ranks) are expected.
        ``mode``: ``pull`` (D reads P's pinned blocks) or ``push`` (P writes into these). ``layers`` > 0: a
        layer-wise streaming load, whose parts complete by :meth:`layers_landed`, never by :meth:`part_done`."""
        with self._lock:
            spelling = _MODE_SPELLINGS.get(mode)
            if spelling is None:
                try:
                    spelling = str(TransferMode.parse(mode, "mode"))  # names the field and the members
                except ValueError as exc:
                    self._refuse("start_load", f"mode: {exc}", request, transfer)
                    raise
            if parts < 1:
                self._refuse("start_load", f"parts must be >= 1: got {parts}", request, transfer)
                raise ValueError("parts must be >= 1")
            if not isinstance(layers, int | np.integer) or not 0 <= layers <= MAX_LAYERS:
                self._refuse("start_load", f"layers must be in [0, {MAX_LAYERS}]: got {layers!r}", request, transfer)
                raise ValueError(f"layers must be in [0, {MAX_LAYERS}]")
            req = self._request("start_load", request, transfer)
            if transfer in self.loads:
                self._refuse("start_load", "transfer already loading", request, transfer)
                raise InvalidTransitionError(f"transfer {transfer!r} already loading")
            known = self.peer_epochs.get(peer)
            if peer and known is not None and peer_epoch < known:
                reason = f"stale token: peer {peer} epoch {peer_epoch} < {known}"
                self._refuse("start_load", reason, request, transfer)
                raise InvalidTransitionError(reason)
            if self._next["start_load"][0][req.state] < 0:
                reason = f"request is {TargetState(req.state).name}, no 'start_load' edge from there"
                self._refuse("start_load", reason, request, transfer)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(
                ev.TgtLoadStarted(hlc, at, request, transfer, parts, generation, peer, peer_epoch, spelling,
                                  int(layers))
            )

    def layers_landed(self, transfer: str, part: int, first_layer: int, num_layers: int,
                      block_ids: Iterable[int] | np.ndarray, *, verified: bool = False) -> bool:
        """Layers ``[first_layer, first_layer + num_layers)`` of ``block_ids`` landed for ``part`` of a streaming
        load; ``verified``: their bytes matched P's digest. The batch that completes the part also records its
        ``TgtPartDone`` (the last part's makes the blocks READY_FOR_ATTENTION), whose ``verified`` counts the
        request's blocks when every batch of the part was verified (else 0). Refused (recorded, False): no live
        streaming load, a layer or part out of range, a block not the request's, or a (block, layer) that landed
        already."""
        with self._lock:
            load = self._live_load("layers_landed", transfer)
            if load is None:
                return False
            progress = self.layer_progress.get(transfer)
            if progress is None:
                self._refuse("layers_landed", "not a streaming load (started with layers=0)", load.request, transfer)
                return False
            ids, reason = parse_block_ids(block_ids, self.num_blocks)
            reason = reason or progress.problem(part, first_layer, num_layers, ids)
            if transfer in self.mismatched:
                reason = "a part of this load failed its digest: only fail ends it"
            elif transfer in self.doomed:
                reason = f"{self.doomed[transfer]}: only fail ends it"
            if reason:
                self._refuse("layers_landed", reason, load.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtLayersLanded(hlc, at, transfer, part, first_layer, num_layers, ev.pack_blocks(ids),
                                            bool(verified)))
            if progress.complete(part):
                hlc, at = self._stamp()
                checked = 0 if part in progress.unchecked else int(progress.blocks.size)
                self._record(ev.TgtPartDone(hlc, at, transfer, part, checked))
            return True

    def part_done(self, transfer: str, part: int = 0, *, verified: int = 0) -> bool:
        """One expected part (layer, shard, P rank) landed. The last one makes the blocks READY_FOR_ATTENTION.
        ``verified``: how many of the part's units (P blocks) matched P's digests where they landed (0: not
        checked); more than the request holds is refused."""
        with self._lock:
            load = self._live_load("part_done", transfer)
            if load is None:
                return False
            if not 0 <= part < load.parts:
                self._refuse("part_done", f"part {part} not in [0, {load.parts})", load.request, transfer)
                return False
            if part in load.done:
                self._refuse("part_done", f"duplicate completion of part {part}", load.request, transfer)
                return False
            if transfer in self.mismatched:
                self._refuse("part_done", "a part of this load failed its digest: only fail ends it", load.request,
                             transfer)
                return False
            if transfer in self.doomed:
                self._refuse("part_done", f"{self.doomed[transfer]}: only fail ends it", load.request, transfer)
                return False
            if transfer in self.layer_progress:  # its layers complete it: a part_done here could skip one
                self._refuse("part_done", "a streaming load's parts complete by their layers", load.request, transfer)
                return False
            held = self.requests[load.request].blocks.size
            if not 0 <= verified <= held:
                self._refuse("part_done", f"{verified} verified block(s) of a request holding {held}", load.request,
                             transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtPartDone(hlc, at, transfer, part, int(verified)))
            return True

    def decline(self, transfer: str, reason: str = "") -> bool:
        """The source declined a streaming load before writing anything (its prefill began without this
        reservation): the blocks go back to RESERVED for the post-prefill path (FREE if the request was cancelled
        meanwhile). Refused once a layer landed: bytes were written, so only ``fail`` can end it."""
        with self._lock:
            load = self._live_load("decline", transfer)
            if load is None:
                return False
            progress = self.layer_progress.get(transfer)
            if progress is None or progress.landed.any():
                why = "not a streaming load" if progress is None else "a layer landed already: fail it instead"
                self._refuse("decline", why, load.request, transfer)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtLoadDeclined(hlc, at, transfer, reason))
            return True

    def fail(self, transfer: str, reason: str = "") -> bool:
        """The load failed (any part). Policy ``recompute``: blocks go back to RESERVED; ``fail``: to FREE. A load
        :meth:`peer_restarted` doomed fails with that reason (the first cause)."""
        with self._lock:
            load = self._live_load("fail", transfer)
            if load is None:
                return False
            reason = self.doomed.get(transfer, reason)
            req = self.requests[load.request]
            recompute = self.failure_policy == "recompute" and not req.cancel_pending
            hlc, at = self._stamp()
            self._record(ev.TgtLoadFailed(hlc, at, transfer, reason, recompute))
            return True

    def digest_mismatch(self, transfer: str, part: int, *, blocks: Iterable[int] | np.ndarray,
                        source_blocks: Iterable[int] | np.ndarray, expected: np.ndarray, found: np.ndarray,
                        slice_index: int = 0, quarantine_s: float = 0.0,
                        layers: tuple[int, int] = (0, 0)) -> bool:
        """What landed for ``part`` failed its digest check: records the mismatch (``blocks``: D's ids, a whole
        number of pieces per unit; ``source_blocks``, ``expected``, ``found``: one per unit). From then on the load
        can only fail (:meth:`fail`, once its sibling reads settled): a ``part_done`` or a layer of it is refused,
        so no block of it becomes READY_FOR_ATTENTION. The blocks are quarantined for ``quarantine_s``: a
        reservation naming one is refused until then. ``layers``: ``(first, count)`` of a stream's layer batch
        checked as one unit. Refused (recorded, False): no live load, a part out of range or already done, a block
        not the request's, or arrays that do not pair up."""
        with self._lock:
            load = self._live_load("digest_mismatch", transfer)
            if load is None:
                return False
            ids, reason = parse_block_ids(blocks, self.num_blocks)
            src, src_reason = parse_block_ids(source_blocks, (1 << 31) - 1, allow_empty=True)
            exp = np.asarray(expected, dtype="<u8").reshape(-1)
            got = np.asarray(found, dtype="<u8").reshape(-1)
            units = exp.size
            if not reason and not 0 <= part < load.parts:
                reason = f"part {part} not in [0, {load.parts})"
            elif not reason and part in load.done:
                reason = f"part {part} completed already"
            elif not reason and (units == 0 or got.size != units or src.size != units or ids.size % units):
                reason = (f"{units} expected, {got.size} found, {src.size} source blocks and {ids.size} blocks do "
                          "not pair up")
            elif not reason and not np.isin(ids, self.requests[load.request].blocks).all():
                reason = "a block is not the request's"
            reason = reason or src_reason
            if reason:
                self._refuse("digest_mismatch", reason, load.request, transfer)
                return False
            if not quarantine_s >= 0:
                raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s!r}")
            hlc, at = self._stamp()
            self._record(ev.TgtDigestMismatch(hlc, at, transfer, part, int(slice_index), ev.pack_blocks(ids),
                                              ev.pack_blocks(src), exp.tobytes(), got.tobytes(),
                                              ids.size // units, at + float(quarantine_s), int(layers[0]),
                                              int(layers[1])))
            return True

    def quarantined(self, now: float | None = None) -> dict[int, tuple[float, str]]:
        """D block id -> (until, transfer) for the blocks quarantined at ``now`` (the ledger's clock by default)."""
        with self._lock:
            at = self.clock.now() if now is None else now
            return {b: q for b, q in self.quarantine.items() if q[0] > at}

    def _check_quarantine(self, request: str, ids: np.ndarray) -> None:
        now = self.clock.now()
        for block in ids.tolist():
            held = self.quarantine.get(block)
            if held is not None and held[0] > now:
                reason = (f"block {block} is quarantined until {held[0]:.3f} (its bytes failed their digest in "
                          f"{held[1]})")
                self._refuse("reserve", reason, request)
                raise BlockBusyError(reason)

    def cancel(self, request: str) -> bool:
        """Cancel or preempt a request. While its load is in flight the blocks stay LOADING and are freed when the
        transfer settles (completion or failure), so late bytes never land in a new owner's block."""
        with self._lock:
            req = self.requests.get(request)
            if req is None:
                self._refuse("cancel", "unknown request", request)
                return False
            if req.cancel_pending:
                self._refuse("cancel", "cancel already pending", request)
                return False
            hlc, at = self._stamp()
            self._record(ev.TgtCancelled(hlc, at, request))
            return True

    def local_fill(self, request: str) -> None:
        """The engine computed the request's KV itself (recompute after a failed load)."""
        self._simple("local_fill", request, ev.TgtLocalFilled)

    def finish(self, request: str) -> None:
        self._simple("finish", request, ev.TgtFinished)

    def peer_restarted(self, peer: str, epoch: int) -> list[str]:
        """A source peer came back with a new epoch (one ``PeerEpochChanged``): the live loads from its old
        incarnation are doomed, and returned. They fail, but not here: a sibling part (another P rank of the load)
        may still be reading into their blocks, and a copy its transport cannot cancel (CUDA IPC) may still be
        landing. So, as a cancel with a transfer in flight (``LOADING -> LOADING``), the blocks stay LOADING until
        the caller, once every read of the load settled, calls :meth:`fail`, which records this reason; until then
        no part of a doomed load completes (``part_done`` and ``layers_landed`` are refused)."""
        with self._lock:
            before = set(self.doomed)
            advanced, _known = self._advance_peer_epoch(peer, epoch)
            if not advanced:
                return []
            return [transfer for transfer in self.doomed if transfer not in before]

    def _request(self, command: str, request: str, transfer: str = "") -> _TargetRequest:
        req = self.requests.get(request)
        if req is None:
            self._refuse(command, "unknown request", request, transfer)
            raise UnknownRequestError(request)
        return req

    def _simple(self, trigger: str, request: str, event_type: type) -> None:
        with self._lock:
            req = self._request(trigger, request)
            if self._next[trigger][0][req.state] < 0:
                reason = f"request is {TargetState(req.state).name}, no {trigger!r} edge from there"
                self._refuse(trigger, reason, request)
                raise InvalidTransitionError(reason)
            hlc, at = self._stamp()
            self._record(event_type(hlc, at, request))

    def _live_load(self, command: str, transfer: str) -> Load | None:
        load = self.loads.get(transfer)
        if load is None:
            self._refuse(
                command, "stale token: no live load for this transfer (settled or never started)", transfer=transfer
            )
            return None
        return load

    # -- fold -----------------------------------------------------------------------------------------------------
    def _set(self, req: _TargetRequest, state: int) -> None:
        req.state = state

    def _drop(self, request: str, final: int) -> None:
        self._released_blocks(self.requests.pop(request), final)

    def _on_reserved(self, e: ev.TgtReserved) -> None:
        ids = self._logged_blocks(e.blocks)
        if self._replaying and not self._lazy:
            self._step("reserve", ids)
        seq = self._new_allocation(ids, e.request)
        self.requests[e.request] = _TargetRequest(ids, seq, _T_RESERVED)

    def _on_load_started(self, e: ev.TgtLoadStarted) -> None:
        req = self.requests[e.request]
        self._set(req, self._scalar("start_load", req.state))
        req.transfer = e.transfer
        self.loads[e.transfer] = Load(e.transfer, e.request, e.parts, e.generation, e.peer, e.peer_epoch, e.at)
        if e.layers:
            self.layer_progress[e.transfer] = LayerProgress(req.blocks, e.parts, e.layers)

    def _on_layers_landed(self, e: ev.TgtLayersLanded) -> None:
        load = self.loads[e.transfer]
        req = self.requests[load.request]
        self._set(req, self._scalar("layer_landed", req.state))
        progress = self.layer_progress[e.transfer]
        if self._replaying and not 0 <= e.first_layer <= e.first_layer + e.num_layers <= progress.layers:
            raise ValueError(f"layers [{e.first_layer}, {e.first_layer + e.num_layers}) out of range")
        progress.land(e.part, e.first_layer, e.num_layers, self._logged_blocks(e.blocks))
        if not e.verified:
            progress.unchecked.add(e.part)

    def _on_part_done(self, e: ev.TgtPartDone) -> None:
        load = self.loads[e.transfer]
        if e.transfer in self.mismatched:  # only a log written by someone else has this
            raise ValueError(f"part {e.part} completed after the load failed its digest")
        progress = self.layer_progress.get(e.transfer)
        if progress is not None and not progress.complete(e.part):  # only a log written by someone else has this
            raise ValueError(f"part {e.part} of a streaming load completed with layers missing")
        if e.verified:
            if self._replaying and e.verified > self.requests[load.request].blocks.size:  # someone else's log
                raise ValueError(f"part {e.part} verified {e.verified} blocks, more than its request holds")
            self.stats["verified_parts"] = self.stats.get("verified_parts", 0) + 1
            self.stats["verified_blocks"] = self.stats.get("verified_blocks", 0) + e.verified
        load.done.add(e.part)
        if len(load.done) < load.parts:
            return
        req = self.requests[load.request]
        del self.loads[e.transfer]
        self.layer_progress.pop(e.transfer, None)
        self.doomed.pop(e.transfer, None)  # only an older log completes a doomed load
        req.transfer = None
        if req.cancel_pending:
            self._drop(load.request, self._scalar("discard", req.state))
            self.stats["discarded"] += 1
        else:
            self._set(req, self._scalar("part_done", req.state, True))
            self.stats["loaded"] += 1

    def _on_peer_epoch(self, event: ev.PeerEpochChanged) -> None:
        """The new epoch dooms the live loads of the peer's older incarnations (kept LOADING until their failure)."""
        super()._on_peer_epoch(event)
        for load in self.loads.values():
            if load.peer == event.peer and load.peer_epoch < event.epoch:
                self.doomed.setdefault(load.transfer,
                                       f"peer_restarted: {event.peer} epoch {load.peer_epoch} -> {event.epoch}")

    def _on_load_failed(self, e: ev.TgtLoadFailed) -> None:
        load = self.loads.pop(e.transfer)
        self.mismatched.discard(e.transfer)
        self.doomed.pop(e.transfer, None)
        self.layer_progress.pop(e.transfer, None)
        req = self.requests[load.request]
        req.transfer = None
        if req.cancel_pending:
            self._drop(load.request, self._scalar("discard", req.state))
            self.stats["discarded"] += 1
            return
        nxt = self._scalar("load_failed", req.state, e.recompute)
        self.stats["recompute" if e.recompute else "failed"] += 1
        if e.recompute:
            self._set(req, nxt)
        else:
            self._drop(load.request, nxt)

    def _on_digest_mismatch(self, e: ev.TgtDigestMismatch) -> None:
        self.stats["digest_mismatches"] = self.stats.get("digest_mismatches", 0) + 1
        self.mismatched.add(e.transfer)
        for block in ev.unpack_blocks(e.blocks).tolist():
            self.quarantine[block] = (e.quarantine_until, e.transfer)
        if len(self.quarantine) > self.num_blocks // 4:  # expired holds go, so the map stays small
            self.quarantine = {b: q for b, q in self.quarantine.items() if q[0] > e.at}

    def _on_load_declined(self, e: ev.TgtLoadDeclined) -> None:
        load = self.loads.pop(e.transfer)
        self.mismatched.discard(e.transfer)
        self.doomed.pop(e.transfer, None)
        self.layer_progress.pop(e.transfer)
        req = self.requests[load.request]
        req.transfer = None
        if req.cancel_pending:
            self._drop(load.request, self._scalar("discard", req.state))
            self.stats["discarded"] += 1
            return
        self.stats["declined"] = self.stats.get("declined", 0) + 1
        self._set(req, self._scalar("decline", req.state))

    def _on_cancelled(self, e: ev.TgtCancelled) -> None:
        req = self.requests[e.request]
        in_flight = req.transfer is not None
        nxt = self._scalar("cancel", req.state, in_flight)
        self.stats["cancelled"] += 1
        if in_flight:
            req.cancel_pending = True
        else:
            self._drop(e.request, nxt)

    def _on_local_filled(self, e: ev.TgtLocalFilled) -> None:
        req = self.requests[e.request]
        self._set(req, self._scalar("local_fill", req.state))

    def _on_finished(self, e: ev.TgtFinished) -> None:
        req = self.requests[e.request]
        self._drop(e.request, self._scalar("finish", req.state))

