"""Make an SGLang-venv process import kvlifecycle from the checkout this file sits in.

The SGLang venv holds kvlifecycle as an editable install bound to one checkout (its
``__editable___kvlifecycle_*_finder.py``). A test run from another checkout (a worktree) puts this directory on
``PYTHONPATH`` (``KVL_TEST_PYTHONPATH``, read by ``sglang_harness.base_env``): ``site`` imports this module after
the venv's ``.pth`` files, and the finder below goes first in ``sys.meta_path``, so ``kvlifecycle``,
``kvlifecycle.adapters`` and ``kvlifecycle.transports`` resolve here. Same finder logic as setuptools' editable one.
"""

from __future__ import annotations

import sys
from importlib.machinery import ModuleSpec, PathFinder
from importlib.machinery import all_suffixes as module_suffixes
from importlib.util import spec_from_file_location
from itertools import chain
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MAPPING: dict[str, str] = {
    "kvlifecycle": str(ROOT / "kvlifecycle"),
    "kvlifecycle.adapters": str(ROOT / "adapters"),
    "kvlifecycle.transports": str(ROOT / "transports"),
}


class _CheckoutFinder:  # MetaPathFinder
    @classmethod
    def find_spec(cls, fullname: str, path: object = None, target: object = None) -> ModuleSpec | None:
        if fullname in MAPPING:
            candidate = Path(MAPPING[fullname])
            init = candidate / "__init__.py"
            for found in chain([init], (candidate.with_suffix(x) for x in module_suffixes())):
                if found.exists():
                    return spec_from_file_location(fullname, found)
            return None
        parent, _, _child = fullname.rpartition(".")
        if parent and parent in MAPPING:
            return PathFinder.find_spec(fullname, path=[MAPPING[parent]])
        return None


if _CheckoutFinder not in sys.meta_path:
    sys.meta_path.insert(0, _CheckoutFinder)
