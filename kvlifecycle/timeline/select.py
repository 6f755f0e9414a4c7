"""Cutting a timeline down: to some requests (``--request``, the handoff followed across P and D) and to a window of
time (``--since`` / ``--until``).

A request is found the way ``replay --request`` and ``explain`` find it: every log folded by
:func:`kvlifecycle.story.trace_logs` (the ledger says which request each event concerns, a release or a part done
included) and :func:`kvlifecycle.story.linked_steps` (the ids each side gave the request, linked by the transfers
they share). The timeline is then built from those events alone. A window cuts the timeline built from every event:
what was open at its edges is cut there, so a slice keeps the state it was in.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence

from kvlifecycle.timeline.build import assign_lanes
from kvlifecycle.timeline.model import Slice, Timeline


@dataclasses.dataclass(frozen=True, slots=True)
class RequestEvents:
    """The events of some requests on every log, as :func:`~kvlifecycle.timeline.build.build_timeline` keeps them."""

    keep: frozenset[tuple[str, int]]  # (worker, index of the event in its log)
    requests: tuple[str, ...]  # the ids asked for, then the ids the other side gave them, in order of appearance


def request_events(paths: Iterable[str | os.PathLike[str]], requests: Sequence[str]) -> RequestEvents:
    """The events of ``requests`` (P's or D's ids) and of the handoffs they took part in. Raises
    :class:`~kvlifecycle.story.NotInLogsError` naming every id that matches nothing."""
    from kvlifecycle.story import linked_steps, no_such_request, trace_logs

    trace = trace_logs(paths)
    keep: set[tuple[str, int]] = set()
    names: dict[str, None] = dict.fromkeys(requests)
    missing = []
    for request in dict.fromkeys(requests):
        steps = linked_steps(trace, request)
        if not steps:
            missing.append(request)
        keep.update((s.worker, s.log_index) for s in steps)
        names.update(dict.fromkeys(s.request for s in steps if s.request))
    if missing:
        raise no_such_request(trace, missing)
    return RequestEvents(frozenset(keep), tuple(names))


def cut_to_window(timeline: Timeline, since: float | None, until: float | None) -> Timeline:
    """The part of ``timeline`` between wall times ``since`` and ``until`` (``None``: its start, its end): slices
    that overlap the window, cut at its edges (``args`` say where), instants inside it, and the grant → completion
    flows whose grant and completion both are. Raises ValueError for an empty or upside-down window."""
    lo = since if since is not None else timeline.t0 if until is None else min(timeline.t0, until)
    hi = until if until is not None else max(timeline.t_end, lo)
    if hi < lo:
        raise ValueError("--until is before --since")
    cut: dict[int, Slice] = {}
    for s in timeline.slices:
        if s.end < lo or s.start > hi:
            continue
        args = dict(s.args)
        if s.start < lo:
            args["starts_before_window"] = True
        if s.end > hi:
            args["ends_after_window"] = True
        cut[id(s)] = dataclasses.replace(s, start=max(s.start, lo), end=min(s.end, hi), args=args)
    instants = [i for i in timeline.instants if lo <= i.ts <= hi]
    flows = [dataclasses.replace(f, source=cut[id(f.source)], target=cut[id(f.target)]) for f in timeline.flows
             if lo <= f.source.start and f.target.end <= hi and id(f.source) in cut and id(f.target) in cut]
    slices = list(cut.values())
    if not slices and not instants:
        from kvlifecycle.story import NotInLogsError

        raise NotInLogsError(f"nothing happened between +{(lo - timeline.first_event) * 1e3:.3f} ms and "
                         f"+{(hi - timeline.first_event) * 1e3:.3f} ms after the first event")
    assign_lanes(slices)  # a window needs fewer lanes than the whole run
    shown = {s.worker for s in slices} | {i.worker for i in instants}
    workers = {w: side for w, side in timeline.workers.items() if w in shown}
    return dataclasses.replace(timeline, workers=workers, slices=slices, instants=instants, flows=flows,
                               t_end=min(hi, timeline.t_end), start=max(lo, timeline.start), window=(lo, hi))

