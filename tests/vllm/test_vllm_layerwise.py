"""Layer-wise streaming on real vLLM (CPU, float32): the proxy's ``--layerwise`` submits to D first, D reserves
and sends its reservation to P, P streams each layer as it returns (chunked prefill on: 64 tokens a step). The
main pair runs with ``"verify": "all"``: each layer batch carries P's digest and D checks it before it counts, and
with a host staging policy on P (``stage_after_ms`` 50): a stream reads P's KV cache as it is written and is never
granted, so nothing of it is staged; staging applies to what is granted after the prefill (a declined stream's
fallback, a request that does not stream), which D then reads from the host pool.

The reference is P itself answering the whole request alone (same model, same single OpenMP thread). Further pairs
change P's streamer from outside the library (``fault_site``): the post of layer 2 fails (the request fails under
policy ``fail``, no block of it was ever READY on D); or the first post of layer 2 waits until a cancel reached P,
so that the client can disconnect, or P be killed, while the stream is mid-way. Both logs replay clean in each case.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import vllm_harness as h
from vllm_harness import event_dirs, replay_json, start_all

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
LONG = 1500  # 24 chunks of 64: D's reservation reaches P while this prefill is under way
FAULT_SITE = Path(__file__).resolve().parent / "fault_site"


STAGING = {"stage_when": "after", "stage_after_ms": 50, "staging_pool_blocks": 32}  # P's policy in the main pair


def kv_config(role: str, events: Path, port: int, policy: str = "fail", load_timeout_s: float = 20.0,
              verify: str = "none", staging: dict | None = None) -> dict:
    return {
        "kv_connector": "KVLifecycleConnector",
        "kv_connector_module_path": "kvlifecycle.adapters.vllm",
        "kv_role": role,
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"log_dir": str(events), "side_channel_port": port, "lease_ttl_s": 8.0,
                                      "load_timeout_s": load_timeout_s,  # D's stream timeout too
                                      "verify": verify, **(staging or {})},
    }


def layerwise_pair(model: Path, logs: Path, p_env: dict[str, str] | None = None, policy: str = "fail",
                   load_timeout_s: float = 20.0, verify: str = "none",
                   staging: dict | None = None) -> list[h.VLLMServer]:
    """``staging``: P's host staging policy (keys of ``kv_connector_extra_config``), none by default."""
    events = logs / "events"
    side = h.free_port_pair()
    prefill = h.vllm_server("prefill", model, h.free_port(), logs, cores=[0], extra_env=p_env,
                            extra_args=["--max-num-batched-tokens", "64"],  # chunked prefill: 64 tokens a step
                            kv_transfer_config=kv_config("kv_producer", events, side, verify=verify,
                                                         staging=staging))
    decode = h.vllm_server("decode", model, h.free_port(), logs, cores=[1],
                           kv_transfer_config=kv_config("kv_consumer", events, side, policy, load_timeout_s,
                                                        verify))
    proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], logs,
                            extra_args=["--layerwise", f"{h.HOST}:{side}"])
    return [prefill, decode, proxy]


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("vllm-layerwise")
    # every layer batch checked on D, as it lands; P stages what is granted and left unclaimed for 50 ms
    servers = layerwise_pair(tiny_model, logs, verify="all", staging=STAGING)
    try:
        start_all(servers)
        yield (*servers, logs / "events")
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.mark.parametrize("num_tokens", [5, 300, LONG])
def test_layerwise_outputs_equal_a_single_instance(pair, num_tokens: int) -> None:
    prefill, _decode, proxy, _events = pair
    prompt = h.prompt_of_length(num_tokens, offset=500 + num_tokens)
    got = h.stream_completion(proxy.port, prompt, MAX_TOKENS, timeout_s=180)
    assert got.status == 200, got.text
    status, alone = h.post_json(prefill.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, alone
    assert got.text == alone["choices"][0]["text"]


STAGED_AFTER_PREFILL: list[str] = []  # P transfers D read from the host pool, granted after a prefill


def test_with_staging_on_a_request_granted_after_its_prefill_is_staged_and_read_from_the_host_pool(pair) -> None:
    """The staging policy is live on this P: a request that does not stream (plain ``do_remote_decode``, no stream
    key) is granted after its prefill, staged once unclaimed for 50 ms, and D, asking only after that, reads the
    host copy (verified against its digests) and answers as P alone does."""
    prefill, decode, _proxy, events = pair
    prompt = h.prompt_of_length(200, offset=800)
    status, answer = h.post_json(prefill.port, "/v1/completions",
                                 h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert status == 200, answer
    params = answer["kv_transfer_params"]
    request = params["remote_request_id"]
    wait_for("P staged the request", lambda: f"{request} staged to the host pool" in
             prefill.log_path.read_text(errors="replace"), 60)
    status, got = h.post_json(decode.port, "/v1/completions",
                              h.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))
    assert status == 200, got
    status, alone = h.post_json(prefill.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
    assert status == 200, alone
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
    (pool,) = event_dirs(events, "staging")
    (transfer,) = [e.transfer for e in read_events(pool) if isinstance(e, ev.StgStarted) and e.request == request]
    assert any(isinstance(e, ev.StgServed) and e.transfer == transfer for e in read_events(pool))
    STAGED_AFTER_PREFILL.append(transfer)


def test_layerwise_logs_replay_clean_and_every_request_streamed_layer_by_layer(pair) -> None:
    prefill, decode, proxy, events = pair
    for server in (proxy, decode, prefill):
        server.stop()
    sources, pools, targets = event_dirs(events, "source"), event_dirs(events, "staging"), event_dirs(events, "target")
    rc, report = replay_json(*sources, *pools, *targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    d_events = [e for t in targets for e in read_events(t)]
    declined = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadDeclined)}  # P began first: fallback
    streams = {e.transfer: e.layers for e in d_events
               if isinstance(e, ev.TgtLoadStarted) and e.layers and e.transfer not in declined}
    assert streams and set(streams.values()) == {4}, (streams, declined)  # 4 layers each
    # staging applies after the prefill only: every copy P staged is of a lease D loaded after a prefill (a
    # declined stream's fallback, or the plain request above), none of a request that streamed (a streamed request
    # granted at its end would be staged unread, its lease never claimed by D)
    staged = {e.transfer for p in pools for e in read_events(p) if isinstance(e, ev.StgStarted)}
    after_prefill = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadStarted) and not e.layers}
    assert STAGED_AFTER_PREFILL and set(STAGED_AFTER_PREFILL) <= staged, (STAGED_AFTER_PREFILL, staged)
    assert staged <= after_prefill, (staged, after_prefill, streams)
    blocks = {e.request: ev.unpack_blocks(e.blocks).size for e in d_events if isinstance(e, ev.TgtReserved)}
    request_of = {e.transfer: e.request for e in d_events if isinstance(e, ev.TgtLoadStarted)}
    long = [t for t in streams if blocks[request_of[t]] == max(blocks.values())]  # a short prompt's reservation
    assert long, (streams, declined)  # may come after its prefill ended (a counted fallback); the long one's joins
    landed = [e for e in d_events if isinstance(e, ev.TgtLayersLanded)]
    batches = {t: sum(e.transfer == t and e.first_layer == 0 for e in landed) for t in long}
    assert min(batches.values()) > 1, "a long prompt lands in several chunks per layer"
    done = {e.transfer for e in d_events if isinstance(e, ev.TgtPartDone)}
    assert set(streams) <= done
    # verify: all: each streamed batch matched P's digest before it counted, so each stream's part says so
    assert all(e.verified for e in landed if e.transfer in streams), [e for e in landed if not e.verified]
    verified = {e.transfer: e.verified for e in d_events if isinstance(e, ev.TgtPartDone) and e.transfer in streams}
    assert all(verified[t] == blocks[request_of[t]] for t in streams), (verified, blocks)
    assert not [e for e in d_events if isinstance(e, ev.TgtDigestMismatch)]
    p_posts = [e for s in sources for e in read_events(s)
               if isinstance(e, ev.TransferObserved) and e.transfer in streams]
    assert len(p_posts) == len(landed)  # one settled WRITE on P per layer batch landed on D


def test_the_timeline_draws_each_streamed_layer_on_both_sides(pair, tmp_path: Path) -> None:
    """``kvlifecycle timeline`` on the pair's logs (stopped by the test above): every layer of every stream lands
    on D's track, and each per-layer WRITE is a slice on P's data plane."""
    *_, events = pair
    trace = tmp_path / "trace.json"
    out = subprocess.run([sys.executable, "-m", "kvlifecycle", "timeline", "-o", str(trace), str(events)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    drawn = json.loads(trace.read_text())["traceEvents"]
    d_events = [e for t in event_dirs(events, "target") for e in read_events(t)]
    declined = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadDeclined)}
    streams = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadStarted) and e.layers} - declined
    landed = {(d["args"].get("transfer"), d["name"]) for d in drawn if d["ph"] == "i" and "landed" in d["name"]}
    assert streams and all((t, f"layer {layer} landed") in landed for t in streams for layer in range(4)), landed
    writes = [d for d in drawn if d["ph"] == "X" and d["args"].get("transfer") in streams
              and d["name"].startswith("xfer ")]
    batches = sum(isinstance(e, ev.TgtLayersLanded) and e.transfer in streams for e in d_events)
    assert len(writes) == batches  # one slice per layer batch's WRITE


def test_a_write_failing_at_layer_2_fails_the_request_with_no_ready_block(tiny_model: Path, tmp_path: Path) -> None:
    """A request whose stream began fails with the layer-2 error, and none of its blocks was ever READY. A request
    whose prefill began before D's reservation reached P is declined and pulled after the prefill (a counted
    fallback: it answers); the test sends until one streamed (at most four) and checks each answer against D's log."""
    env = {"PYTHONPATH": os.pathsep.join([str(FAULT_SITE), os.environ.get("PYTHONPATH", "")]),
           "KVL_TEST_STREAM_FAIL_LAYER": "2"}
    servers = layerwise_pair(tiny_model, tmp_path, p_env=env)
    answers: dict[str, h.StreamResult] = {}
    try:
        start_all(servers)
        for attempt in range(4):
            request_id = f"fail2-{attempt}"
            got = h.stream_completion(servers[2].port, h.prompt_of_length(LONG, offset=77 + attempt), MAX_TOKENS,
                                      timeout_s=180, request_id=request_id)
            answers[request_id] = got
            if got.status != 200 or "error" in got.text.lower() or not got.text:
                break
    finally:
        for server in reversed(servers):
            server.stop()
    events = tmp_path / "events"
    sources, targets = event_dirs(events, "source"), event_dirs(events, "target")
    rc, report = replay_json(*sources, *targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    d_events = [e for t in targets for e in read_events(t)]
    request_of = {e.transfer: e.request for e in d_events if isinstance(e, ev.TgtLoadStarted)}
    declined = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadDeclined)}
    streams = {e.transfer for e in d_events if isinstance(e, ev.TgtLoadStarted) and e.layers} - declined
    streamed = {rid for rid in answers if any(f"-{rid}-" in request_of[t] for t in streams)}
    assert streamed, (answers, request_of, declined)  # one request at least streamed
    for rid, got in answers.items():
        failed = got.status != 200 or "error" in got.text.lower() or not got.text
        assert failed == (rid in streamed), (rid, got, streamed)  # streamed ones fail, declined ones answer
    failed_loads = [e for e in d_events if isinstance(e, ev.TgtLoadFailed)]
    assert failed_loads and all("layer 2" in e.reason for e in failed_loads)
    assert not {e.transfer for e in d_events if isinstance(e, ev.TgtPartDone)} & streams


def gated_pair(model: Path, logs: Path, **decode: object) -> tuple[list[h.VLLMServer], Path]:
    """A pair whose P holds the first post of layer 2 of a stream until its cancel reached P (``fault_site``)."""
    trace = logs / "p-stream-trace.txt"
    env = {"PYTHONPATH": os.pathsep.join([str(FAULT_SITE), os.environ.get("PYTHONPATH", "")]),
           "KVL_TEST_STREAM_GATE_LAYER": "2", "KVL_TEST_STREAM_TRACE": str(trace)}
    return layerwise_pair(model, logs, p_env=env, **decode), trace


def trace_lines(trace: Path) -> list[list[str]]:
    return [line.split() for line in trace.read_text().splitlines()] if trace.exists() else []


def wait_for(what: str, fn, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.1)


def test_the_client_disconnecting_mid_stream_stops_p_and_frees_both_sides_after_the_writes(
        tiny_model: Path, tmp_path: Path) -> None:
    """D aborts mid-stream (the client leaves the proxy while layers 0-1 have landed and P holds layer 2): no
    layer is posted after the cancel reached P, every write settled before P's blocks went back and before D freed
    its own, both ledgers end quiescent and replay clean; both sides serve the next request."""
    # D's stream timeout well past the client's cancel: on a loaded machine the abort may take seconds to reach
    # D's connector, and a timeout firing first would end the load without the cancel this test is about
    servers, trace = gated_pair(tiny_model, tmp_path, load_timeout_s=90.0)
    prefill, _decode, proxy = servers
    try:
        start_all(servers)
        client = http.client.HTTPConnection(h.HOST, proxy.port, timeout=60)
        body = h.completion_body(h.prompt_of_length(LONG, offset=31), MAX_TOKENS, stream=True)
        client.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        wait_for("P holds layer 2", lambda: any(line[0] == "gate" for line in trace_lines(trace)), 180)
        client.close()  # the client goes away while the stream is mid-way
        wait_for("P released the streamed request", lambda: any(line[0] == "release" for line in trace_lines(trace)),
                 120)
        prompt = h.prompt_of_length(40, offset=9)  # the next request: both sides still serve, the same text
        got = h.stream_completion(proxy.port, prompt, MAX_TOKENS, timeout_s=180)
        status, alone = h.post_json(prefill.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
        assert got.status == 200 and status == 200 and got.text == alone["choices"][0]["text"], got.text
    finally:
        for server in reversed(servers):
            server.stop()
    lines = trace_lines(trace)
    (stream,) = {line[1] for line in lines if line[0] == "gate"}
    mine = [line for line in lines if line[0] != "release" and line[1] == stream]
    cancelled = next(i for i, line in enumerate(mine) if line[0] == "cancel")
    posts = [line for line in mine if line[0] == "post"]
    assert posts and all(line[0] != "post" for line in mine[cancelled:]), mine  # nothing posted after the cancel
    assert {int(line[2]) for line in posts} == {0, 1}  # the layers before the held one
    first_release = next(line for line in lines if line[0] == "release")
    assert first_release[2] == "0", first_release  # no write in flight when P's blocks went back
    events = tmp_path / "events"
    sources, targets = event_dirs(events, "source"), event_dirs(events, "target")
    rc, report = replay_json(*sources, *targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    d_events = [e for t in targets for e in read_events(t)]
    at = {id(e): i for i, e in enumerate(d_events)}
    landed = [e for e in d_events if isinstance(e, ev.TgtLayersLanded) and e.transfer == stream]
    (failed,) = [e for e in d_events if isinstance(e, ev.TgtLoadFailed) and e.transfer == stream]
    started = next(e for e in d_events if isinstance(e, ev.TgtLoadStarted) and e.transfer == stream)
    # the proxy cancels on D and P at once: D's abort, or P's (its "failed" note) reaching D first, ended the load
    assert any(isinstance(e, ev.TgtCancelled) and e.request == started.request for e in d_events) \
        or "aborted on P" in failed.reason, failed
    assert len(landed) == len(posts) and all(at[id(e)] < at[id(failed)] for e in landed)  # landed, then freed
    assert not failed.recompute
    p_writes = [e for s in sources for e in read_events(s)
                if isinstance(e, ev.TransferObserved) and e.transfer == stream]
    assert len(p_writes) == len(posts) and all(w.ok for w in p_writes)  # every write settled on P


def test_p_killed_mid_stream_d_times_the_stream_out_and_recomputes(tiny_model: Path, tmp_path: Path) -> None:
    """P killed (SIGKILL) while it holds layer 2 of a stream: D sees no layer for its stream timeout, fails the load
    under policy ``recompute`` (the reservation goes back for D's own prefill), answers the client the text a
    single instance gives, and its log replays clean and quiescent: nothing leaked on D."""
    servers, trace = gated_pair(tiny_model, tmp_path, policy="recompute", load_timeout_s=10.0)
    prefill, decode, proxy = servers
    prompt = h.prompt_of_length(LONG, offset=47)
    try:
        start_all(servers)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(h.stream_completion, proxy.port, prompt, MAX_TOKENS, 240)
            wait_for("P holds layer 2", lambda: any(line[0] == "gate" for line in trace_lines(trace)), 180)
            prefill.kill()
            got = answer.result(timeout=300)
        status, alone = h.post_json(decode.port, "/v1/completions", h.completion_body(prompt, MAX_TOKENS))
        assert got.status == 200 and status == 200, (got, alone)
        assert got.text == alone["choices"][0]["text"]
    finally:
        for server in reversed(servers):
            server.stop()
    (stream,) = {line[1] for line in trace_lines(trace) if line[0] == "gate"}
    targets = event_dirs(tmp_path / "events", "target")
    rc, report = replay_json(*targets, quiescent=True)
    assert rc == 0 and report["ok"], report.get("violations", report)
    d_events = [e for t in targets for e in read_events(t)]
    (failed,) = [e for e in d_events if isinstance(e, ev.TgtLoadFailed) and e.transfer == stream]
    assert failed.recompute and "timed out" in failed.reason, failed
    assert not any(isinstance(e, ev.TgtPartDone) and e.transfer == stream for e in d_events)
