"""The mypy configuration keeps the core strict: only the tools and the mapped packages are merely "checked", and
the modules whose imports go unchecked are the ones that ship no types here, and no module has its errors ignored.

The type check itself runs in scripts/test.sh (scripts/typecheck.sh), not here: its first run analyses torch."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the check is the same on every version

ROOT = Path(__file__).resolve().parents[1]
# the parts of the package that are not the core (as tests/test_layering.py names them)
NOT_CORE = {"kvlifecycle.cli.*", "kvlifecycle.tools.*", "kvlifecycle.transports.*", "kvlifecycle.adapters.*"}


def _mypy() -> dict[str, Any]:
    config: dict[str, Any] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    return config


def _overrides_setting(key: str) -> list[list[str]]:
    return [o["module"] for o in _mypy().get("overrides", []) if key in o]


def test_strict_is_the_default_and_the_checked_set_is_exactly_the_non_core() -> None:
    config = _mypy()
    assert config["strict"] is True
    relaxed = _overrides_setting("disallow_untyped_defs")
    assert len(relaxed) == 1 and set(relaxed[0]) == NOT_CORE


def test_no_module_has_its_errors_ignored() -> None:
    """Every module is type-checked and its errors reported: no override (and not the defaults) sets
    ``ignore_errors``, so "checked" is the weakest level anything gets."""
    config = _mypy()
    assert "ignore_errors" not in config
    assert _overrides_setting("ignore_errors") == []
    assert "ignore_errors" not in (ROOT / "pyproject.toml").read_text()


def test_checked_still_checks_function_bodies_and_unused_ignores() -> None:
    """ "Checked" turns off what strict demands of annotations, never the checking itself."""
    for override in _mypy()["overrides"]:
        for kept in ("check_untyped_defs", "warn_unused_ignores", "strict_equality"):
            assert override.get(kept, True) is True, (override["module"], kept)


def test_unchecked_imports_are_modules_without_types_here() -> None:
    """Each module whose missing types are ignored is either not installed here or installed without a
    ``py.typed`` marker; a typed package must not hide behind the override."""
    (modules,) = _overrides_setting("ignore_missing_imports")
    for name in {m.removesuffix(".*") for m in modules}:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue  # not installed (the engines, triton), or a single-file module
        typed = any((Path(p) / "py.typed").exists() for p in spec.submodule_search_locations)
        assert not typed, f"{name} ships py.typed: drop it from ignore_missing_imports"
