"""docs/README.md, the newcomer's reading path, names only files and folders that exist: every path in backticks is
looked up from the repository root (its links are checked with every page's in ``tests/test_readme.py``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH_PAGE = ROOT / "docs" / "README.md"
# a backticked token that names a file or folder: a path with a slash, or a file name with a known suffix
PATH = re.compile(r"`([\w.\-/]+(?:/|\.py|\.md|\.sh|\.c))`")
# names the path gives relative to the package it is in (``transports/``'s modules, an adapter's files)
CONTEXTS = ("", "transports", "transports/cuda_ipc", "adapters/vllm", "adapters/sglang", "kvlifecycle/handoff",
            "kvlifecycle/tools", "kvlifecycle/sim", "docs")


def missing_paths(text: str) -> list[str]:
    """The paths in backticks that exist in none of the contexts a reading step speaks from."""
    return sorted({name for name in PATH.findall(text)
                   if not any((ROOT / context / name.rstrip("/")).exists() for context in CONTEXTS)})


def test_the_reading_path_names_only_files_that_exist() -> None:
    text = PATH_PAGE.read_text()
    assert len(PATH.findall(text)) > 40  # the page names its files: the check reads them
    assert missing_paths(text) == []


def test_the_reading_path_names_every_package_of_the_core() -> None:
    text = PATH_PAGE.read_text()
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "kvlifecycle").glob("*/__init__.py"))
    assert [p for p in packages if f"`{p}/" not in text] == []


def test_a_renamed_file_is_reported() -> None:
    assert missing_paths("read `kvlifecycle/handoff.py` then `kvlifecycle/ledger.py`") == ["kvlifecycle/handoff.py"]
