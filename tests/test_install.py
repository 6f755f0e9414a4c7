"""The README's install lines work: the wheel and the sdist built from this checkout install into fresh virtual
environments (from the machine's package index, no other network), and each documented set of extras enables
what the README says it does. Slow: each environment is built from nothing."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(argv: list[str], cwd: Path | None = None, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert done.returncode == 0, (argv, done.stdout[-2000:], done.stderr[-3000:])
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("dist")
    # what a release runs; --no-isolation builds with this venv's setuptools (no index needed for the backend)
    _run([sys.executable, "-m", "build", "--no-isolation", "--sdist", "--wheel", "--outdir", str(out), str(ROOT)])
    (wheel,) = out.glob("kvlifecycle-*.whl")
    (sdist,) = out.glob("kvlifecycle-*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def _venv(where: Path) -> Path:
    venv.EnvBuilder(with_pip=True, clear=True).create(where)
    return where / "bin"


def _readme_tour() -> str:
    text = (ROOT / "README.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.S)[0]


def test_the_base_install_runs_the_core(dist: dict[str, Path], tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "base")
    _run([str(bin_ / "pip"), "install", "-q", str(dist["wheel"])])
    assert _run([str(bin_ / "kvlifecycle"), "--version"]).stdout.startswith("kvlifecycle ")
    _run([str(bin_ / "python"), "-c", _readme_tour()])
    sim = json.loads(_run([str(bin_ / "kvlifecycle"), "sim", "--seeds", "2", "--json", "--out",
                           str(tmp_path / "sim")]).stdout)
    assert sim["violations"] == 0
    extras = {r["extra"]: r for r in json.loads(_run([str(bin_ / "kvlifecycle"), "doctor", "--extras",
                                                      "--json"]).stdout)["extras"]}
    assert not extras["transports"]["present"] and not extras["torch"]["present"]
    no_zmq = subprocess.run([str(bin_ / "python"), "-c", "import zmq"], capture_output=True, timeout=60)
    assert no_zmq.returncode != 0  # pyzmq only with the extras that use it
    demo = subprocess.run([str(bin_ / "kvlifecycle"), "demo"], capture_output=True, text=True, timeout=120)
    assert demo.returncode == 2 and "pip install 'kvlifecycle[transports]'" in demo.stderr


def test_the_sdist_installs(dist: dict[str, Path], tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "sdist")
    _run([str(bin_ / "pip"), "install", "-q", str(dist["sdist"])])
    assert _run([str(bin_ / "kvlifecycle"), "--version"]).stdout.startswith("kvlifecycle ")


def test_transports_and_torch_run_the_demo_and_testing_brings_the_suite(dist: dict[str, Path],
                                                                         tmp_path: Path) -> None:
    bin_ = _venv(tmp_path / "full")
    # the README: install the torch build first (here the CPU wheel on this machine's disk), then the extras
    _run([str(bin_ / "pip"), "install", "-q", "torch==2.13.0+cpu"])
    _run([str(bin_ / "pip"), "install", "-q", f"{dist['wheel']}[transports,torch,testing]"])
    demo = _run([str(bin_ / "kvlifecycle"), "demo", "--requests", "1", "--out", str(tmp_path / "demo")], timeout=600)
    assert "demo OK" in demo.stdout
    _run([str(bin_ / "kvlifecycle"), "replay", str(tmp_path / "demo"), "--check"])
    _run([str(bin_ / "python"), "-c", "import kvlifecycle.testing.transport_conformance"])


def test_twine_accepts_the_wheel_and_the_sdist(dist: dict[str, Path]) -> None:
    """The metadata PyPI renders (the README as the long description, classifiers, URLs) passes ``twine check``."""
    done = _run([sys.executable, "-m", "twine", "check", "--strict", str(dist["wheel"]), str(dist["sdist"])])
    assert done.stdout.count("PASSED") == 2, done.stdout
