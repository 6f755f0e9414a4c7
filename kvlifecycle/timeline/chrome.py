"""A :class:`~kvlifecycle.timeline.model.Timeline` as Chrome trace-event JSON (ui.perfetto.dev, chrome://tracing), and
the structural check every written trace passes first."""

from __future__ import annotations

import bisect
import itertools
import json
import os
from pathlib import Path
from typing import Any

from kvlifecycle.timeline.model import Timeline, ordered_workers

_TRACK_TID_BASE = {"events": 0, "blocks": 1000, "transfers": 2000, "data plane": 3000, "host pool": 4000}


def _tid(track: str, lane: int) -> int:
    return _TRACK_TID_BASE[track] + lane


def _us(seconds: float, t0: float) -> float:
    return round((seconds - t0) * 1e6, 3)


def to_chrome_trace(timeline: Timeline) -> dict[str, Any]:
    """The timeline as a Chrome trace-event JSON object (opens in ui.perfetto.dev and chrome://tracing)."""
    pids = {worker: i + 1 for i, worker in enumerate(ordered_workers(timeline))}
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
        "otherData": _other_data(timeline),
    }


def _other_data(timeline: Timeline) -> dict[str, Any]:
    """What the trace was cut to, besides what it holds: the window (µs on the trace's axis) and the requests."""
    other: dict[str, Any] = {"generator": "kvlifecycle timeline", "t0_unix_s": timeline.t0,
                             "workers": timeline.workers, "flows": len(timeline.flows)}
    if timeline.window is not None:
        other["window_us"] = [_us(edge, timeline.t0) for edge in timeline.window]
    if timeline.requests:
        other["requests"] = list(timeline.requests)
    return other


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
    # per thread, the slices' starts (sorted above) and the latest end among the slices started by each: a time is
    # inside some slice when the latest end of the slices started by then reaches it (a bisection, not a scan)
    reach = {thread: ([start for start, _, _ in items], list(itertools.accumulate((end for _, end, _ in items), max)))
             for thread, items in slices.items()}
    for flow, pair in flows.items():
        if set(pair) != {"s", "f"}:
            problems.append(f"flow {flow}: has {sorted(pair)} (needs both 's' and 'f')")
            continue
        for ph, event in pair.items():
            thread = (event["pid"], event["tid"])
            ts = float(event["ts"])
            starts, ends = reach.get(thread, ([], []))
            last = bisect.bisect_right(starts, ts) - 1
            if last < 0 or ends[last] < ts:
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


