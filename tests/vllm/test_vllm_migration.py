"""Migrating from vLLM's NixlConnector: every setting NixlConnector reads (its extra-config keys and environment
variables, read off the real NixlConnector's source; every KVTransferConfig field of the real vLLM) is honoured,
mapped or refused in words at start-up; the recording rules give NixlConnector's metric names from ours, and the
Grafana dashboard queries only metrics the connector exports. All in the real vLLM environment."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import vllm_harness as h

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import dataclasses, glob, json, os, re
import vllm
from vllm.config import KVTransferConfig
nixl_dir = os.path.join(os.path.dirname(vllm.__file__), "distributed/kv_transfer/kv_connector/v1/nixl")
source = "".join(open(p).read() for p in sorted(glob.glob(os.path.join(nixl_dir, "*.py"))))
extra_keys = sorted(set(re.findall(r'get_from_extra_config\(\s*"(\w+)"', source)))
env_names = sorted(set(re.findall(r"envs\.(VLLM_NIXL_\w+)", source)))
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import stats as nixl_stats
nixl_metrics = sorted(set(re.findall(r'name="(vllm:nixl_\w+)"', open(nixl_stats.__file__).read())))

from kvlifecycle.adapters.vllm.config import AdapterConfig
from kvlifecycle.adapters.vllm.nixl_migration import ENV, EXTRA_CONFIG, TRANSFER_CONFIG
from kvlifecycle.adapters.vllm.nixl_migration import check_buffer_device, check_transfer_config
tables = {name: {k: m.fate for k, m in table.items()}
          for name, table in (("extra", EXTRA_CONFIG), ("env", ENV), ("transfer", TRANSFER_CONFIG))}
outcomes = {}
samples = {"backends": ["UCX"], "kv_lease_duration": 45, "enforce_handshake_compat": False, "engine_ttl": 10.0,
           "decoder_kv_blocks_ttl": 100, "kv_recompute_threshold": 8, "bidirectional_kv_xfer": True,
           "num_threads": 8, "push_registration_timeout": 20.0}
for key in extra_keys:
    try:
        cfg = AdapterConfig.from_extra({key: samples.get(key, 1)})
        outcomes[key] = {"accepted": {"backends": list(cfg.backends), "lease_ttl_s": cfg.lease_ttl_s,
                                      "load_timeout_s": cfg.load_timeout_s}}
    except ValueError as exc:
        outcomes[key] = {"refused": str(exc)}
both = None
try:
    AdapterConfig.from_extra({"kv_lease_duration": 45, "lease_ttl_s": 30})
except ValueError as exc:
    both = str(exc)
os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "10.1.2.3"
os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = "6123"
env_cfg = AdapterConfig.from_extra({})
os.environ["KVL_SIDE_CHANNEL_HOST"] = "10.9.9.9"
refined = AdapterConfig.from_extra({})
transfer = {}
for case in ({"enable_permute_local_kv": True}, {"enable_permute_local_kv": False}):
    try:
        check_transfer_config(KVTransferConfig(kv_connector="KVLifecycleConnector", kv_role="kv_both", **case))
        transfer[json.dumps(case)] = "accepted"
    except ValueError as exc:
        transfer[json.dumps(case)] = "refused: " + str(exc)
try:
    check_buffer_device(KVTransferConfig(kv_connector="KVLifecycleConnector", kv_role="kv_both",
                                         kv_buffer_device="cpu"), "cuda")
    buffer = "accepted"
except ValueError as exc:
    buffer = "refused: " + str(exc)
print(json.dumps({"extra_keys": extra_keys, "env_names": env_names, "nixl_metrics": nixl_metrics,
                  "fields": [f.name for f in dataclasses.fields(KVTransferConfig)], "outcomes": outcomes,
                  "both": both, "host": env_cfg.side_channel_host, "port": env_cfg.side_channel_port,
                  "refined_host": refined.side_channel_host, "transfer": transfer, "buffer": buffer,
                  "tables": tables}))
"""

EXPORTED = r"""
import json, prometheus_client as pc
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from kvlifecycle.adapters.vllm.stats import KVLifecyclePromMetrics, HISTOGRAMS, COUNTERS
class Cfg: kv_transfer_config = None
m = KVLifecyclePromMetrics(Cfg(), {pc.Gauge: pc.Gauge, pc.Counter: pc.Counter, pc.Histogram: pc.Histogram},
                           ["model_name", "engine"], {0: ["m", "0"]})
m.observe({k: [1] for k in HISTOGRAMS + COUNTERS})
names = sorted({s.name for fam in pc.REGISTRY.collect() for s in fam.samples if s.name.startswith("vllm:")})
print(json.dumps(names))
"""


def _probe(code: str) -> object:
    h.require_vllm()
    unset = ("KVL_SIDE_CHANNEL_HOST", "KVL_SIDE_CHANNEL_PORT", "VLLM_NIXL_")
    env = {k: v for k, v in h.base_env().items() if not k.startswith(unset)}
    done = subprocess.run([str(h.VLLM_PYTHON), "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_every_nixl_connector_setting_is_honoured_mapped_or_refused_in_words() -> None:
    found = _probe(PROBE)
    assert isinstance(found, dict)
    extra_fates, env_fates, transfer_fates = (found["tables"][k] for k in ("extra", "env", "transfer"))
    assert found["extra_keys"] and set(found["extra_keys"]) <= set(extra_fates), found["extra_keys"]
    assert found["env_names"] and set(found["env_names"]) <= set(env_fates), found["env_names"]
    assert set(found["fields"]) <= set(transfer_fates), found["fields"]
    for key, outcome in found["outcomes"].items():
        fate = extra_fates[key]
        if fate == "refused":
            assert "refused" in outcome and key in outcome["refused"] and "no meaning" in outcome["refused"]
        else:
            assert "accepted" in outcome, (key, outcome)
    assert found["outcomes"]["kv_lease_duration"]["accepted"]["lease_ttl_s"] == 45
    assert found["outcomes"]["push_registration_timeout"]["accepted"]["load_timeout_s"] == 20
    assert "keep 'lease_ttl_s'" in found["both"]
    assert (found["host"], found["port"], found["refined_host"]) == ("10.1.2.3", 6123, "10.9.9.9")
    assert found["transfer"] == {'{"enable_permute_local_kv": true}': found["transfer"][
        '{"enable_permute_local_kv": true}'], '{"enable_permute_local_kv": false}': "accepted"}
    assert found["transfer"]['{"enable_permute_local_kv": true}'].startswith("refused: ")
    assert found["buffer"].startswith("refused: ") and "kv_buffer_device='cpu'" in found["buffer"]
    page = (ROOT / "docs" / "migrating-from-nixl.md").read_text()
    for table in (extra_fates, env_fates, transfer_fates):
        assert all(f"| `{key}` |" in page for key in table), [k for k in table if f"| `{key}` |" not in page]
    assert all(f"| `{name}` |" in page for name in found["nixl_metrics"])


def test_recording_rules_and_dashboard_query_only_exported_metrics() -> None:
    exported = _probe(EXPORTED)
    assert isinstance(exported, list) and exported
    found = _probe(PROBE)
    assert isinstance(found, dict)
    rules = subprocess.run([str(h.VLLM_PYTHON), "-c", "import json, sys, yaml; "
                            "print(json.dumps(yaml.safe_load(open(sys.argv[1]))))",
                            str(ROOT / "deploy/prometheus/nixl-compat.rules.yml")],
                           capture_output=True, text=True, timeout=120, check=True)
    groups = json.loads(rules.stdout)["groups"]
    records = [(r["record"], r["expr"]) for g in groups for r in g["rules"]]
    assert records
    series = re.compile(r"vllm:[a-z_]+")
    nixl_bases = set(found["nixl_metrics"])
    for record, expr in records:
        assert set(series.findall(expr)) <= set(exported), (record, expr)
        base = re.sub(r"_(bucket|sum|count|total)$", "", record)
        assert base in nixl_bases, record
    dashboard = json.loads((ROOT / "deploy/grafana/kvlifecycle.json").read_text())
    queried = {m for panel in dashboard["panels"] for t in panel.get("targets", ())
               for m in series.findall(t["expr"])}
    assert queried and queried <= set(exported), queried - set(exported)
