"""Push mode on real vLLM: D reserves its blocks and asks P, which WRITEs them (NIXL WRITE + notification).

The reference is P itself answering the whole request alone (same model, same single OpenMP thread).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12


def push_config(role: str, events: Path, port: int) -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_port": port, "mode": "push",
                                      "lease_ttl_s": 8.0},
    }


@pytest.fixture(scope="module")
def push_pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-push")
    events = logs / "events"
    side = h.free_port_pair()
    prefill = h.vllm_server("prefill", tiny_model, h.free_port(), logs, cores=[0],
                            kv_transfer_config=push_config("kv_producer", events, side))
    decode = h.vllm_server("decode", tiny_model, h.free_port(), logs, cores=[1],
                           kv_transfer_config=push_config("kv_consumer", events, side))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs)
    servers = [prefill, decode, proxy]
    try:
        start_all(servers)
        yield prefill, decode, proxy, events
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.mark.parametrize("num_tokens", [5, 120, 300])
def test_push_outputs_equal_a_single_instance(push_pair, num_tokens: int) -> None:
    prefill, _decode, proxy, _events = push_pair
    prompt = h.prompt_of_length(num_tokens, offset=300 + num_tokens)
    got = h.stream_completion(proxy.port, prompt, MAX_TOKENS, timeout_s=180)
    assert got.status == 200, got.text
    # afterwards P answers alone (its prefix cache holds this prompt now; the tokens must not change)
    status, alone = h.post_json(prefill.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, alone
    assert got.text == alone["choices"][0]["text"]


def test_push_logs_replay_clean_and_every_grant_completed(push_pair) -> None:
    prefill, decode, proxy, events = push_pair
    for server in (proxy, decode, prefill):
        server.stop()
    sources, targets = event_dirs(events, "source"), event_dirs(events, "target")
    rc, report = replay_json(*sources, *targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    source = next(log for log in report["logs"] if log["side"] == "source")
    target = next(log for log in report["logs"] if log["side"] == "target")
    assert source["stats"].get("completed", 0) >= 3, source["stats"]
    assert target["stats"].get("loaded", 0) >= 3, target["stats"]
