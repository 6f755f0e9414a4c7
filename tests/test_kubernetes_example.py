"""deploy/kubernetes agrees with the code: the side-channel port and variables are the connector's, the connector
options are ones it knows, the proxy listens on its default port and reaches etcd where etcd listens, and the
secret the pods read is the one the Secret holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvlifecycle import envvars
from kvlifecycle.cli import build_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def _container(name: str) -> dict:
    (deployment,) = [d for d in _docs(name) if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _default_side_channel_port() -> int:
    match = re.search(r"^DEFAULT_SIDE_CHANNEL_PORT = (\d+)$", (ROOT / "adapters/vllm/config.py").read_text(), re.M)
    assert match
    return int(match.group(1))


def _connector_options() -> set[str]:
    """The option keys docs/vllm.md documents (its options table, checked against the code by its own tests)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    table = text[text.index("## Options"):text.index("## Membership")]
    return set(re.findall(r"^\| `(\w+)` \|", table, re.M))


def _transfer_config(container: dict) -> dict:
    (script,) = container["args"]
    raw = script.split("--kv-transfer-config ", 1)[1].strip()
    assert raw.startswith('"') and raw.endswith('"')
    text = re.sub(r"\$(\w+)", "x", raw[1:-1]).replace('\\"', '"')  # the shell's expansion of "$VAR"s
    return json.loads(text)


@pytest.mark.parametrize(("manifest", "role"), [("prefill.yaml", "kv_producer"), ("decode.yaml", "kv_consumer")])
def test_engine_pods_configure_the_connector_as_the_code_reads_it(manifest: str, role: str) -> None:
    container = _container(manifest)
    env = {e["name"]: e for e in container["env"]}
    config = _transfer_config(container)
    assert config["kv_connector"] == "KVLifecycleConnector" and config["kv_role"] == role
    assert config["kv_connector_module_path"] == "kvlifecycle.adapters.vllm"
    assert set(config["kv_connector_extra_config"]) <= _connector_options()
    known = envvars.known_names()
    for name in env:
        assert name in known or not name.startswith(("KVL_", "VLLM_NIXL_")), name
    assert env["KVL_ETCD_ENDPOINTS"]["value"] == f"kvl-etcd:{_etcd_port()}"
    secret = env["SIDE_CHANNEL_SECRET"]["valueFrom"]["secretKeyRef"]
    (stored,) = _docs("secret.yaml")
    assert secret["name"] == stored["metadata"]["name"] and secret["key"] in stored["stringData"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == 8000
    if role == "kv_producer":
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["value"] == "$(POD_IP)"
        assert int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"]) == ports["side-channel"] == \
            _default_side_channel_port()


def _etcd_port() -> int:
    (service,) = [d for d in _docs("etcd.yaml") if d["kind"] == "Service"]
    (port,) = service["spec"]["ports"]
    container = _container("etcd.yaml")
    assert {"name": "client", "containerPort": port["port"]} in container["ports"]
    assert f"--listen-client-urls=http://0.0.0.0:{port['port']}" in container["command"]
    return int(port["port"])


def test_the_proxy_listens_on_its_default_port_and_finds_etcd() -> None:
    command = _container("proxy.yaml")["command"]
    assert command[:2] == ["kvlifecycle", "proxy"]
    args = build_parser(only="proxy").parse_args(command[1:])
    default = build_parser(only="proxy").parse_args(["proxy", "--etcd", "x:1"]).port
    assert args.port == default == 8000
    assert args.etcd == f"kvl-etcd:{_etcd_port()}"
    (service,) = [d for d in _docs("proxy.yaml") if d["kind"] == "Service"]
    assert service["spec"]["ports"][0]["port"] == args.port
