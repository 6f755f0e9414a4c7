"""What a timeline of many requests is drawn as: blocks per state over time on each worker (every request counted),
and a few requests, spread over the run, drawn in detail.

At 2,000 requests one bar per block-state interval is thinner than a pixel and the grant → completion arrows cover
the picture; counts stay readable at any scale, and the sampled requests show what one handoff looked like.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvlifecycle.timeline.model import Slice, Timeline


@dataclass(frozen=True)
class StepCounts:
    """A step function per category: ``counts[c][i]`` holds on ``[times[i], times[i + 1])``."""

    times: np.ndarray  # wall seconds, increasing
    counts: dict[str, np.ndarray]  # category -> its weight summed over the slices open at each step


def step_counts(slices: Iterable[Slice], weight: str = "blocks") -> StepCounts:
    """Per category, the summed ``weight`` (``"blocks"``: the blocks a slice's group holds; ``"one"``: 1 per slice)
    of the slices open at each moment. Vectorised: one sort of the edges, one cumulative sum per category."""
    rows = [(s.category, s.start, s.end, s.blocks if weight == "blocks" else 1) for s in slices]
    if not rows:
        return StepCounts(np.zeros(0), {})
    categories = np.array([r[0] for r in rows])
    starts = np.array([r[1] for r in rows], dtype=np.float64)
    ends = np.array([r[2] for r in rows], dtype=np.float64)
    weights = np.array([r[3] for r in rows], dtype=np.float64)
    times = np.unique(np.concatenate([starts, ends]))
    first, last = np.searchsorted(times, starts), np.searchsorted(times, ends)
    counts: dict[str, np.ndarray] = {}
    for category in dict.fromkeys(categories.tolist()):
        mine = categories == category
        delta = np.zeros(len(times))
        np.add.at(delta, first[mine], weights[mine])
        np.add.at(delta, last[mine], -weights[mine])
        counts[category] = np.cumsum(delta)
    return StepCounts(times, counts)


def binned(counts: StepCounts, lo: float, hi: float, bins: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """The bin edges over ``[lo, hi]`` and, per category, the time-weighted mean of its count in each of ``bins``
    equal bins: a run of thousands of short handoffs toggles its counts faster than a pixel, their mean does not.
    Exact: the integral of a step function is piecewise linear between its steps, so it interpolates."""
    edges = np.linspace(lo, hi, bins + 1)
    means: dict[str, np.ndarray] = {}
    if len(counts.times) < 2 or hi <= lo:
        return edges, {category: np.zeros(bins) for category in counts.counts}
    widths = np.diff(counts.times)
    for category, values in counts.counts.items():
        area = np.concatenate([[0.0], np.cumsum(values[:-1] * widths)])  # the integral up to each step
        means[category] = np.diff(np.interp(edges, counts.times, area)) / np.diff(edges)
    return edges, means


def request_groups(timeline: Timeline) -> list[list[str]]:
    """The requests of the timeline as handoffs, in order of first appearance: a request's ids on every worker
    together (a D that names the request anew is linked to P's id by the grant → completion flow)."""
    group_of: dict[str, str] = {}
    for flow in timeline.flows:
        source = group_of.setdefault(flow.source.request, flow.source.request)
        group_of.setdefault(flow.target.request, source)
    groups: dict[str, list[str]] = {}
    for s in sorted((s for s in timeline.slices if s.request), key=lambda s: s.start):
        members = groups.setdefault(group_of.get(s.request, s.request), [])
        if s.request not in members:
            members.append(s.request)
    return list(groups.values())


def sample_groups(groups: list[list[str]], n: int) -> list[list[str]]:
    """``n`` of ``groups`` spread evenly from the first to the last (all of them when there are no more than ``n``)."""
    if len(groups) <= n:
        return groups
    picks = np.unique(np.linspace(0, len(groups) - 1, max(n, 1)).round().astype(int))
    return [groups[i] for i in picks.tolist()]
