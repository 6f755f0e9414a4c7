"""Real vLLM on hosts of their own: the helpers the multi-host vLLM tests share (test_vllm_etcd.py).

Each vLLM process runs inside its host (``ip netns exec``), listens on the host's own address, and moves KV with
NIXL over UCX TCP on the host's veth (``UCX_TLS=tcp,self``, ``UCX_NET_DEVICES=kvl0``: no shared memory, no
loopback), the side channel on P's address with HMAC on. The test process has no route to the test range, so its
requests go from inside the front host too (netns_http.py). Every wait is bounded.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import netns_harness as nh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
import vllm_harness as vh  # beside the single-host vLLM tests

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 12
HTTP_PORT, SIDE_CHANNEL_PORT, PROXY_PORT = 8100, 5600, 8000  # fresh namespaces: every port is free
STATIC_PROXY_PORT = 8001  # a proxy given the servers on its command line, beside the one that reads etcd
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


def reference(hosts: Any, prompt: str) -> str:
    """The single instance's greedy text (any ``hosts`` whose ``single`` is the session's reference server)."""
    status, answer = vh.post_json(hosts.single.port, "/v1/completions", vh.completion_body(prompt, MAX_TOKENS))
    assert status == 200, answer
    return answer["choices"][0]["text"]
