"""Start and drive real ``vllm serve`` processes and the kvlifecycle proxy on 127.0.0.1 (stdlib only).

Shared by the end-to-end tests (tests/vllm/) and the benchmark (bench/vllm_pd.py). Every wait is bounded; every
process is started in its own session so that stopping it stops its engine and worker children too.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("KVL_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_CLI = VLLM_VENV / "bin" / "vllm"
MODEL_NAME = "tiny"
HOST = "127.0.0.1"
WARM_UP_LENGTHS = (5, 40)  # two lengths: the static compile, then the dynamic-shape one
WARM_UP_OFFSET = 4089  # prompt_of_length offsets of the tests stay clear of this first word


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def free_port_pair() -> int:
    """A port p with p+1 also free (vLLM's side channel uses base + DP rank)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as sock:
            try:
                sock.bind((HOST, port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair on 127.0.0.1")


def build_tiny_model(cache_dir: Path, timeout_s: float = 300.0, overrides: dict | None = None) -> Path:
    """Build (or reuse) the tiny random Llama inside the vLLM venv; returns its directory. ``overrides``: recipe
    values to change (a benchmark's model shape)."""
    out = subprocess.run(
        [str(VLLM_PYTHON), str(Path(__file__).with_name("tiny_model.py")), str(cache_dir),
         *([json.dumps(overrides)] if overrides else [])],
        check=True, capture_output=True, text=True, timeout=timeout_s,
    )
    return Path(out.stdout.strip().splitlines()[-1])


def prompt_of_length(num_tokens: int, offset: int = 0) -> str:
    """Same words as tiny_model.prompt_of_length (kept here so the harness needs no torch)."""
    words = 4096 - 4 - 2
    return " ".join(f"w{(offset + 7 * i) % words}" for i in range(num_tokens))


def base_env(cores: Sequence[int] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_HOST_IP=HOST,
        VLLM_NIXL_SIDE_CHANNEL_HOST=HOST,
        UCX_TLS=env.get("UCX_TLS", "self,sm,tcp"),
        UCX_NET_DEVICES=env.get("UCX_NET_DEVICES", "lo"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    else:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "all")
    env.pop("VIRTUAL_ENV", None)
    return env


@dataclass
class ManagedProcess:
    """A child process in its own process group; ``stop()`` ends the whole group (SIGTERM, then SIGKILL).

    A process group, not a session: a new session is a new scheduler autogroup on Linux, and with P's and D's
    servers each in an autogroup of its own, sharing the two cores, the kernel's fair scheduler let one server's
    workers (which spin on ``sched_yield`` for a second after every step, and a D engine steps every millisecond
    while a KV load is pending) take a core whole: the other server's runnable processes got no CPU for 40-60 s
    (sampled from ``/proc`` at real-time priority), and a handoff that needed them missed its 30 s bounds.
    In one group the yield gives the core away (docs/vllm.md, "Shared cores")."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cores: Sequence[int] | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        started_processes.append(self)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = list(self.argv)
        if self.cores:
            argv = ["taskset", "-c", ",".join(map(str, self.cores)), *argv]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         process_group=0, cwd=REPO_ROOT)
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # the group we created for this child: its engine and workers

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crash, as seen by its peers)."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=30)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        self._signal_group(signal.SIGKILL)  # leftovers of the group (engine core, workers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


# every process started this session, for the failure digest below
started_processes: list[ManagedProcess] = []
# what a failed handoff leaves in a server's log: the connector's and the proxy's warnings and errors, vLLM's
# request failures, tracebacks
_DIGEST_LINE = re.compile(r"(WARNING|ERROR).*\[(worker|handoff|nixl|untrusted|producer|scheduler|sidechannel|"
                          r"consumer|streaming)\.py|kvlifecycle\.\w+ (WARNING|ERROR)|serving\.py.*failed|Traceback")


def failure_digest(since: float, max_lines: int = 40) -> str:
    """The connector's warnings and errors, from the log of every process started this session whose log was
    written since ``since`` (epoch seconds), each line prefixed with its process's name; the last ``max_lines``."""
    lines: list[str] = []
    for proc in started_processes:
        try:
            if proc.log_path.stat().st_mtime < since:
                continue
            text = proc.log_path.read_text(errors="replace")
        except OSError:
            continue
        lines += [f"{proc.name}: {line}" for line in text.splitlines() if _DIGEST_LINE.search(line)]
    return "\n".join(lines[-max_lines:])


@dataclass
class VLLMServer(ManagedProcess):
    port: int = 0
    engine: bool = False  # a ``vllm serve`` (warmed up by ``start_all``), not the proxy

    def warm_up(self, timeout_s: float = 300.0) -> None:
        """Two plain completions of different lengths, before any handoff.

        vLLM 0.32 compiles ``VocabParallelEmbedding.forward`` with torch.compile on a server's first forward even
        under ``--enforce-eager`` (py-spy: ``compile_fx`` under ``LlamaModel.embed_input_ids``), and once more at
        the second distinct prompt length (dynamo's automatic dynamic shapes). On the loaded 2-core machine each
        compile took 20-30 s; inside a handoff it ran while P held the lease and both engines stepped without pause
        (vLLM steps every 1 ms while a KV transfer is pending, and each worker spins ``sched_yield`` for 1 s after
        every step), which is how D's connector threads missed their 30 s bounds and the EngineCore logged "No
        available shared memory broadcast block found in 60 seconds". Plain requests carry no
        ``kv_transfer_params``, so the connector ignores them; the prompts start with a word no test prompt starts
        with (no prefix-cache hit on them)."""
        for num_tokens in WARM_UP_LENGTHS:
            status, body = post_json(self.port, "/v1/completions",
                                     completion_body(prompt_of_length(num_tokens, offset=WARM_UP_OFFSET), 2),
                                     timeout_s=timeout_s)
            if status != 200:
                raise RuntimeError(f"{self.name}: warm-up answered {status}: {body}\n{self.log_tail()}")

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive:
                raise RuntimeError(f"{self.name} exited while starting:\n{self.log_tail()}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = http_get(self.port, "/health", timeout_s=2.0)
                if status == 200:
                    return
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")


def vllm_server(name: str, model_dir: Path, port: int, log_dir: Path, *, kv_transfer_config: dict | None = None,
                cores: Sequence[int] | None = None, side_channel_port: int | None = None,
                block_size: int | None = None, extra_env: dict[str, str] | None = None,
                extra_args: Sequence[str] = (), log_stats: bool = False) -> VLLMServer:
    """``log_stats``: keep vLLM's stats on (its ``/metrics`` then carries the KV connector's statistics)."""
    env = base_env(cores)
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
    env.update(extra_env or {})
    argv = [
        str(VLLM_CLI), "serve", str(model_dir), "--host", HOST, "--port", str(port),
        "--served-model-name", MODEL_NAME, "--dtype", "float32", "--max-model-len", "2048",
        "--enforce-eager", "--seed", "0", *extra_args,
    ]
    if not log_stats:
        argv.append("--disable-log-stats")
    if block_size is not None:
        argv += ["--block-size", str(block_size)]
    if kv_transfer_config is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return VLLMServer(name=name, argv=argv, env=env, log_path=log_dir / f"{name}.log", cores=cores, port=port,
                      engine=True)


def proxy_process(port: int, prefill: Sequence[str], decode: Sequence[str], log_dir: Path,
                  python: str | None = None, extra_args: Sequence[str] = ()) -> VLLMServer:
    argv = [python or sys.executable, "-m", "kvlifecycle", "proxy", "--port", str(port),
            "--prefill", *prefill, "--decode", *decode, *extra_args]
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return VLLMServer(name="proxy", argv=argv, env=env, log_path=log_dir / "proxy.log", port=port)


# -- HTTP ------------------------------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(port: int, path: str, body: dict, timeout_s: float = 120.0,
              headers: dict[str, str] | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        try:
            return resp.status, json.loads(raw)
        except json.JSONDecodeError:
            return resp.status, {"raw": raw.decode(errors="replace")}
    finally:
        conn.close()


def completion_body(prompt: str | list[str], max_tokens: int, **extra: object) -> dict:
    body: dict = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                  "ignore_eos": True}
    body.update(extra)
    return body


@dataclass(frozen=True, slots=True)
class StreamResult:
    text: str
    ttft_s: float
    e2e_s: float
    status: int


def iter_sse(resp: http.client.HTTPResponse) -> Iterator[dict]:
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def stream_completion(port: int, prompt: str, max_tokens: int, timeout_s: float = 300.0,
                      path: str = "/v1/completions", request_id: str | None = None) -> StreamResult:
    """Stream one greedy completion; TTFT is the time to the first SSE event that carries text. ``request_id``
    goes out as ``X-Request-Id`` (the proxy passes it on; vLLM's request id then contains it)."""
    body = completion_body(prompt, max_tokens, stream=True)
    if path.endswith("chat/completions"):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    ttft = None
    parts: list[str] = []
    try:
        headers = {"Content-Type": "application/json"}
        if request_id:
            headers["X-Request-Id"] = request_id
        conn.request("POST", path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return StreamResult(resp.read().decode(errors="replace"), float("nan"), time.perf_counter() - start,
                                resp.status)
        for event in iter_sse(resp):
            for choice in event.get("choices", []):
                piece = choice.get("text")
                if piece is None:
                    piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    parts.append(piece)
        return StreamResult("".join(parts), ttft if ttft is not None else float("nan"),
                            time.perf_counter() - start, resp.status)
    finally:
        conn.close()


def process_cpu_seconds(root_pid: int) -> float:
    """User+system CPU seconds of a process and all its descendants (from /proc; Linux only)."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rfind(")") + 2:].split()
        pid, ppid = int(entry), int(fields[1])
        children.setdefault(ppid, []).append(pid)
        stats[pid] = (int(fields[11]) + int(fields[12])) / tick
    total, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        total += stats.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


# -- test support -------------------------------------------------------------------------------------------------

MODEL_CACHE = Path(os.environ.get("KVL_MODEL_CACHE", Path.home() / ".cache" / "kvlifecycle" / "models"))


def require_vllm() -> None:
    """Skip (or, with KVL_REQUIRE_ALL=1 as in CI, fail) when the vLLM venv is missing."""
    import pytest

    if VLLM_CLI.exists() and VLLM_PYTHON.exists():
        return
    reason = (f"vLLM venv missing ({VLLM_VENV}); create it with scripts/setup-vllm-env.sh")
    if os.environ.get("KVL_REQUIRE_ALL") == "1":
        pytest.fail(reason + " [KVL_REQUIRE_ALL=1: not skipping]")
    pytest.skip(reason)


def start_all(servers: Iterable[ManagedProcess], timeout_s: float = 420.0, warm_up: bool = True) -> None:
    """Start every server at once (start-up is the slow part), then wait for each, bounded overall; then warm up
    every vLLM server (``VLLMServer.warm_up``: its lazy compiles happen here, not inside a test's handoff)."""
    servers = list(servers)
    for server in servers:
        server.start()
    deadline = time.monotonic() + timeout_s
    for server in servers:
        left = max(deadline - time.monotonic(), 1.0)
        server.wait_ready(left)
    if warm_up:
        for server in servers:
            if isinstance(server, VLLMServer) and server.engine:
                server.warm_up(max(deadline - time.monotonic(), 60.0))


def reference_server(model_dir: Path, log_dir: Path) -> VLLMServer:
    """The single TP 1 instance greedy outputs are compared against: no connector, on core 0 (P's core in every
    cluster, one OpenMP thread each, so both do the same arithmetic), with the arguments of every served instance.
    The tests share one for the whole session (the ``vllm_single`` fixture)."""
    return vllm_server("single", model_dir, free_port(), log_dir, cores=[0])


def metric_values(port: int, name: str) -> list[float]:
    """The values of every sample of ``name`` (any labels) in a server's Prometheus ``/metrics``."""
    status, raw = http_get(port, "/metrics")
    if status != 200:
        raise RuntimeError(f"/metrics answered {status}")
    out = []
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def replay_json(*log_dirs: Path, quiescent: bool = False, events: bool = False) -> tuple[int, dict]:
    """``kvlifecycle replay --check --json`` on event-log directories (the CLI, as a user would run it)."""
    import json

    argv = [sys.executable, "-m", "kvlifecycle", "replay", "--check", "--json", *map(str, log_dirs)]
    if quiescent:
        argv.insert(5, "--quiescent")
    if events:
        argv.insert(5, "--events")
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError:
        return out.returncode, {"stdout": out.stdout, "stderr": out.stderr}


def event_dirs(root: Path, side: str) -> list[Path]:
    return sorted(p for p in root.glob(f"{side}-*") if p.is_dir())
