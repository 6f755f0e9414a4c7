"""The timeline as a PNG (matplotlib, Agg; the ``viz`` extra).

Up to ``sample`` requests every request is drawn in detail: one row per (worker, track, lane), bars coloured by
state, an arrow from P's grant to D's completion of each transfer. Past that the picture would be a wall of bars
thinner than a pixel and of arrows, so it changes: each worker's blocks per state over time (every request counted,
with the transfers in flight), and below, ``sample`` requests spread evenly over the run drawn in detail, one row
per (worker, request). The title says which picture it is.

Bars are drawn as one polygon collection per style, never one artist per slice (matplotlib spends milliseconds on
each artist). Blocks P's lease released (RELEASABLE) are drawn thin and pale: no transfer holds them, the engine
frees them when it likes, and one still RELEASABLE where the log ends is released, not leaked.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle.timeline.aggregate import binned, request_groups, sample_groups, step_counts
from kvlifecycle.timeline.model import (
    RELEASED_STATES,
    STATE_COLOURS,
    TRACKS,
    Slice,
    Tick,
    Timeline,
    no_progress,
    ordered_workers,
)

_STACK_ORDER = ("ALLOCATED", "READY", "PINNED_FOR_TRANSFER", "RESERVED", "LOADING", "READY_FOR_ATTENTION",
                "RELEASABLE")
_DARK = ("READY", "LOADING", "READY_FOR_ATTENTION", "lease", "transfer", "failed", "PINNED_FOR_TRANSFER")
_RELEASED_LABEL = "RELEASABLE: released, not held (the engine frees lazily)"
_ARROW = "#d62728"
_MS = 1e3
BINS = 300  # time bins of the counts: about three pixels each on the 12-inch figure


@dataclass(frozen=True, slots=True)
class Drawing:
    """What :func:`render_png` drew."""

    mode: str  # "detail" (every request) or "aggregate" (counts, and a sample in detail)
    rows: int  # rows of bars
    requests: int  # requests in the timeline (a handoff's ids on P and D count once)
    sampled: int  # requests drawn in detail

    def describe(self) -> str:
        if self.mode == "detail":
            return f"{self.rows} lanes, all {self.requests} request(s) in detail"
        return (f"{self.requests} requests aggregated (blocks per state on each worker), {self.sampled} sampled "
                f"evenly over the run drawn in detail")


def render_png(timeline: Timeline, path: str | os.PathLike[str], *, title: str | None = None, max_rows: int = 40,
               sample: int = 16, tick: Tick = no_progress) -> Drawing:
    """Draw ``timeline`` to ``path``: in detail when it holds at most ``sample`` requests (lanes past ``max_rows``
    left out), else aggregated with ``sample`` requests in detail (a row per worker and request, all drawn).
    ``tick`` is advanced by one step in all."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    groups = request_groups(timeline)
    if len(groups) <= sample:
        fig, rows = _detail(plt, timeline, title, max_rows)
        drawing = Drawing("detail", rows, len(groups), len(groups))
    else:
        picked = sample_groups(groups, sample)
        fig, rows = _aggregate(plt, timeline, title, picked, len(groups))
        drawing = Drawing("aggregate", rows, len(groups), len(picked))
    tick("saving the PNG", 0.5)
    fig.savefig(path)
    plt.close(fig)
    tick(None, 0.5)
    return drawing


# --- bars ------------------------------------------------------------------------------------------------------


def _bars(ax: Any, boxes: list[tuple[float, float, float, float, str, str]], *, hatch: str | None = None,
          alpha: float = 1.0, linewidth: float = 0.3) -> None:
    """Rectangles ``(x, width, y centre, height, face colour, edge colour)`` as one collection."""
    from matplotlib.collections import PolyCollection

    if not boxes:
        return
    x, w, y, h = (np.array([b[i] for b in boxes], dtype=np.float64) for i in range(4))
    verts = np.stack([np.stack([x, y - h / 2], 1), np.stack([x + w, y - h / 2], 1),
                      np.stack([x + w, y + h / 2], 1), np.stack([x, y + h / 2], 1)], axis=1)
    ax.add_collection(PolyCollection(list(verts), facecolors=[b[4] for b in boxes], edgecolors=[b[5] for b in boxes],
                                     linewidths=linewidth, hatch=hatch, alpha=alpha))


def _draw_slices(ax: Any, timeline: Timeline, placed: list[tuple[Slice, float, float]], min_width: float, *,
                 edges: bool = True) -> None:
    """Each ``(slice, y, height)``: open ones hatched, released ones thin and pale; ``edges``: outlined in black
    (left out where bars may be narrower than their outline)."""
    plain: list[tuple[float, float, float, float, str, str]] = []
    hatched: list[tuple[float, float, float, float, str, str]] = []
    released: list[tuple[float, float, float, float, str, str]] = []
    for s, y, height in placed:
        start = (s.start - timeline.t0) * _MS
        width = max((s.end - s.start) * _MS, min_width)
        colour = STATE_COLOURS.get(s.category, "#bdbdbd")
        if s.category in RELEASED_STATES:
            released.append((start, width, y, height * 0.35, colour, colour))
        else:
            (hatched if s.open else plain).append((start, width, y, height, colour, "black" if edges else colour))
    _bars(ax, plain)
    _bars(ax, hatched, hatch="//")
    _bars(ax, released, alpha=0.6, linewidth=0)


def _arrow(ax: Any, start: tuple[float, float], end: tuple[float, float]) -> None:
    ax.annotate("", xy=end, xytext=start, arrowprops={"arrowstyle": "->", "color": _ARROW, "lw": 0.8, "alpha": 0.8})


def _finish(ax: Any, timeline: Timeline, used: set[str], *, arrows: bool) -> None:
    from matplotlib.patches import Patch

    lo, hi = timeline.view
    ax.set_xlim((lo - timeline.t0) * _MS, (lo - timeline.t0) * _MS + max((hi - lo) * _MS, 1e-6) * 1.01)
    ax.set_xlabel("milliseconds since the first event")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    handles = [Patch(color=c, label=_RELEASED_LABEL if name in RELEASED_STATES else name)
               for name, c in STATE_COLOURS.items() if name in used]
    if arrows:
        handles.append(Patch(color=_ARROW, label="grant → completion"))
    handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="open where the log ends"))
    ax.legend(handles=handles, fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)


# --- every request in detail -----------------------------------------------------------------------------------


def _detail(plt: Any, timeline: Timeline, title: str | None, max_rows: int) -> tuple[Any, int]:
    lanes: dict[tuple[str, str], set[int]] = {}
    for s in timeline.slices:
        lanes.setdefault((s.worker, s.track), set()).add(s.lane)
    rows = [(w, t, lane) for w in ordered_workers(timeline) for t in TRACKS for lane in sorted(lanes.get((w, t), ()))]
    rows = rows[:max_rows]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.32 * max(len(rows), 1)), dpi=110)
    lo, hi = timeline.view
    span_ms = max((hi - lo) * _MS, 1e-6)
    char_width = span_ms / 190  # a 6-point character in data units on a 12-inch axis, roughly
    placed = [(s, float(lane_y), 0.7) for s in timeline.slices
              if (lane_y := y_of.get((s.worker, s.track, s.lane))) is not None]
    _draw_slices(ax, timeline, placed, 0.002 * span_ms)
    for s, y, _height in placed:
        width = max((s.end - s.start) * _MS, 0.002 * span_ms)
        label = s.name if s.track == "blocks" else s.name.split(" ")[0]
        if s.track == "blocks" and len(label) * char_width > width:
            label = s.category.split("_")[0]  # the request is on the neighbouring slices; keep the state
        if len(label) * char_width <= width and s.category not in RELEASED_STATES:
            ax.text((s.start - timeline.t0) * _MS + width / 2, y, label, ha="center", va="center", fontsize=6,
                    clip_on=True, color="white" if s.category in _DARK else "black")
    for flow in timeline.flows:
        a = y_of.get((flow.source.worker, flow.source.track, flow.source.lane))
        b = y_of.get((flow.target.worker, flow.target.track, flow.target.lane))
        if a is not None and b is not None:
            _arrow(ax, ((flow.source.start - timeline.t0) * _MS, a), ((flow.target.end - timeline.t0) * _MS, b))
    for instant in timeline.instants:
        if not instant.name.startswith(("refused", "lease expired")):
            continue
        rows_of_worker = [y for (w, _t, _l), y in y_of.items() if w == instant.worker]
        if rows_of_worker:
            ax.plot((instant.ts - timeline.t0) * _MS, max(rows_of_worker) + 0.45, marker="v", color="#de2d26",
                    markersize=5)
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.set_yticks([y_of[row] for row in rows])
    ax.set_yticklabels([f"{w} · {t} {lane}" for w, t, lane in rows], fontsize=7)
    ax.set_title(title or "kvlifecycle handoff timeline", fontsize=10)
    _finish(ax, timeline, {s.category for s, _y, _h in placed}, arrows=bool(timeline.flows))
    fig.tight_layout()
    return fig, len(rows)


# --- many requests: counts, and a sample in detail -------------------------------------------------------------


def _aggregate(plt: Any, timeline: Timeline, title: str | None, picked: list[list[str]], total: int) -> tuple[Any, int]:
    workers = ordered_workers(timeline)
    wanted = {request for group in picked for request in group}
    by_row: dict[tuple[str, str], list[Slice]] = {}
    for s in timeline.slices:
        if s.request in wanted:
            by_row.setdefault((s.worker, s.request), []).append(s)
    rows = [(w, r) for group in picked for w in workers for r in group if (w, r) in by_row]
    heights = [1.5] * len(workers) + [0.8 + 0.22 * max(len(rows), 1)]
    fig, axes = plt.subplots(len(heights), 1, sharex=True, figsize=(12, 1.0 + sum(heights)), dpi=110,
                             gridspec_kw={"height_ratios": heights})
    used: set[str] = set()
    for ax, worker in zip(axes, workers, strict=False):
        used |= _counts(ax, timeline, worker)
    lo, hi = timeline.view
    axes[0].set_title(f"{title or 'kvlifecycle handoff timeline'}: {total} requests, too many to draw one by one; "
                      f"blocks per state on each worker, every request counted (mean over "
                      f"{(hi - lo) * _MS / BINS:.3g} ms bins)", fontsize=9)
    ax = axes[-1]
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    placed: list[tuple[Slice, float, float]] = []
    for (worker, request), y in y_of.items():
        for s in by_row[(worker, request)]:
            placed.append((s, float(y), 0.6) if s.track == "blocks" else (s, y - 0.38, 0.16))
    _draw_slices(ax, timeline, placed, 0.001 * max((hi - lo) * _MS, 1e-6), edges=False)
    used |= {s.category for s, _y, _h in placed}
    for flow in timeline.flows:
        a = y_of.get((flow.source.worker, flow.source.request))
        b = y_of.get((flow.target.worker, flow.target.request))
        if a is not None and b is not None:
            _arrow(ax, ((flow.source.start - timeline.t0) * _MS, a), ((flow.target.end - timeline.t0) * _MS, b))
    ax.set_ylim(-0.6, max(len(rows), 1) - 0.4)
    ax.set_yticks([y_of[row] for row in rows])
    ax.set_yticklabels([f"{w} · {r}" for w, r in rows], fontsize=7)
    ax.set_title(f"a sample: {len(picked)} of the {total} requests in detail, spread evenly over the run "
                 f"(blocks: thick bars; leases, loads and transfers: thin)", fontsize=9)
    _finish(ax, timeline, used, arrows=True)
    fig.tight_layout()
    return fig, len(rows)


def _counts(ax: Any, timeline: Timeline, worker: str) -> set[str]:
    """The worker's blocks per state, stacked, and its transfers in flight (leases on P, loads on D), each the mean
    over one of :data:`BINS` bins; the states drawn."""
    lo, hi = timeline.view
    edges, blocks = binned(step_counts(s for s in timeline.slices if s.worker == worker and s.track == "blocks"),
                           lo, hi, BINS)
    x = (edges - timeline.t0) * _MS
    below = np.zeros(len(x))
    drawn: set[str] = set()
    for state in sorted(blocks, key=lambda c: (_STACK_ORDER.index(c) if c in _STACK_ORDER else 99, c)):
        above = below + np.append(blocks[state], blocks[state][-1:])  # a step function's last value holds
        released = state in RELEASED_STATES
        ax.fill_between(x, below, above, step="post", color=STATE_COLOURS.get(state, "#bdbdbd"), linewidth=0,
                        alpha=0.6 if released else 1.0)
        below, drawn = above, drawn | {state}
    _, transfers = binned(step_counts((s for s in timeline.slices if s.worker == worker and s.track == "transfers"),
                                      "one"), lo, hi, BINS)
    if transfers:
        in_flight = np.sum(list(transfers.values()), axis=0)
        twin = ax.twinx()
        twin.step(x, np.append(in_flight, in_flight[-1:]), where="post", color="black", linewidth=0.7)
        twin.set_ylabel("transfers in flight", fontsize=6)
        twin.tick_params(labelsize=6)
        twin.set_ylim(bottom=0)
    ax.set_ylabel(f"{worker}\n({timeline.workers[worker]})\nblocks", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.set_ylim(bottom=0)
    return drawn
