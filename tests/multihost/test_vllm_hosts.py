"""Real vLLM on two hosts: P (vllm serve with KVLifecycleConnector, pull mode) in one network namespace, D in
another, ``kvlifecycle proxy`` on a third; greedy outputs through the proxy equal the single instance's (the
session's reference instance, tests/conftest.py: on 127.0.0.1 outside the namespaces, on P's core).

Each vLLM process runs inside its host (``ip netns exec``), listens on the host's own address, and moves KV with
NIXL over UCX TCP on the host's veth (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=kvl0``: no shared memory, no
loopback), the side channel on P's address with HMAC on. The test process has no route to the test range, so its
requests go from inside the front host too (netns_http.py). Needs root, the vLLM venv (scripts/setup-vllm-env.sh)
and the tiny model; under KVL_REQUIRE_ALL=1 it fails instead of skipping. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import netns_harness as nh
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
import vllm_harness as vh  # beside the single-host vLLM tests

pytestmark = [pytest.mark.multihost, pytest.mark.vllm, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 12
HTTP_PORT, SIDE_CHANNEL_PORT, PROXY_PORT = 8100, 5600, 8000  # fresh namespaces: every port is free
SECRET = "vllm-hosts-secret"
START_TIMEOUT_S = 480.0  # vLLM servers starting at once on two loaded cores


@dataclass
class Served:
    name: str
    host: nh.Host
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"{self.host.address}:{HTTP_PORT}"

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@dataclass
class TwoHosts:
    prefill: Served
    decode: Served
    single: vh.VLLMServer  # the session's reference instance (tests/conftest.py), outside the namespaces
    proxy: Served
    front: nh.Host
    events: Path


def http(front: nh.Host, verb: str, address: str, path: str, body: dict | None = None,
         timeout_s: float = 180.0) -> dict:
    host, port = address.rsplit(":", 1)
    argv = [sys.executable, str(HERE / "netns_http.py"), verb, host, port, path, json.dumps(body or {}),
            str(timeout_s)]
    out = front.run(argv, timeout_s=timeout_s + 30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def kvl_config(role: str, events: Path, side_channel_host: str) -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_host": side_channel_host,
                                      "side_channel_port": SIDE_CHANNEL_PORT, "mode": "pull", "secret": SECRET},
    }


def start_vllm(name: str, host: nh.Host, model: Path, logs: Path, core: int, kv: dict | None = None,
               env_extra: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> Served:
    env = vh.base_env([core])
    env.update(host.ucx_env(), VLLM_HOST_IP=host.address, VLLM_NIXL_SIDE_CHANNEL_HOST=host.address,
               VLLM_NIXL_SIDE_CHANNEL_PORT=str(SIDE_CHANNEL_PORT), **(env_extra or {}))
    argv = ["taskset", "-c", str(core), str(vh.VLLM_CLI), "serve", str(model), "--host", host.address,
            "--port", str(HTTP_PORT), "--served-model-name", vh.MODEL_NAME, "--dtype", "float32",
            "--max-model-len", "2048", "--enforce-eager", "--disable-log-stats", "--seed", "0", *extra_args]
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv)]
    log = logs / f"{name}.log"
    return Served(name, host, host.popen(argv, env=env, log=log), log)


def wait_ready(front: nh.Host, servers: list[Served], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited while starting:\n{server.tail()}")
            if http(front, "get", server.url if server.name != "proxy" else f"{front.address}:{PROXY_PORT}",
                     "/health", timeout_s=5).get("status") == 200:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.name} not ready after {timeout_s:.0f} s:\n{server.tail()}")
            time.sleep(3)


@pytest.fixture(scope="module")
def two_hosts(swept: list[str], vllm_single: vh.VLLMServer,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoHosts]:
    vh.require_vllm()
    model = vh.build_tiny_model(vh.MODEL_CACHE)
    logs = tmp_path_factory.mktemp("vllm-hosts")
    events = logs / "events"
    with nh.cluster() as cluster:
        p_host, d_host, front = cluster.add_host("p"), cluster.add_host("d"), cluster.add_host("front")
        # P and the single instance share core 0, D core 1: one OpenMP thread each, so every instance does the
        # same arithmetic and greedy outputs compare token for token (as in tests/vllm/test_vllm_pd.py)
        prefill = start_vllm("prefill", p_host, model, logs, 0, kvl_config("kv_producer", events, p_host.address))
        decode = start_vllm("decode", d_host, model, logs, 1, kvl_config("kv_consumer", events, d_host.address))
        single = vllm_single
        proxy_log = logs / "proxy.log"
        proxy = Served("proxy", front, front.popen(
            [sys.executable, "-m", "kvlifecycle", "proxy", "--host", front.address, "--port", str(PROXY_PORT),
             "--prefill", prefill.url, "--decode", decode.url], env=None, log=proxy_log), proxy_log)
        servers = [prefill, decode, proxy]
        try:
            wait_ready(front, servers, START_TIMEOUT_S)
            yield TwoHosts(prefill, decode, single, proxy, front, events)
        finally:
            for server in reversed(servers):  # each in its own process group: its engine and workers too
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, signal.SIGTERM)
            for server in servers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.proc.wait(30)
            # the cluster's close then kills whatever still runs in the namespaces and removes them


def reference(hosts: TwoHosts | Any, prompt: str) -> str:
    """The single instance's greedy text (any ``hosts`` whose ``single`` is the session's reference server)."""
    status, answer = vh.post_json(hosts.single.port, "/v1/completions", vh.completion_body(prompt, MAX_TOKENS))
    assert status == 200, answer
    return answer["choices"][0]["text"]


@pytest.mark.parametrize("num_tokens", [5, 64, 300])
def test_output_through_the_proxy_across_hosts_equals_a_single_instance(two_hosts: TwoHosts,
                                                                        num_tokens: int) -> None:
    prompt = vh.prompt_of_length(num_tokens, offset=500 + num_tokens)
    expected = reference(two_hosts, prompt)
    got = http(two_hosts.front, "stream", f"{two_hosts.front.address}:{PROXY_PORT}", "/v1/completions",
               vh.completion_body(prompt, MAX_TOKENS, stream=True))
    assert got["status"] == 200, got
    assert got["text"] == expected
    assert len(expected.split()) == MAX_TOKENS


def test_decode_on_its_host_really_uses_the_kv_from_the_prefill_host(two_hosts: TwoHosts) -> None:
    """D gets prompt B with the params of prompt A (same length, same last token): it answers A's continuation,
    which it can only know from the KV it read from P's host."""
    n = 96
    prompt_a = vh.prompt_of_length(n, offset=5)
    words_b = vh.prompt_of_length(n, offset=2222).split()
    words_b[-1] = prompt_a.split()[-1]
    prompt_b = " ".join(words_b)
    ref_a, ref_b = reference(two_hosts, prompt_a), reference(two_hosts, prompt_b)
    assert ref_a != ref_b
    prefill = http(two_hosts.front, "post", two_hosts.prefill.url, "/v1/completions",
                   vh.completion_body(prompt_a, 1, kv_transfer_params={"do_remote_decode": True}))
    assert prefill["status"] == 200, prefill
    params = prefill["body"]["kv_transfer_params"]
    assert params["remote_host"] == two_hosts.prefill.host.address, params
    answer = http(two_hosts.front, "post", two_hosts.decode.url, "/v1/completions",
                  vh.completion_body(prompt_b, MAX_TOKENS, kv_transfer_params=params))
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["text"] == ref_a


def test_both_hosts_event_logs_replay_clean(two_hosts: TwoHosts) -> None:
    dirs = vh.event_dirs(two_hosts.events, "source") + vh.event_dirs(two_hosts.events, "target")
    assert len(dirs) >= 2, dirs
    rc, report = vh.replay_json(*dirs)
    assert rc == 0, report.get("violations", report)
