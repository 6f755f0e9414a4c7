"""Terminal output of the debugging views: rich tables and colour on a terminal, plain aligned text everywhere
else (a pipe, a file, a test), both drawn from the same views ``--json`` prints (:mod:`kvlifecycle.story`,
:mod:`kvlifecycle.explain`)."""

from __future__ import annotations

import datetime as dt
import sys
from collections.abc import Sequence
from typing import Any, TextIO

STEP_COLUMNS = ("time", "worker", "request", "event", "blocks", "state", "token", "lease", "note")

# event styles on a terminal
_STYLES = {
    "refused": "bold red",
    "load failed": "red",
    "release": "yellow",
    "cancel": "magenta",
    "cancel deferred": "magenta",
    "abort": "magenta",
    "finish": "green",
    "part done": "green",
    "free": "cyan",
    "cache": "cyan",
    "peer epoch": "blue",
}


def iso(wall: float) -> str:
    return dt.datetime.fromtimestamp(wall, tz=dt.timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def span(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if abs(seconds) < 1 else f"{seconds:.3f} s"


def _transition(t: dict[str, str], with_blocks: bool) -> str:
    change = f"{t['before']} (unchanged)" if t["before"] == t["after"] else f"{t['before']} → {t['after']}"
    return f"{t['blocks']}: {change}" if with_blocks else change


def step_row(v: dict[str, Any]) -> tuple[str, ...]:
    """One story line: time, worker, request, event, blocks, each block's state before → after, the token
    (transfer, generation, epoch), the lease deadline, and the reason or detail."""
    transitions = v["transitions"]
    states = "; ".join(_transition(t, len(transitions) > 1) for t in transitions)
    token = " ".join(x for x in (v["transfer"], f"gen {v['generation']}" if v["generation"] else "",
                                 f"epoch {v['epoch']}" if v["epoch"] else "") if x)
    left = v["lease_left_s"]
    if left is None:
        lease = ""
    else:
        lease = f"until +{v['lease_deadline_ms']:.3f} ms " + (f"({span(left)} left)" if left >= 0
                                                              else f"(expired {span(-left)} ago)")
    note = ": ".join(x for x in (v["reason"], v["detail"]) if x)
    event = v["event"] + (" (after restart)" if v["after_restart"] else "")
    return (f"+{v['t_ms']:.3f} ms", v["worker"], v["request"], event, v["blocks"], states, token, lease, note)


class Output:
    """Where the views go: ``rich`` decides on a terminal; anything else gets plain lines (no colour, no box
    drawing, no wrapping), so that ``grep`` and tests see exactly the text."""

    def __init__(self, file: TextIO | None = None, *, force_terminal: bool | None = None) -> None:
        self.file = file if file is not None else sys.stdout
        terminal = self.file.isatty() if force_terminal is None else force_terminal
        self.console: Any = None
        if terminal:
            from rich.console import Console

            self.console = Console(file=self.file, force_terminal=True, highlight=False)

    def line(self, text: str = "", style: str | None = None) -> None:
        if self.console is not None:
            from rich.text import Text

            self.console.print(Text(text, style=style or ""))
        else:
            self.file.write(text + "\n")

    def table(self, columns: Sequence[str], rows: Sequence[Sequence[str]], *, indent: int = 2,
              event_column: int | None = 3) -> None:
        """Rows under a header; columns empty in every row are left out."""
        keep = [i for i in range(len(columns)) if any(row[i] for row in rows)]
        if not rows:
            return
        if self.console is not None:
            from rich import box
            from rich.padding import Padding
            from rich.table import Table

            table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
            for i in keep:
                table.add_column(columns[i], no_wrap=True)
            for row in rows:
                label = row[event_column] if event_column is not None else ""
                style = _STYLES.get(label.split(" (")[0]) or _STYLES.get(label.split(" ")[0], "")
                table.add_row(*(row[i] for i in keep), style=style or None)
            # never truncate a cell: a row wider than the terminal wraps, as a long log line would
            needed = indent + sum(max(len(columns[i]), *(len(row[i]) for row in rows)) + 3 for i in keep)
            width = self.console.width
            self.console.width = max(width, needed)
            try:
                self.console.print(Padding(table, (0, 0, 0, indent)))
            finally:
                self.console.width = width
            return
        widths = {i: max(len(columns[i]), *(len(row[i]) for row in rows)) for i in keep}
        pad = " " * indent
        for row in [tuple(columns), *rows]:
            self.file.write(pad + "  ".join(row[i].ljust(widths[i]) for i in keep).rstrip() + "\n")


def stdout_closed() -> int:
    """The reader of our output went away (``| head``): stop quietly, as a Unix filter does. Later writes (the
    interpreter's flush at exit) go to /dev/null instead of raising again."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a file (captured): nothing to redirect
        pass
    return 0
