"""Run a child Python as if some packages were not installed: a ``sitecustomize`` on its ``PYTHONPATH`` hides them
from the import system (``import nixl`` raises ``ModuleNotFoundError``), in that process and in its children."""

from __future__ import annotations

import os
from pathlib import Path

_SITECUSTOMIZE = '''
import sys

HIDDEN = {hidden!r}


class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None


sys.meta_path.insert(0, _Hide())
'''


def env_hiding(directory: Path, *packages: str) -> dict[str, str]:
    """An environment for ``subprocess`` in which ``packages`` (top-level names) cannot be imported."""
    (directory / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(hidden=sorted(packages)))
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))}
