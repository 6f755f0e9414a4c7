"""What a timeline is made of: slices on lanes, instants, grant → completion flows, and the colours they are drawn in.

Every other module of the package reads or writes these values; none keeps state of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

TRACKS = ("blocks", "transfers", "data plane", "host pool")

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

# Block states whose blocks no transfer holds any more: P's lease ended and the engine frees or caches the blocks
# when it likes (vLLM and SGLang free lazily, the demo at its end). A slice in one of them that is still open where
# the log ends is drawn as released, never as a leak.
RELEASED_STATES = frozenset({"RELEASABLE"})


class Tick(Protocol):
    """Progress callback (``kvlifecycle.tools.progress.Ticker`` is one): ``steps`` more of the bar are done."""

    def __call__(self, note: str | None = None, steps: float = 1) -> None: ...


def no_progress(note: str | None = None, steps: float = 1) -> None:
    """A :class:`Tick` that does nothing."""


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
    open: bool = False  # still open when the log ended (or where the window cut it)
    request: str = ""  # the worker's own id of the request the slice belongs to ("" for none)
    blocks: int = 0  # on the blocks track: how many blocks the request's group holds


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
    t0: float  # wall-clock seconds of the trace's zero: the earliest event of the logs (or slice, if earlier)
    t_end: float
    first_event: float = 0.0  # wall-clock seconds of the first event of all the logs (``+N ms`` counts from it)
    start: float = 0.0  # wall-clock seconds of the earliest thing drawn (later than t0 once requests are picked)
    window: tuple[float, float] | None = None  # the --since/--until window the timeline was cut to
    requests: tuple[str, ...] = ()  # the --request ids it was cut to (with the ids linked to them)

    @property
    def view(self) -> tuple[float, float]:
        """The wall-clock span to draw: the window, or the whole timeline."""
        return self.window if self.window is not None else (self.start, self.t_end)


def ordered_workers(timeline: Timeline) -> list[str]:
    """P workers first, then D (and host pools), each by name: the order of the trace's processes and the PNG's rows."""
    return sorted(timeline.workers, key=lambda w: (timeline.workers[w] != "source", w))
