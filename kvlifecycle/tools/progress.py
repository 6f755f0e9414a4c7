"""Progress of the long-running verbs on a terminal, through rich; silence everywhere else.

A verb wraps its run in :func:`progress` and calls the :class:`Ticker` it yields once per step::

    with progress("bench lifecycle", total=rounds, json_output=args.json) as tick:
        ...; tick("round 1 done")

The bar is drawn on stderr only when stdout and stderr are both terminals and the verb was not asked for
``--json``: a pipe, a log file, a test or a JSON consumer sees the verb's own output alone, byte for byte. It is
transient (gone once the verb prints its table) and redraws only when a step ends: rich's refresh thread would wake
ten times a second and take the GIL, and CPU time, inside the regions the benchmarks time. Where rich cannot be
imported (an engine's virtual environment made before it became a dependency) the verbs run silent.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any


class Ticker:
    """Advances a bar by ``steps``; ``note`` (the step just done) shows beside the description. A ticker made with
    no bar does nothing, so code that ticks needs no test of whether a bar is shown."""

    def __init__(self, bar: Any = None, task: Any = None, description: str = "") -> None:
        self._bar, self._task, self.description = bar, task, description

    def __call__(self, note: str | None = None, steps: float = 1) -> None:
        if self._bar is None:
            return
        description = f"{self.description}: {note}" if note else self.description
        self._bar.update(self._task, advance=steps, description=description)
        self._bar.refresh()


SILENT = Ticker()


def on_terminal(json_output: bool = False) -> bool:
    """Whether a bar is drawn: a person at a terminal, who did not ask for JSON."""
    return not json_output and sys.stdout.isatty() and sys.stderr.isatty()


@contextlib.contextmanager
def progress(description: str, total: float | None, *, json_output: bool = False) -> Iterator[Ticker]:
    """A bar of ``total`` steps (``None``: unknown) on stderr while the block runs, or a silent ticker."""
    if not on_terminal(json_output):
        yield SILENT
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield SILENT
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=sys.stderr), auto_refresh=False, transient=True) as bar:
        task = bar.add_task(description, total=total)
        bar.refresh()
        yield Ticker(bar, task, description)
