"""``bench/digest_ablation.py``, the fused copy + digest cut into stages and its persistent variant, runs under
Triton's interpreter on the CPU: the full variants' digests equal the host contract and the bytes are moved, also
where a persistent program walks several leaves; a persistent kernel that runs the next leaf's chain instead of its
own is caught."""

from __future__ import annotations

from pathlib import Path

from test_digest_kernels_interpreted import REPO_ROOT, _run

ABLATION = REPO_ROOT / "bench" / "digest_ablation.py"


def test_the_ablation_variants_interpreted_equal_the_host_contract() -> None:
    out = _run(str(ABLATION))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    verdicts = [line.split()[-1] for line in out.stdout.splitlines() if "exact" in line]
    assert verdicts == ["True"] * 4, out.stdout  # production, stage 3, persistent grids of 2 and 3 programs


def test_a_persistent_kernel_chaining_the_wrong_leaf_is_caught(tmp_path: Path) -> None:
    source = ABLATION.read_text()
    own = "adds_ptr + this_leaf * NROWS * 8"
    assert source.count(own) == 1
    mutant = tmp_path / "digest_ablation.py"
    mutant.write_text(source.replace(own, "adds_ptr + tl.minimum(leaf, leaves - 1) * NROWS * 8"))
    out = _run(str(mutant))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    verdicts = {line[2:22].strip(): line.split()[-1] for line in out.stdout.splitlines() if "exact" in line}
    assert verdicts == {"production": "True", "stage 3 4w": "True", "persist 2/SM 4w": "False",
                        "persist 3/SM 4w": "False"}, out.stdout
