"""Modules of adapters/vllm loaded without the package's ``__init__`` (which imports vLLM), for the main venv.

The modules are imported as submodules of a stand-in package whose path is adapters/vllm, so a relative import
between them (config.py's ``from .nixl_migration import ...``) resolves to the sibling file, as it does in the
installed package, while ``__init__`` never runs.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "vllm"
PACKAGE = "kvl_vllm_adapter_without_init"


def load_vllm_adapter_module(name: str) -> types.ModuleType:
    """adapters/vllm/<name>.py, imported once per process (later calls return the same module)."""
    if PACKAGE not in sys.modules:
        package = types.ModuleType(PACKAGE)
        package.__path__ = [str(ADAPTER)]
        sys.modules[PACKAGE] = package
    return importlib.import_module(f"{PACKAGE}.{name}")
