"""Run the SGLang driver (``tests/sglang/sglang_driver.py``) in the SGLang venv from the main venv's pytest.

Every process gets its own session (so a stuck one is killed with its children), loopback-only UCX and SGLang
addresses, and a hard deadline. Nothing here asserts timings. The driver's processes are forks of one fork server
per test session (``zygote.py``), which imported SGLang once: a process costs a fork, not SGLang's 20-second
import.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = Path(os.environ.get("KVL_SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_PY = SGLANG_VENV / "bin" / "python"
DRIVER = "sglang_driver"



def require_sglang() -> Path:
    """Skip (or, with KVL_REQUIRE_ALL=1 as in CI, fail) when the SGLang venv is missing."""
    import pytest

    if SGLANG_PY.exists():
        return SGLANG_PY
    reason = f"SGLang venv missing ({SGLANG_VENV}); create it with scripts/setup-sglang-env.sh"
    if os.environ.get("KVL_REQUIRE_ALL") == "1":
        pytest.fail(reason + " [KVL_REQUIRE_ALL=1: not skipping]")
    pytest.skip(reason)


def free_port() -> int:
    """A port free on 127.0.0.1 whose neighbour (port + 1, the driver's nominal HTTP port) is free too."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free loopback port pair")


def base_env(log_dir: Path | None = None, **extra: str) -> dict[str, str]:
    """The SGLang processes' environment. ``KVL_TEST_PYTHONPATH`` (opt-in) goes first on their ``PYTHONPATH``:
    ``tests/sglang/worktree_site`` there makes them import this checkout instead of the one the SGLang venv's
    editable install is bound to (a worktree's run)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVL_SGLANG_")}
    env.update(UCX_TLS="self,sm,tcp", UCX_NET_DEVICES="lo", SGLANG_HOST_IP="127.0.0.1", HOST_IP="127.0.0.1",
               SGLANG_PLUGINS="kvlifecycle", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    if os.environ.get("KVL_TEST_PYTHONPATH"):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ["KVL_TEST_PYTHONPATH"],
                                                        os.environ.get("PYTHONPATH", "")) if p)
    if log_dir is not None:
        env["KVL_SGLANG_LOG_DIR"] = str(log_dir)
    env.update(extra)
    return env


class ZygoteChild:
    """A driver process forked by the session's fork server (``zygote.py``), waited on as a ``Popen`` is: its
    exit code arrives on the connection that asked for it."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        self.conn, self.pid = conn, pid
        self.returncode: int | None = None
        self._buffer = b""

    def _read_exit(self, timeout: float | None) -> int | None:
        self.conn.settimeout(timeout)
        try:
            while b"\n" not in self._buffer:
                chunk = self.conn.recv(64)
                if not chunk:  # the fork server is gone: so is the child's status
                    self.returncode = -signal.SIGKILL
                    return self.returncode
                self._buffer += chunk
        except (TimeoutError, BlockingIOError):
            return None
        self.returncode = int(self._buffer.split()[1])
        self.conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self.returncode if self.returncode is not None else self._read_exit(0.0)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        code = self._read_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(DRIVER, timeout or 0.0)
        return code


class Zygote:
    """The session's fork server in the SGLang venv (``zygote.py``): SGLang's modules are imported once, and every
    driver process is a fork of it, started with its own session, environment and log."""

    _instance: Zygote | None = None

    def __init__(self) -> None:
        import atexit
        import tempfile

        self.dir = Path(tempfile.mkdtemp(prefix="kvl-sglang-zygote-"))  # its socket, its log, the probes' logs
        self.probes = itertools.count()
        self.path = str(self.dir / "sock")
        self.log = self.dir / "zygote.log"
        with open(self.log, "wb") as fh:
            self.popen = subprocess.Popen([str(SGLANG_PY), str(Path(__file__).with_name("zygote.py")), self.path],
                                          cwd=str(ROOT), env=base_env(), stdout=fh, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        atexit.register(self.close)
        deadline = time.monotonic() + 300.0
        while not os.path.exists(self.path):
            if self.popen.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the SGLang fork server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)

    @classmethod
    def get(cls) -> Zygote:
        if cls._instance is None or cls._instance.popen.poll() is not None:
            cls._instance = cls()
        return cls._instance

    def fork(self, argv: list[str], env: dict[str, str], log: Path, script: Path | None = None) -> ZygoteChild:
        """The driver with ``argv`` (or ``script``, as ``python SCRIPT``) in a fork, its output in ``log``."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(30.0)
        conn.connect(self.path)
        request = {"argv": argv, "env": env, "cwd": str(ROOT), "log": str(log),
                   "script": None if script is None else str(script)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        line = b""
        while not line.endswith(b"\n"):
            chunk = conn.recv(1)
            if not chunk:
                raise RuntimeError(f"the SGLang fork server closed the request:\n{self.log.read_text()[-3000:]}")
            line += chunk
        return ZygoteChild(conn, int(line.split()[1]))

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | ZygoteChild
    out: Path
    log: Path

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            kill(self)
            tail = self.tail()
            raise AssertionError(f"{self.name} did not finish within {timeout:.0f} s; log tail:\n{tail}") from exc

    def result(self) -> dict:
        if not self.out.exists():
            raise AssertionError(f"{self.name} wrote no result; log tail:\n{self.tail()}")
        data = json.loads(self.out.read_text())
        if "error" in data:
            raise AssertionError(f"{self.name} failed: {data['error']}\n{data.get('traceback', '')}")
        return data

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        keep = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln]
        return "\n".join(keep[-n:])


def kill(proc: Proc) -> None:
    if proc.popen.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=30)


def spawn(name: str, work: Path, args: list[str], env: dict[str, str]) -> Proc:
    """``python tests/sglang/sglang_driver.py ARGS`` in the SGLang venv: a fork of the session's fork server
    (the same interpreter, SGLang's modules already imported), in its own session."""
    out = work / f"{name}.json"
    log = work / f"{name}.log"
    return Proc(name, Zygote.get().fork([*args, "--out", str(out)], env, log), out, log)


@dataclass
class PairRun:
    results: dict[str, dict] = field(default_factory=dict)
    log_dir: Path | None = None
    work: Path | None = None


def run_pair(work: Path, scenario: str, *, backend: str = "kvlifecycle", extra: list[str] | None = None,
             env_extra: dict[str, str] | None = None, timeout: float = 240.0,
             decode_extra: list[str] | None = None) -> PairRun:
    """Prefill and decode of one scenario, side by side; both results returned (``decode_extra``: decode only)."""
    require_sglang()
    port = free_port()
    log_dir = work / "logs"
    env = base_env(log_dir, **(env_extra or {}))
    common = ["--backend", backend, "--scenario", scenario, "--port", str(port), "--sync-dir", str(work),
              *(extra or [])]
    procs = [spawn("prefill", work, ["--role", "prefill", *common], env),
             spawn("decode", work, ["--role", "decode", *common, *(decode_extra or [])], env)]
    try:
        for p in procs:
            p.wait(timeout)
        return PairRun({p.name: p.result() for p in procs}, log_dir, work)
    finally:
        for p in procs:
            kill(p)


def run_restart(work: Path, *, timeout: float = 300.0, env_extra: dict[str, str] | None = None) -> PairRun:
    """Prefill #1 serves, then dies holding a bootstrapped room; prefill #2 comes back on the same bootstrap
    port with a new epoch; one decode throughout."""
    require_sglang()
    port = free_port()
    log_dir = work / "logs"
    env = base_env(log_dir, **(env_extra or {}))
    common = ["--scenario", "restart", "--port", str(port), "--sync-dir", str(work)]
    p1 = spawn("prefill1", work, ["--role", "prefill", "--generation", "1", *common], env)
    d = spawn("decode", work, ["--role", "decode", "--deadline", "200", *common], env)
    procs = [p1, d]
    try:
        p1.wait(timeout)
        p2 = spawn("prefill2", work, ["--role", "prefill", "--generation", "2", *common], env)
        procs.append(p2)
        d.wait(timeout)
        p2.wait(timeout)
        return PairRun({p.name: p.result() for p in procs}, log_dir, work)
    finally:
        for p in procs:
            kill(p)


def run_probe(script: Path, env_extra: dict[str, str], timeout: float = 240.0) -> dict:
    """Run a probe script in the SGLang venv (a fork of the fork server); it prints one JSON line last."""
    require_sglang()
    zygote = Zygote.get()
    log = zygote.dir / f"{script.stem}-{next(zygote.probes)}.log"
    child = zygote.fork([], base_env(None, **env_extra), log, script=script)
    proc = Proc(script.stem, child, log, log)
    returncode = proc.wait(timeout)
    output = log.read_text(errors="replace")
    lines = [ln for ln in output.splitlines() if ln.startswith("{")]
    if returncode != 0 or not lines:
        raise AssertionError(f"probe failed rc={returncode}\n{output[-6000:]}")
    return json.loads(lines[-1])


def run_tp(work: Path, scenario: str, *, p_tp: int, d_tp: int, extra: list[str] | None = None,
           env_extra: dict[str, str] | None = None, timeout: float = 300.0) -> PairRun:
    """A prefill of attention TP ``p_tp`` and a decode of ``d_tp``, one process per rank (``prefill0`` ...,
    ``decode0`` ...), every rank's result returned."""
    require_sglang()
    port = free_port()
    log_dir = work / "logs"
    env = base_env(log_dir, **(env_extra or {}))
    common = ["--scenario", scenario, "--port", str(port), "--sync-dir", str(work), *(extra or [])]
    procs = [spawn(f"prefill{r}", work, ["--role", "prefill", "--tp", str(p_tp), "--tp-rank", str(r),
                                         "--decode-tp", str(d_tp), *common], env) for r in range(p_tp)]
    procs += [spawn(f"decode{r}", work, ["--role", "decode", "--tp", str(d_tp), "--tp-rank", str(r), *common], env)
              for r in range(d_tp)]
    try:
        for p in procs:
            p.wait(timeout)
        return PairRun({p.name: p.result() for p in procs}, log_dir, work)
    finally:
        for p in procs:
            kill(p)
