"""Push mode on real vLLM: D reserves its blocks and asks P, which WRITEs them (NIXL WRITE + notification).

P runs with a host staging policy (a lease unclaimed for ``STAGE_AFTER_MS`` goes to a host pool): D asked at once,
through the proxy, is written from P's KV cache as before; D asked only after P's log says the request was staged
is written from the host pool (the pool's own NIXL agent), and its staging log shows the copy served and read.
The reference is P itself answering the whole request alone (same model, same single OpenMP thread).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
# long next to D's claim through the proxy (the handoffs above stay on the GPU path unless D stalls), short next to
# the 8 s lease, which a staged copy carries on
STAGE_AFTER_MS = 2000


def push_config(role: str, events: Path, port: int) -> dict:
    extra: dict = {"log_dir": str(events), "side_channel_port": port, "mode": "push", "lease_ttl_s": 8.0}
    if role == "kv_producer":
        extra.update(stage_when="after", stage_after_ms=STAGE_AFTER_MS, staging_pool_blocks=16)
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_connector_extra_config": extra,
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


def staged_on_p(prefill: h.VLLMServer, request: str, timeout_s: float = 60.0) -> bool:
    """P's log says ``request`` was staged (its GPU blocks went back to vLLM), within the deadline."""
    line = f"{request} staged to the host pool"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if line in prefill.log_path.read_text(errors="replace"):
            return True
        time.sleep(0.2)
    return False


STAGED_PUSHES: list[str] = []  # P transfers written to D from the host pool, for the replay test below


@pytest.mark.parametrize("num_tokens", [130, 300])
def test_a_push_asked_after_p_staged_the_lease_is_written_from_the_host_pool(push_pair, num_tokens: int) -> None:
    """D is slow: it asks only once P's log says the request was staged (its GPU blocks went back to vLLM). P
    writes D's blocks from its host pool; the answer equals P's alone, and P's staging log shows the staged copy
    served to D and its read ended ok (the write's completion), D's log a push load of that transfer."""
    prefill, decode, _proxy, events = push_pair
    prompt = h.prompt_of_length(num_tokens, offset=700 + num_tokens)
    status, answer = h.post_json(prefill.port, "/v1/completions",
                                 h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    request = params["remote_request_id"]
    assert staged_on_p(prefill, request), prefill.log_tail(30)
    status, got = h.post_json(decode.port, "/v1/completions",
                              h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))
    assert status == 200, got
    status, alone = h.post_json(prefill.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, alone
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
    (pool,) = event_dirs(events, "staging")
    (transfer,) = [e.transfer for e in read_events(pool) if isinstance(e, ev.StgStarted) and e.request == request]
    deadline = time.monotonic() + 30  # the pool logs the read's end on P's next service step
    pool_events = [e for e in read_events(pool) if getattr(e, "transfer", None) == transfer]
    while not any(isinstance(e, ev.StgReleased) for e in pool_events) and time.monotonic() < deadline:
        time.sleep(0.5)
        pool_events = [e for e in read_events(pool) if getattr(e, "transfer", None) == transfer]
    pool_events = [e for e in pool_events if not isinstance(e, ev.StgRenewed)]  # D's keepalives before it asked
    kinds = [type(e).__name__ for e in pool_events]
    assert kinds == ["StgStarted", "StgCompleted", "StgServed", "StgReadEnded", "StgReleased"], kinds
    read_end, release = pool_events[3], pool_events[4]
    assert isinstance(read_end, ev.StgReadEnded) and read_end.ok, read_end
    assert isinstance(release, ev.StgReleased) and release.reason == "completed", release
    d_loads = [e for t in event_dirs(events, "target") for e in read_events(t)
               if isinstance(e, ev.TgtLoadStarted) and e.transfer == transfer]
    assert [e.mode for e in d_loads] == ["push"], d_loads
    STAGED_PUSHES.append(transfer)


def test_push_logs_replay_clean_and_every_grant_completed(push_pair) -> None:
    prefill, decode, proxy, events = push_pair
    for server in (proxy, decode, prefill):
        server.stop()
    sources, pools, targets = event_dirs(events, "source"), event_dirs(events, "staging"), event_dirs(events, "target")
    assert len(pools) == 1, pools
    rc, report = replay_json(*sources, *pools, *targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    source = next(log for log in report["logs"] if log["side"] == "source")
    target = next(log for log in report["logs"] if log["side"] == "target")
    # a lease ends completed (D wrote from the GPU copy) or staged (its copy went to the host pool first)
    ended = source["stats"].get("completed", 0) + source["stats"].get("staged", 0)
    assert ended >= 3 + len(STAGED_PUSHES), source["stats"]
    assert source["stats"].get("staged", 0) >= len(STAGED_PUSHES), source["stats"]
    assert target["stats"].get("loaded", 0) >= 3 + len(STAGED_PUSHES), target["stats"]
