"""Edits of a real event history for the log fuzzers: events dropped, repeated, swapped, or a field changed (under
valid checksums, so the edits reach the fold, where an impossible step must be a typed error)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvlifecycle import events as ev


def edited_history(events: list[ev.Event], data: st.DataObject,
                   values: dict[type, st.SearchStrategy[Any]]) -> list[ev.Event]:
    """One to three edits of ``events`` (a copy); ``values`` draws a changed field's new value by its type."""
    events = list(events)
    for _ in range(data.draw(st.integers(1, 3))):
        if not events:
            break
        i = data.draw(st.integers(0, len(events) - 1))
        kind = data.draw(st.sampled_from(["drop", "repeat", "swap", "field"]))
        if kind == "drop":
            del events[i]
        elif kind == "repeat":
            events.insert(data.draw(st.integers(0, len(events))), events[i])
        elif kind == "swap":
            j = data.draw(st.integers(0, len(events) - 1))
            events[i], events[j] = events[j], events[i]
        else:
            event = events[i]
            name = data.draw(st.sampled_from([f for f in event.__struct_fields__ if f not in ("hlc", "at")]))
            events[i] = msgspec.structs.replace(event, **{name: data.draw(values[type(getattr(event, name))])})
    return events
