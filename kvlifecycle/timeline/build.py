"""Building a :class:`~kvlifecycle.timeline.model.Timeline` from merged event logs.

Times come from each event's ledger clock (``at``: sub-millisecond, monotonic), placed on the wall-clock axis of the
HLC stamps with one offset per worker (HLC wall time has millisecond resolution only, too coarse for slices).

Scale: one pass over the merged events (0.25 s for the 25,000 events of a 2,000-request demo), and lanes given by a
heap of free lanes (greedy interval colouring in O(n log n), the lanes a scan of every lane would give; a run whose
requests pile up, P's lazily freed ones, no longer costs a scan of every lane per slice).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from kvlifecycle import events as ev
from kvlifecycle.clock import hlc_wall_seconds
from kvlifecycle.eventlog import Record
from kvlifecycle.timeline.model import RELEASED_STATES, Flow, Instant, Slice, Tick, Timeline, no_progress
from kvlifecycle.transfer_ids import source_transfers

PROGRESS_STEPS = 50  # a build ticks its progress this many times at most

def worker_offsets(merged: Sequence[tuple[str, str, Record]]) -> dict[str, float]:
    """Per worker, wall-clock seconds minus ledger-clock seconds. An HLC stamp's wall part is the floor of the wall
    clock in ms, or later when the clock observed a peer's stamp, so the smallest difference (plus half a ms) is the
    best estimate."""
    lowest: dict[str, float] = {}
    for worker, _side, record in merged:
        diff = hlc_wall_seconds(record.event.hlc) - record.event.at
        if diff < lowest.get(worker, float("inf")):
            lowest[worker] = diff
    return {worker: diff + 0.0005 for worker, diff in lowest.items()}


class Builder:
    def __init__(self) -> None:
        self.slices: list[Slice] = []
        self.instants: list[Instant] = []
        self.open_state: dict[tuple[str, str], Slice] = {}  # (worker, request) -> current block-state slice
        self.leases: dict[tuple[str, str], Slice] = {}  # (worker, transfer) -> P lease slice
        self.loads: dict[tuple[str, str], Slice] = {}  # (worker, transfer) -> D load slice
        self.load_parts: dict[tuple[str, str], tuple[str, int, set[int]]] = {}  # -> (request, parts, done)
        self.request_leases: dict[tuple[str, str], set[str]] = {}
        self.request_of_load: dict[tuple[str, str], str] = {}
        self.cancel_pending: set[tuple[str, str]] = set()
        self.grants: dict[str, Slice] = {}  # transfer -> P lease slice (any worker)
        self.completions: dict[str, list[Slice]] = {}  # P transfer -> D load slices that completed (one per consumer)
        self.unrendered: set[type[ev.Event]] = set()  # event kinds feed() has no rendering for (shown bare)
        self.staged: dict[tuple[str, str], Slice] = {}  # (pool worker, transfer) -> its copy's or staged slice
        self.group_blocks: dict[tuple[str, str], int] = {}  # (worker, request) -> blocks its group holds

    def state(self, worker: str, side: str, request: str, state: str | None, ts: float, **args: Any) -> None:
        key = (worker, request)
        current = self.open_state.pop(key, None)
        if current is not None:
            current.end = ts
        if "blocks" in args:
            self.group_blocks[key] = int(args["blocks"])
        if state is not None:
            label = state.split(" ")[0]
            new = Slice(worker, side, "blocks", f"{request} {state}", ts, ts, label, {"request": request, **args},
                        request=request, blocks=self.group_blocks.get(key, 0))
            self.slices.append(new)
            self.open_state[key] = new
        else:
            self.group_blocks.pop(key, None)

    def restart(self, worker: str, ts: float, incarnation: int, *, always: bool = True) -> None:
        """The worker's ledger restarted (new incarnation): whatever it had open ends here, unsettled. The restart
        is an instant of its own when ``always`` or when it ended something."""
        ended_any = False
        for table in (self.open_state, self.leases, self.loads, self.staged):
            for key in [k for k in table if k[0] == worker]:
                ended = table.pop(key)
                ended.end = ts
                ended.args["ended_by"] = "worker restart"
                ended_any = True
        for other in (self.load_parts, self.request_leases, self.group_blocks):
            for key in [k for k in other if k[0] == worker]:
                del other[key]
        if always or ended_any:
            self.instant(worker, "worker restarted", ts, incarnation=f"{incarnation:08x}")

    def instant(self, worker: str, name: str, ts: float, **args: Any) -> None:
        self.instants.append(Instant(worker, name, ts, args))

    def feed(self, worker: str, side: str, e: ev.Event, ts: float) -> None:
        if isinstance(e, ev.SrcAllocated):
            self.state(worker, side, e.request, "ALLOCATED", ts, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.SrcShared):
            self.state(worker, side, e.request, "READY (shared prefix)", ts, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.SrcPrefillDone):
            self.state(worker, side, e.request, "READY", ts)
        elif isinstance(e, ev.SrcGranted):
            leases = self.request_leases.setdefault((worker, e.request), set())
            if not leases:
                self.state(worker, side, e.request, "PINNED_FOR_TRANSFER", ts, transfer=e.transfer)
            leases.add(e.transfer)
            lease = Slice(worker, side, "transfers", f"lease {e.transfer}", ts, ts, "lease",
                          {"request": e.request, "transfer": e.transfer, "generation": e.generation,
                           "consumers": e.consumers, "peer": e.peer, "ttl_s": round(e.expires_at - e.at, 6)},
                          request=e.request)
            self.slices.append(lease)
            self.leases[(worker, e.transfer)] = lease
            self.grants[e.transfer] = lease
        elif isinstance(e, ev.SrcLeaseRenewed):
            self.instant(worker, "lease renewed", ts, transfer=e.transfer, expires_at=e.expires_at)
        elif isinstance(e, ev.SrcCancelDeferred):
            self.instant(worker, "cancel deferred", ts, transfer=e.transfer)
        elif isinstance(e, ev.SrcConsumerDone):
            self.instant(worker, "consumer done", ts, transfer=e.transfer, consumer=e.consumer)
        elif isinstance(e, ev.SrcLeaseReleased):
            released = self.leases.pop((worker, e.transfer), None)
            if released is not None:
                released.end = ts
                released.args["reason"] = e.reason
                if e.detail:
                    released.args["detail"] = e.detail
                if e.reason != "completed":
                    released.category = "failed" if e.reason != "cancelled" else released.category
                    released.name += f" ({e.reason})"
                request = released.args["request"]
                leases = self.request_leases.get((worker, request), set())
                leases.discard(e.transfer)
                if not leases:
                    self.state(worker, side, request, "RELEASABLE", ts, reason=e.reason)
            if e.reason == "expired":
                self.instant(worker, "lease expired", ts, transfer=e.transfer, detail=e.detail)
        elif isinstance(e, (ev.SrcFreed, ev.SrcAborted)):
            self.state(worker, side, e.request, None, ts)
            self.request_leases.pop((worker, e.request), None)
            what = "aborted" if isinstance(e, ev.SrcAborted) else ("cached" if e.cached else "freed")
            self.instant(worker, f"{e.request} {what}", ts, request=e.request)
        elif isinstance(e, ev.SrcEvicted):
            self.instant(worker, "evicted", ts, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.TgtReserved):
            self.state(worker, side, e.request, "RESERVED", ts, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.TgtLoadStarted):
            self.state(worker, side, e.request, "LOADING", ts, transfer=e.transfer)
            load = Slice(worker, side, "transfers", f"load {e.transfer}", ts, ts, "load",
                         {"request": e.request, "transfer": e.transfer, "parts": e.parts,
                          "generation": e.generation, "peer": e.peer, "peer_epoch": e.peer_epoch},
                         request=e.request)
            self.slices.append(load)
            self.loads[(worker, e.transfer)] = load
            self.load_parts[(worker, e.transfer)] = (e.request, e.parts, set())
            if e.layers:
                load.args["layers"] = e.layers
        elif isinstance(e, ev.TgtLayersLanded):
            last = e.first_layer + e.num_layers - 1
            layers = f"layer {e.first_layer}" if e.num_layers == 1 else f"layers {e.first_layer}-{last}"
            self.instant(worker, f"{layers} landed", ts, transfer=e.transfer, part=e.part, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.TgtPartDone):
            entry = self.load_parts.get((worker, e.transfer))
            if entry is None:
                return
            request, parts, done = entry
            done.add(e.part)
            if parts > 1:
                self.instant(worker, f"part {e.part} done", ts, transfer=e.transfer)
            if len(done) >= parts:
                self._settle_load(worker, side, e.transfer, request, ts, "ready")
        elif isinstance(e, ev.TgtLoadDeclined):
            entry = self.load_parts.get((worker, e.transfer))
            if entry is not None:
                self._settle_load(worker, side, e.transfer, entry[0], ts, "declined", e.reason)
        elif isinstance(e, ev.TgtDigestMismatch):
            self.instant(worker, f"digest mismatch: {len(e.expected) // 8} block(s)", ts, transfer=e.transfer,
                         part=e.part, blocks=len(e.blocks) // 4)
        elif isinstance(e, ev.TgtLoadFailed):
            entry = self.load_parts.get((worker, e.transfer))
            if entry is not None:
                outcome = "recompute" if e.recompute else "failed"
                self._settle_load(worker, side, e.transfer, entry[0], ts, outcome, e.reason)
        elif isinstance(e, ev.TgtCancelled):
            key = (worker, e.request)
            current = self.open_state.get(key)
            if current is not None and current.category == "LOADING":
                self.cancel_pending.add(key)
                self.state(worker, side, e.request, "LOADING (cancel pending)", ts)
            else:
                self.state(worker, side, e.request, None, ts)
            self.instant(worker, f"{e.request} cancelled", ts, request=e.request)
        elif isinstance(e, ev.TgtLocalFilled):
            self.state(worker, side, e.request, "READY_FOR_ATTENTION (recomputed)", ts)
        elif isinstance(e, ev.TgtFinished):
            self.state(worker, side, e.request, None, ts)
        elif isinstance(e, ev.PeerEpochChanged):
            self.instant(worker, "peer epoch changed", ts, peer=e.peer, epoch=e.epoch)
        elif isinstance(e, ev.TransferObserved):
            start = ts - max(e.t_xfer_s, 0.0)
            owner = self.loads.get((worker, e.transfer)) or self.leases.get((worker, e.transfer))
            self.slices.append(Slice(worker, side, "data plane", f"xfer {e.transfer}", start, ts,
                                     "transfer" if e.ok else "failed",
                                     {"transfer": e.transfer, "t_post_s": e.t_post_s, "t_xfer_s": e.t_xfer_s,
                                      "bytes": e.nbytes, "descriptors": e.descriptors, "backend": e.backend,
                                      "ok": e.ok}, request=owner.request if owner is not None else ""))
        elif isinstance(e, ev.Refused):
            self.instant(worker, f"refused {e.command}", ts, reason=e.reason, request=e.request,
                         transfer=e.transfer)
        elif isinstance(e, ev.StgStarted | ev.StgCompleted | ev.StgAborted | ev.StgServed | ev.StgRenewed
                        | ev.StgReadEnded | ev.StgReleased):
            self._host_pool(worker, side, e, ts)
        else:  # a kind without a rendering yet is shown as a bare instant, never dropped
            self.unrendered.add(type(e))
            self.instant(worker, type(e).__name__, ts)

    def _host_pool(self, worker: str, side: str, e: ev.Event, ts: float) -> None:
        """P's host staging pool: the copy to host (until complete or dropped), then the staged copy (until its
        lease ends), on the pool's own track."""
        key = (worker, getattr(e, "transfer", ""))
        if isinstance(e, ev.StgStarted):
            posted = Slice(worker, side, "host pool", f"copy to host {e.transfer}", ts, ts, "staging",
                           {"request": e.request, "transfer": e.transfer, "slots": len(e.blocks) // 4},
                           request=e.request)
            self.slices.append(posted)
            self.staged[key] = posted
        elif isinstance(e, ev.StgCompleted):
            copied = self.staged.pop(key, None)
            if copied is not None:
                copied.end = ts
                staged = Slice(worker, side, "host pool", f"staged {e.transfer}", ts, ts, "staged", dict(copied.args),
                               request=copied.request)
                self.slices.append(staged)
                self.staged[key] = staged
        elif isinstance(e, ev.StgAborted | ev.StgReleased):
            ended = self.staged.pop(key, None)
            if ended is not None:
                ended.end = ts
                ended.args["reason"] = e.reason
                if isinstance(e, ev.StgAborted) or e.reason not in ("completed",):
                    ended.name += f" ({e.reason})"
        elif isinstance(e, ev.StgServed):
            self.instant(worker, "staged copy claimed", ts, transfer=e.transfer, peer=e.peer)
        elif isinstance(e, ev.StgRenewed):
            self.instant(worker, "staged copy renewed", ts, transfer=e.transfer, expires_at=e.expires_at)
        elif isinstance(e, ev.StgReadEnded):
            self.instant(worker, "staged read ended", ts, transfer=e.transfer, ok=e.ok, reason=e.reason)

    def _settle_load(self, worker: str, side: str, transfer: str, request: str, ts: float, outcome: str,
                     reason: str = "") -> None:
        self.load_parts.pop((worker, transfer), None)
        load = self.loads.pop((worker, transfer), None)
        key = (worker, request)
        discarded = key in self.cancel_pending
        self.cancel_pending.discard(key)
        if discarded:
            outcome = "discarded"
        if load is not None:
            load.end = ts
            load.args["outcome"] = outcome
            if reason:
                load.args["reason"] = reason
            if outcome != "ready":
                load.category = "failed"
                load.name += f" ({outcome})"
            else:
                for source_transfer in source_transfers(transfer):
                    self.completions.setdefault(source_transfer, []).append(load)
        if outcome == "ready":
            self.state(worker, side, request, "READY_FOR_ATTENTION", ts)
        elif outcome == "recompute":
            self.state(worker, side, request, "RESERVED (recompute)", ts)
        elif outcome == "declined":
            self.state(worker, side, request, "RESERVED (stream declined)", ts)
        else:
            self.state(worker, side, request, None, ts)


def assign_lanes(slices: Iterable[Slice]) -> None:
    """Greedy interval colouring per (worker, track): a slice takes the lowest lane free at its start. The lanes
    whose last slice ended by then wait in a heap, the busy ones in another (by end): O(n log n)."""
    busy: dict[tuple[str, str], list[tuple[float, int]]] = {}
    free: dict[tuple[str, str], list[int]] = {}
    for s in sorted(slices, key=lambda s: (s.start, s.end)):
        key = (s.worker, s.track)
        ends, idle = busy.setdefault(key, []), free.setdefault(key, [])
        while ends and ends[0][0] <= s.start:
            heapq.heappush(idle, heapq.heappop(ends)[1])
        s.lane = heapq.heappop(idle) if idle else len(ends) + len(idle)
        heapq.heappush(ends, (s.end, s.lane))


def build_timeline(merged: Sequence[tuple[str, str, Record]], *, keep: Collection[tuple[str, int]] | None = None,
                   tick: Tick = no_progress) -> Timeline:
    """A :class:`Timeline` from ``merge_logs`` output. ``keep``: draw only these ``(worker, record index)`` events
    (every event still places the workers on the clock and marks their restarts, so times are those of the whole
    logs); ``tick`` is told as the events go by (:data:`PROGRESS_STEPS` times at most, one step in all)."""
    if not merged:
        raise ValueError("no events to draw")
    offsets = worker_offsets(merged)
    builder = Builder()
    workers: dict[str, str] = {}
    first_event, log_end = float("inf"), float("-inf")
    t_min, t_max = float("inf"), float("-inf")
    incarnations: dict[str, int] = {}
    chunk = max(1, len(merged) // PROGRESS_STEPS)
    for n, (worker, side, record) in enumerate(merged):
        if n % chunk == chunk - 1:
            tick(None, chunk / len(merged))
        ts = record.event.at + offsets[worker]
        first_event, log_end = min(first_event, ts), max(log_end, ts)
        if incarnations.setdefault(worker, record.incarnation) != record.incarnation:
            incarnations[worker] = record.incarnation
            builder.restart(worker, ts, record.incarnation, always=keep is None)
        if keep is not None and (worker, record.index) not in keep:
            continue
        workers.setdefault(worker, side)
        t_min, t_max = min(t_min, ts), max(t_max, ts)
        builder.feed(worker, side, record.event, ts)
    if not workers:
        raise ValueError("no events to draw")
    for s in builder.slices:
        t_min = min(t_min, s.start)
    for still_open in [*builder.open_state.values(), *builder.leases.values(), *builder.loads.values(),
                       *builder.staged.values()]:
        still_open.end = t_max = log_end
        still_open.open = True
        if still_open.category in RELEASED_STATES:  # released by its lease; the engine frees when it likes
            still_open.args["held"] = False
    flows = [Flow(transfer, grant, load) for transfer, grant in builder.grants.items()
             for load in builder.completions.get(transfer, [])]
    assign_lanes(builder.slices)
    t_end = max(t_max, *(s.end for s in builder.slices)) if builder.slices else t_max
    return Timeline(workers, builder.slices, builder.instants, flows, min(t_min, first_event), t_end,
                    first_event=first_event, start=t_min)


def timeline_from_logs(paths: Iterable[str | os.PathLike[str]], *, keep: Collection[tuple[str, int]] | None = None,
                       tick: Tick = no_progress) -> Timeline:
    """The timeline of the logs at ``paths`` (directories, as ``replay`` takes them); ``keep`` and ``tick`` as
    :func:`build_timeline` takes them (reading the logs is half of ``tick``'s step, building the other half)."""
    from kvlifecycle.merge import merge_logs

    merged = merge_logs(paths)
    tick("building", 0.5)

    def half(note: str | None = None, steps: float = 1) -> None:
        tick(note, steps / 2)

    return build_timeline(merged, keep=keep, tick=half)
