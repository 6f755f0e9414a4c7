"""The fused copy's memory order in the machine code a GPU runs, checked without a GPU: the wide kernels compiled for
an H100 by Triton (in the vLLM venv), read back with ``cuobjdump``. With ``LOADS_FIRST`` (the default) every load of
a program's tile is issued before its first store, so a tile is one memory round trip; stored step by step (the
mutant: the kernels of before) the compiler keeps each step's stores ahead of the next step's loads, because the
source and the destination are addressed from one anchor and may alias, and a tile is four round trips."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from test_digest_kernels_interpreted import REPO_ROOT, TRITON_PYTHON, require_triton_python

RUNNER = Path(__file__).with_name("digest_kernels_compiled.py")


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    require_triton_python()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([str(TRITON_PYTHON), str(RUNNER)], env=env, capture_output=True, text=True, timeout=600,
                         cwd=REPO_ROOT, check=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def _round_trips(tile: list[str]) -> int:
    """Runs of loads the program waits on in turn: a store between two loads ends a run."""
    return len("".join(tile).replace("S", " ").split())


@pytest.mark.parametrize("kernel", ["one_launch", "one_launch_inline", "rows_wide"])
def test_a_tiles_loads_are_all_issued_before_its_first_store(compiled: dict[str, Any], kernel: str) -> None:
    code = compiled[f"{kernel} loads_first=True"]
    tile = code["tile"]
    loads = tile.count("L")
    assert loads >= 4 and tile.count("S") == loads, tile  # every word read is written (the fused copy)
    assert tile == ["L"] * loads + ["S"] * loads, tile
    assert code["local_bytes"] == 0  # no spills


@pytest.mark.parametrize("kernel", ["one_launch", "one_launch_inline", "rows_wide"])
def test_the_mutant_storing_step_by_step_is_four_round_trips(compiled: dict[str, Any], kernel: str) -> None:
    first, stepwise = compiled[f"{kernel} loads_first=True"]["tile"], compiled[f"{kernel} loads_first=False"]["tile"]
    assert sorted(stepwise) == sorted(first)  # the same accesses, in another order
    assert _round_trips(first) == 1
    assert _round_trips(stepwise) == 4, stepwise
