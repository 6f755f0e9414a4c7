"""``kvlifecycle demo`` runs any size it accepts (it frees what was released and reuses its pools) or refuses its
arguments in one line."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvlifecycle.tools import demo


def _args(tmp_path: Path, **over: int) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(["--out", str(tmp_path / "logs")])
    for name, value in over.items():
        setattr(args, name, value)
    return args


@pytest.mark.nixl
@pytest.mark.slow
def test_more_requests_than_the_pool_holds_run_through_by_reusing_freed_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")
    # 20 requests of 2 blocks through a pool of 8: every block is reused; main used to die at the ninth request
    code = demo.run(_args(tmp_path, requests=10, regions=2, blocks=8, block_bytes=512))
    out = capsys.readouterr().out
    assert code == 0, out
    assert "demo OK: 20 requests (10 pull, 10 push)" in out
    assert "'granted': 20" in out and "'completed': 20" in out and "'loaded': 20" in out
    assert "VIOLATION" not in out


@pytest.mark.parametrize(
    ("over", "why"),
    [
        ({"requests": 0}, "--requests must be at least 1, got 0"),
        ({"blocks": -3}, "--blocks must be at least 1, got -3"),
        ({"block_bytes": 0}, "--block-bytes must be at least 1"),
        ({"regions": 64, "blocks": 1 << 16, "block_bytes": 1 << 20}, "GiB per side, more than the demo's 4 GiB"),
    ],
)
def test_arguments_it_cannot_run_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], over: dict[str, int], why: str
) -> None:
    assert demo.run(_args(tmp_path, **over)) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "logs").exists()  # refused before any process or log was made
