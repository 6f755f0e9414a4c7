"""Timelines of a handoff from the event logs: Chrome-trace / Perfetto JSON and a matplotlib PNG.

The logs of every worker are merged by hybrid logical clock (:func:`kvlifecycle.merge.merge_logs`). Times come from
each event's ledger clock (``at``: sub-millisecond, monotonic), placed on the wall-clock axis of the HLC stamps with
one offset per worker (HLC wall time has millisecond resolution only, too coarse for slices).

What the trace shows, per worker (a Perfetto *process*):

* ``blocks`` lanes: one slice per block-state interval of each request's block group (ALLOCATED, READY,
  PINNED_FOR_TRANSFER, RELEASABLE on P; RESERVED, LOADING, READY_FOR_ATTENTION on D);
* ``transfers`` lanes: P's lease (grant → release, with its reason) and D's load (posted → ready or failed);
* ``data plane`` lanes: each observed transfer (T_xfer, with T_post, bytes, descriptors and backend as args);
* ``events``: refusals, renewals, deferred cancels and peer restarts as instants;
* flow arrows from P's grant to D's completion of the same transfer.

Lanes are assigned so that slices on one Perfetto thread never overlap (the trace format needs proper nesting).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlifecycle import events as ev
from kvlifecycle.clock import hlc_wall_seconds
from kvlifecycle.eventlog import Record
from kvlifecycle.transfer_ids import source_transfers

TRACKS = ("blocks", "transfers", "data plane", "host pool")
_TRACK_TID_BASE = {"events": 0, "blocks": 1000, "transfers": 2000, "data plane": 3000, "host pool": 4000}

# colours shared by the PNG (and used as Perfetto's reserved colour names where one fits)
STATE_COLOURS = {
    "ALLOCATED": "#9ecae1",
    "READY": "#3182bd",
    "PINNED_FOR_TRANSFER": "#e6550d",
    "RELEASABLE": "#fdae6b",
    "RESERVED": "#c7e9c0",
    "LOADING": "#31a354",
    "READY_FOR_ATTENTION": "#006d2c",
    "lease": "#756bb1",
    "load": "#9e9ac8",
    "transfer": "#636363",  # a data-plane transfer (T_xfer)
    "failed": "#de2d26",
    "staging": "#fdd0a2",  # P's copy to its host pool, in flight
    "staged": "#a63603",  # a whole staged copy under its lease
}


@dataclass(slots=True)
class Slice:
    worker: str
    side: str
    track: str  # one of TRACKS
    name: str
    start: float  # seconds on the merged wall-clock axis
    end: float
    category: str  # state name, "lease", "load", "transfer"
    args: dict[str, Any] = field(default_factory=dict)
    lane: int = 0
    open: bool = False  # still open when the log ended


@dataclass(frozen=True, slots=True)
class Instant:
    worker: str
    name: str
    ts: float
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Flow:
    transfer: str
    source: Slice  # P's lease slice: the arrow leaves at its start (the grant)
    target: Slice  # D's load slice: the arrow lands at its end (the completion)


@dataclass(slots=True)
class Timeline:
    workers: dict[str, str]  # worker -> side, in order of first appearance
    slices: list[Slice]
    instants: list[Instant]
    flows: list[Flow]
    t0: float  # wall-clock seconds of the earliest event (the trace's zero)
    t_end: float


# --- building --------------------------------------------------------------------------------------------------


def _worker_offsets(merged: Sequence[tuple[str, str, Record]]) -> dict[str, float]:
    """Per worker, wall-clock seconds minus ledger-clock seconds. An HLC stamp's wall part is the floor of the wall
    clock in ms, or later when the clock observed a peer's stamp, so the smallest difference (plus half a ms) is the
    best estimate."""
    lowest: dict[str, float] = {}
    for worker, _side, record in merged:
        diff = hlc_wall_seconds(record.event.hlc) - record.event.at
        if diff < lowest.get(worker, float("inf")):
            lowest[worker] = diff
    return {worker: diff + 0.0005 for worker, diff in lowest.items()}


class _Builder:
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

    def state(self, worker: str, side: str, request: str, state: str | None, ts: float, **args: Any) -> None:
        key = (worker, request)
        current = self.open_state.pop(key, None)
        if current is not None:
            current.end = ts
        if state is not None:
            label = state.split(" ")[0]
            new = Slice(worker, side, "blocks", f"{request} {state}", ts, ts, label, {"request": request, **args})
            self.slices.append(new)
            self.open_state[key] = new

    def restart(self, worker: str, ts: float, incarnation: int) -> None:
        """The worker's ledger restarted (new incarnation): whatever it had open ends here, unsettled."""
        for table in (self.open_state, self.leases, self.loads, self.staged):
            for key in [k for k in table if k[0] == worker]:
                ended = table.pop(key)
                ended.end = ts
                ended.args["ended_by"] = "worker restart"
        for key in [k for k in self.load_parts if k[0] == worker]:
            del self.load_parts[key]
        for key in [k for k in self.request_leases if k[0] == worker]:
            del self.request_leases[key]
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
                           "consumers": e.consumers, "peer": e.peer, "ttl_s": round(e.expires_at - e.at, 6)})
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
                          "generation": e.generation, "peer": e.peer, "peer_epoch": e.peer_epoch})
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
            self.slices.append(Slice(worker, side, "data plane", f"xfer {e.transfer}", start, ts,
                                     "transfer" if e.ok else "failed",
                                     {"transfer": e.transfer, "t_post_s": e.t_post_s, "t_xfer_s": e.t_xfer_s,
                                      "bytes": e.nbytes, "descriptors": e.descriptors, "backend": e.backend,
                                      "ok": e.ok}))
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
                           {"request": e.request, "transfer": e.transfer, "slots": len(e.blocks) // 4})
            self.slices.append(posted)
            self.staged[key] = posted
        elif isinstance(e, ev.StgCompleted):
            copied = self.staged.pop(key, None)
            if copied is not None:
                copied.end = ts
                staged = Slice(worker, side, "host pool", f"staged {e.transfer}", ts, ts, "staged", dict(copied.args))
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


def _assign_lanes(slices: list[Slice]) -> None:
    """Greedy interval colouring per (worker, track): a slice takes the lowest lane free at its start."""
    ends: dict[tuple[str, str], list[float]] = {}
    for s in sorted(slices, key=lambda s: (s.start, s.end)):
        lanes = ends.setdefault((s.worker, s.track), [])
        for i, end in enumerate(lanes):
            if end <= s.start:
                s.lane = i
                lanes[i] = s.end
                break
        else:
            s.lane = len(lanes)
            lanes.append(s.end)


def build_timeline(merged: Sequence[tuple[str, str, Record]]) -> Timeline:
    """A :class:`Timeline` from ``merge_logs`` output."""
    if not merged:
        raise ValueError("no events to draw")
    offsets = _worker_offsets(merged)
    builder = _Builder()
    workers: dict[str, str] = {}
    t_min, t_max = float("inf"), float("-inf")
    incarnations: dict[str, int] = {}
    for worker, side, record in merged:
        workers.setdefault(worker, side)
        ts = record.event.at + offsets[worker]
        t_min, t_max = min(t_min, ts), max(t_max, ts)
        if incarnations.setdefault(worker, record.incarnation) != record.incarnation:
            incarnations[worker] = record.incarnation
            builder.restart(worker, ts, record.incarnation)
        builder.feed(worker, side, record.event, ts)
    for s in builder.slices:
        t_min = min(t_min, s.start)
    for still_open in [*builder.open_state.values(), *builder.leases.values(), *builder.loads.values(),
                       *builder.staged.values()]:
        still_open.end = t_max
        still_open.open = True
    flows = [Flow(transfer, grant, load) for transfer, grant in builder.grants.items()
             for load in builder.completions.get(transfer, [])]
    _assign_lanes(builder.slices)
    return Timeline(workers, builder.slices, builder.instants, flows, t_min, t_max)


def timeline_from_logs(paths: Iterable[str | os.PathLike[str]]) -> Timeline:
    from kvlifecycle.merge import merge_logs

    return build_timeline(merge_logs(paths))


# --- Chrome trace / Perfetto JSON ------------------------------------------------------------------------------


def _tid(track: str, lane: int) -> int:
    return _TRACK_TID_BASE[track] + lane


def _us(seconds: float, t0: float) -> float:
    return round((seconds - t0) * 1e6, 3)


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace-event JSON object (opens in ui.perfetto.dev and chrome://tracing)."""
    pids = {worker: i + 1 for i, worker in enumerate(sorted(timeline.workers,
                                                            key=lambda w: (timeline.workers[w] != "source", w)))}
    out: list[dict[str, Any]] = []
    for worker, pid in pids.items():
        side = timeline.workers[worker]
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
                    "args": {"name": f"{worker} ({'D' if side == 'target' else 'P'}, {side})"}})
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}})
        out.append({"ph": "M", "pid": pid, "tid": 0, "name": "thread_name", "args": {"name": "events"}})
    lanes = sorted({(s.worker, s.track, s.lane) for s in timeline.slices})
    for worker, track, lane in lanes:
        tid = _tid(track, lane)
        out.append({"ph": "M", "pid": pids[worker], "tid": tid, "name": "thread_name",
                    "args": {"name": f"{track} {lane}"}})
        out.append({"ph": "M", "pid": pids[worker], "tid": tid, "name": "thread_sort_index",
                    "args": {"sort_index": tid}})
    for s in sorted(timeline.slices, key=lambda s: (s.start, -s.end)):
        args = dict(s.args)
        if s.open:
            args["open_at_end_of_log"] = True
        start_us, end_us = _us(s.start, timeline.t0), _us(s.end, timeline.t0)  # adjacent slices share a boundary
        out.append({"ph": "X", "pid": pids[s.worker], "tid": _tid(s.track, s.lane), "name": s.name,
                    "cat": s.category, "ts": start_us, "dur": max(round(end_us - start_us, 3), 0.0), "args": args})
    for i in timeline.instants:
        out.append({"ph": "i", "s": "t", "pid": pids[i.worker], "tid": 0, "name": i.name, "cat": "event",
                    "ts": _us(i.ts, timeline.t0), "args": {k: v for k, v in i.args.items() if v not in ("", None)}})
    for flow_id, flow in enumerate(timeline.flows, start=1):
        src, dst = flow.source, flow.target
        end_us = _us(dst.end, timeline.t0)
        start_us = _us(dst.start, timeline.t0)
        # the arrow must land inside D's load slice: a hair before its end
        land = max(start_us, round(end_us - min(1.0, (end_us - start_us) / 2), 3))
        common = {"cat": "handoff", "name": flow.transfer, "id": flow_id}
        out.append({"ph": "s", "pid": pids[src.worker], "tid": _tid(src.track, src.lane),
                    "ts": _us(src.start, timeline.t0), **common})
        out.append({"ph": "f", "bp": "e", "pid": pids[dst.worker], "tid": _tid(dst.track, dst.lane), "ts": land,
                    **common})
    return {
        "traceEvents": out,
        "displayTimeUnit": "ms",
        "otherData": {"generator": "kvlifecycle timeline", "t0_unix_s": timeline.t0,
                      "workers": timeline.workers, "flows": len(timeline.flows)},
    }


_PHASE_FIELDS = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "B": ("name", "ts", "pid", "tid"),
    "E": ("ts", "pid", "tid"),
    "i": ("name", "ts", "pid", "tid"),
    "I": ("name", "ts", "pid", "tid"),
    "M": ("name", "pid", "args"),
    "s": ("name", "ts", "pid", "tid", "id"),
    "t": ("name", "ts", "pid", "tid", "id"),
    "f": ("name", "ts", "pid", "tid", "id"),
    "C": ("name", "ts", "pid", "args"),
}


def validate_chrome_trace(trace: object) -> list[str]:
    """Structural problems of a trace-event JSON object (empty list: none): known phases with their required fields,
    numeric times, no overlapping-but-unnested ``X`` slices on one thread, every flow start with a finish on a
    thread that has a slice enclosing it."""
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level must be an object with a 'traceEvents' list"]
    slices: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    flows: dict[tuple[Any, Any], dict[str, dict[str, Any]]] = {}  # (cat, id) -> phase -> event
    for n, event in enumerate(trace["traceEvents"]):
        if not isinstance(event, dict):
            problems.append(f"event {n}: not an object")
            continue
        ph = event.get("ph")
        required = _PHASE_FIELDS.get(ph) if isinstance(ph, str) else None
        if required is None:
            problems.append(f"event {n}: unknown phase {ph!r}")
            continue
        missing = [k for k in required if k not in event]
        if missing:
            problems.append(f"event {n} ({ph}): missing {missing}")
            continue
        for key in ("ts", "dur"):
            if key in event and (not isinstance(event[key], (int, float)) or event[key] < 0):
                problems.append(f"event {n} ({ph}): {key} must be a non-negative number, got {event[key]!r}")
        if ph == "X":
            slices.setdefault((event["pid"], event["tid"]), []).append(
                (float(event["ts"]), float(event["ts"]) + float(event["dur"]), str(event["name"])))
        elif ph in ("s", "f"):
            flows.setdefault((event.get("cat"), event["id"]), {})[ph] = event
    for thread, items in slices.items():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack: list[tuple[float, float, str]] = []
        for start, end, name in items:
            while stack and stack[-1][1] <= start + 2e-3:
                stack.pop()
            if stack and end > stack[-1][1] + 2e-3:  # µs rounding
                problems.append(f"thread {thread}: slice {name!r} overlaps {stack[-1][2]!r} without nesting")
            stack.append((start, end, name))
    for flow, pair in flows.items():
        if set(pair) != {"s", "f"}:
            problems.append(f"flow {flow}: has {sorted(pair)} (needs both 's' and 'f')")
            continue
        for ph, event in pair.items():
            thread = (event["pid"], event["tid"])
            ts = float(event["ts"])
            if not any(start <= ts <= end for start, end, _ in slices.get(thread, [])):
                problems.append(f"flow {flow}: '{ph}' at {ts} is inside no slice of thread {thread}")
        if float(pair["f"]["ts"]) < float(pair["s"]["ts"]):
            problems.append(f"flow {flow}: finishes before it starts")
    return problems


def write_chrome_trace(timeline: Timeline, path: str | os.PathLike[str]) -> dict[str, Any]:
    trace = to_chrome_trace(timeline)
    problems = validate_chrome_trace(trace)
    if problems:  # a bug here, not bad input: refuse to write a file Perfetto would misdraw
        raise ValueError("generated trace is malformed: " + "; ".join(problems[:5]))
    Path(path).write_text(json.dumps(trace, separators=(",", ":")))
    return trace


# --- PNG -------------------------------------------------------------------------------------------------------


def render_png(timeline: Timeline, path: str | os.PathLike[str], *, title: str | None = None,
               max_rows: int = 40) -> int:
    """Draw the timeline with matplotlib (Agg): one row per (worker, track, lane), bars coloured by state, arrows
    from P's grant to D's completion. Returns the number of rows drawn (lanes past ``max_rows`` are left out)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    order = sorted(timeline.workers, key=lambda w: (timeline.workers[w] != "source", w))
    rows: list[tuple[str, str, int]] = []
    for worker in order:
        for track in TRACKS:
            lanes = sorted({s.lane for s in timeline.slices if s.worker == worker and s.track == track})
            rows.extend((worker, track, lane) for lane in lanes)
    rows = rows[:max_rows]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    scale = 1e3  # milliseconds
    fig_height = 1.2 + 0.32 * max(len(rows), 1)
    fig, ax = plt.subplots(figsize=(12, fig_height), dpi=110)
    span_ms = max((timeline.t_end - timeline.t0) * scale, 1e-6)
    char_width = span_ms / 190  # a 6-point character in data units on a 12-inch axis, roughly
    for s in timeline.slices:
        y = y_of.get((s.worker, s.track, s.lane))
        if y is None:
            continue
        start = (s.start - timeline.t0) * scale
        width = max((s.end - s.start) * scale, 0.002 * (timeline.t_end - timeline.t0) * scale)
        colour = STATE_COLOURS.get(s.category, "#bdbdbd")
        ax.barh(y, width, left=start, height=0.7, color=colour, edgecolor="black", linewidth=0.3,
                hatch="//" if s.open else None)
        label = s.name if s.track == "blocks" else s.name.split(" ")[0]
        if s.track == "blocks" and len(label) * char_width > width:
            label = s.category.split("_")[0]  # the request is on the neighbouring slices; keep the state
        if len(label) * char_width <= width:
            ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=6, clip_on=True,
                    color="white" if s.category in ("READY", "LOADING", "READY_FOR_ATTENTION", "lease", "transfer",
                                                    "failed", "PINNED_FOR_TRANSFER") else "black")
    for flow in timeline.flows:
        a = y_of.get((flow.source.worker, flow.source.track, flow.source.lane))
        b = y_of.get((flow.target.worker, flow.target.track, flow.target.lane))
        if a is None or b is None:
            continue
        ax.annotate("", xy=((flow.target.end - timeline.t0) * scale, b),
                    xytext=((flow.source.start - timeline.t0) * scale, a),
                    arrowprops={"arrowstyle": "->", "color": "#d62728", "lw": 0.8, "alpha": 0.8})
    for instant in timeline.instants:
        if not instant.name.startswith(("refused", "lease expired")):
            continue
        rows_of_worker = [y for (w, _t, _l), y in y_of.items() if w == instant.worker]
        if rows_of_worker:
            ax.plot((instant.ts - timeline.t0) * scale, max(rows_of_worker) + 0.45, marker="v", color="#de2d26",
                    markersize=5)
    ax.set_yticks([y_of[row] for row in rows])
    ax.set_yticklabels([f"{w} · {t} {lane}" for w, t, lane in rows], fontsize=7)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("milliseconds since the first event")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(title or "kvlifecycle handoff timeline", fontsize=10)
    used = {s.category for s in timeline.slices}
    handles = [Patch(color=c, label=name) for name, c in STATE_COLOURS.items() if name in used]
    handles.append(Patch(color="#d62728", label="grant → completion"))
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return len(rows)
