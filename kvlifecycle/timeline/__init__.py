"""Timelines of a handoff from the event logs: Chrome-trace / Perfetto JSON and a matplotlib PNG.

The logs of every worker are merged by hybrid logical clock (:func:`kvlifecycle.merge.merge_logs`). What the trace
shows, per worker (a Perfetto *process*):

* ``blocks`` lanes: one slice per block-state interval of each request's block group (ALLOCATED, READY,
  PINNED_FOR_TRANSFER, RELEASABLE on P; RESERVED, LOADING, READY_FOR_ATTENTION on D);
* ``transfers`` lanes: P's lease (grant → release, with its reason) and D's load (posted → ready or failed);
* ``data plane`` lanes: each observed transfer (T_xfer, with T_post, bytes, descriptors and backend as args);
* ``host pool`` lanes: P's copies to its host staging pool and the staged copies;
* ``events``: refusals, renewals, deferred cancels and peer restarts as instants;
* flow arrows from P's grant to D's completion of the same transfer.

Lanes are assigned so that slices on one Perfetto thread never overlap (the trace format needs proper nesting).

Reading path: :mod:`~kvlifecycle.timeline.model` (the values), :mod:`~kvlifecycle.timeline.build` (events →
slices), :mod:`~kvlifecycle.timeline.select` (``--request``, ``--since``/``--until``),
:mod:`~kvlifecycle.timeline.chrome` (the JSON and its check), :mod:`~kvlifecycle.timeline.aggregate` and
:mod:`~kvlifecycle.timeline.png` (the picture, readable at thousands of requests).
"""

from __future__ import annotations

from kvlifecycle.timeline.build import assign_lanes, build_timeline, timeline_from_logs
from kvlifecycle.timeline.chrome import to_chrome_trace, validate_chrome_trace, write_chrome_trace
from kvlifecycle.timeline.model import (
    RELEASED_STATES,
    STATE_COLOURS,
    TRACKS,
    Flow,
    Instant,
    Slice,
    Tick,
    Timeline,
)
from kvlifecycle.timeline.png import Drawing, render_png
from kvlifecycle.timeline.select import RequestEvents, cut_to_window, request_events

__all__ = [
    "RELEASED_STATES",
    "STATE_COLOURS",
    "TRACKS",
    "Drawing",
    "Flow",
    "Instant",
    "RequestEvents",
    "Slice",
    "Tick",
    "Timeline",
    "assign_lanes",
    "build_timeline",
    "cut_to_window",
    "render_png",
    "request_events",
    "timeline_from_logs",
    "to_chrome_trace",
    "validate_chrome_trace",
    "write_chrome_trace",
]
