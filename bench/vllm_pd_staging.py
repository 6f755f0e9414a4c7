"""``bench/vllm_pd.sh --slow-decode --staging``: P's prefill throughput when D is slow, with P's host staging tier off
and on, side by side in one run, on real vLLM (CPU, tiny random Llama, float32).

Setup: P on core 0 with a small KV pool (``--num-gpu-blocks-override``, default 16 blocks of 128 tokens, with
``--max-model-len 1024`` so that vLLM accepts so few: three 512-token requests), D on core 1 serving one request
at a time (``--max-num-seqs 1``). D claims a request's lease only once its scheduler admits the request, so while
D decodes one request's long output the others' KV stays pinned on P, unclaimed. The bench drives P and D as the
proxy does (P's prefill with ``max_tokens`` 1, then D with P's ``kv_transfer_params``), ``--requests`` at once,
each on its own thread.

Runs (each P started afresh, one D for all of them):

- fast D: P without staging, D asked for ``--fast-output-tokens`` (it claims each lease within moments);
- slow D without staging: D asked for ``--output-tokens``; P holds pinned blocks until D gets to each request;
- slow D with staging: P stages a lease left unclaimed ``--stage-after-ms`` into its host pool and gives the GPU
  blocks back to vLLM once the copy is whole.

P's prefill throughput: requests / (last prefill answered - first request sent). TTFT: the median time to P's
answer (its first token). Preemptions and pinned-block-seconds: P's ``/metrics`` (``vllm:num_preemptions``,
``vllm:kvlifecycle_pinned_block_seconds``). Outputs: every D answer against a single instance of the model.
Not a test: nothing asserts on speed.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import vllm_harness as h

P_CORES, D_CORES = [0], [1]


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int
    output_tokens: int  # slow D
    fast_output_tokens: int
    p_blocks: int
    stage_after_ms: float
    pool_blocks: int

    def prompts(self) -> list[str]:
        return [h.prompt_of_length(self.prompt_tokens, offset=20000 + 173 * i) for i in range(self.requests)]


@dataclass
class Outcome:
    sent: float = 0.0
    prefilled: float = 0.0
    text: str = ""
    error: str = ""
    events: list[str] = field(default_factory=list)


def _kv_config(role: str, side: int, log_dir: Path, staging: dict[str, Any] | None) -> dict:
    extra: dict[str, Any] = {"side_channel_port": side, "log_dir": str(log_dir / "events"), "lease_ttl_s": 120.0,
                             "grant_wait_s": 60.0, "load_timeout_s": 120.0}
    extra.update(staging or {})
    return {"kv_connector": "KVLifecycleConnector", "kv_connector_module_path": "kvlifecycle.adapters.vllm",
            "kv_role": role, "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": extra}


def _one(p_port: int, d_port: int, prompt: str, output_tokens: int, out: Outcome) -> None:
    out.sent = time.perf_counter()
    body = h.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    status, answer = h.post_json(p_port, "/v1/completions", body, timeout_s=600)
    out.prefilled = time.perf_counter()
    if status != 200:
        out.error = f"P answered {status}: {answer}"
        return
    status, answer = h.post_json(d_port, "/v1/completions",
                                 h.completion_body(prompt, output_tokens,
                                                   kv_transfer_params=answer["kv_transfer_params"]), timeout_s=600)
    if status != 200:
        out.error = f"D answered {status}: {answer}"
        return
    out.text = answer["choices"][0]["text"]


def _stream(p: h.VLLMServer, d: h.VLLMServer, prompts: list[str], output_tokens: int) -> dict[str, Any]:
    """Every prompt at once, each through P then D on its own thread; P's prefill throughput and TTFT."""
    outcomes = [Outcome() for _ in prompts]
    threads = [threading.Thread(target=_one, args=(p.port, d.port, prompt, output_tokens, o), daemon=True)
               for prompt, o in zip(prompts, outcomes, strict=True)]
    pinned_before = sum(h.metric_values(p.port, "vllm:kvlifecycle_pinned_block_seconds_total"))
    preempted_before = sum(h.metric_values(p.port, "vllm:num_preemptions_total"))
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    failed = [o.error or "no answer" for o in outcomes if o.error or not o.text]
    if failed:
        raise RuntimeError(f"{len(failed)} request(s) failed: {failed[0][:400]}\nP:\n{p.log_tail(15)}\n"
                           f"D:\n{d.log_tail(15)}")
    first_sent = min(o.sent for o in outcomes)
    span = max(o.prefilled for o in outcomes) - first_sent
    time.sleep(2.0)  # the last step's stats reach P's API server with its next output
    return {
        "prefill_throughput_rps": round(len(prompts) / span, 3),
        "prefill_span_s": round(span, 2),
        "ttft_ms_median": round(1000 * statistics.median(o.prefilled - o.sent for o in outcomes), 1),
        "ttft_ms_max": round(1000 * max(o.prefilled - o.sent for o in outcomes), 1),
        "preemptions": int(sum(h.metric_values(p.port, "vllm:num_preemptions_total")) - preempted_before),
        "pinned_block_seconds": round(
            sum(h.metric_values(p.port, "vllm:kvlifecycle_pinned_block_seconds_total")) - pinned_before, 2),
        "staged_blocks": int(sum(h.metric_values(p.port, "vllm:kvlifecycle_num_staged_blocks_total"))),
        "outputs": [o.text for o in outcomes],
    }


def _prefill_server(name: str, model: Path, log_dir: Path, side: int, w: Workload, staging: bool) -> h.VLLMServer:
    policy = ({"stage_when": "after", "stage_after_ms": w.stage_after_ms, "staging_pool_blocks": w.pool_blocks}
              if staging else None)
    return h.vllm_server(name, model, h.free_port(), log_dir, cores=P_CORES, log_stats=True,
                         extra_args=["--num-gpu-blocks-override", str(w.p_blocks), "--max-model-len", "1024"],
                         kv_transfer_config=_kv_config("kv_producer", side, log_dir, policy))


def _references(model: Path, log_dir: Path, prompts: list[str], lengths: tuple[int, ...]) -> dict[int, list[str]]:
    server = h.vllm_server("single", model, h.free_port(), log_dir, cores=P_CORES)
    try:
        server.start().wait_ready(600)
        refs: dict[int, list[str]] = {}
        for n in lengths:
            refs[n] = []
            for prompt in prompts:
                status, body = h.post_json(server.port, "/v1/completions", h.completion_body(prompt, n))
                if status != 200:
                    raise RuntimeError(f"single instance: {body}")
                refs[n].append(body["choices"][0]["text"])
        return refs
    finally:
        server.stop()


def run(model_cache: Path, w: Workload, log_dir: Path, tick: Any = None) -> dict[str, Any]:
    model = h.build_tiny_model(model_cache)
    prompts = w.prompts()
    # D finds each P at the address in P's kv_transfer_params: every P gets side-channel ports of its own
    decode = h.vllm_server("decode", model, h.free_port(), log_dir, cores=D_CORES,
                           extra_args=["--max-num-seqs", "1"],
                           kv_transfer_config=_kv_config("kv_consumer", h.free_port_pair(), log_dir, None))
    runs: dict[str, dict[str, Any]] = {}
    try:
        for name, staging, tokens in (("fast_d", False, w.fast_output_tokens),
                                      ("slow_d_no_staging", False, w.output_tokens),
                                      ("slow_d_staging", True, w.output_tokens)):
            run_dir = log_dir / name
            prefill = _prefill_server(f"prefill-{name}", model, run_dir, h.free_port_pair(), w, staging)
            servers = [prefill] if decode.alive else [prefill, decode]
            h.start_all(servers, timeout_s=600)
            try:
                runs[name] = _stream(prefill, decode, prompts, tokens)
            finally:
                prefill.stop()
            if tick is not None:
                tick(name)
    finally:
        decode.stop()
    refs = _references(model, log_dir, prompts, (w.fast_output_tokens, w.output_tokens))
    if tick is not None:
        tick("single instance")
    fast, off, on = runs["fast_d"], runs["slow_d_no_staging"], runs["slow_d_staging"]
    return {
        "prefill_throughput_ratio_staging": round(on["prefill_throughput_rps"] / fast["prefill_throughput_rps"], 3),
        "prefill_throughput_ratio_no_staging": round(off["prefill_throughput_rps"] / fast["prefill_throughput_rps"],
                                                     3),
        "preemptions_staging": on["preemptions"],
        "preemptions_no_staging": off["preemptions"],
        "outputs_equal": (fast["outputs"] == refs[w.fast_output_tokens] and off["outputs"] == refs[w.output_tokens]
                          and on["outputs"] == refs[w.output_tokens]),
        "ttft_ms_median": {name: r["ttft_ms_median"] for name, r in runs.items()},
        "ttft_ms_max": {name: r["ttft_ms_max"] for name, r in runs.items()},
        "prefill_throughput_rps": {name: r["prefill_throughput_rps"] for name, r in runs.items()},
        "pinned_block_seconds": {name: r["pinned_block_seconds"] for name, r in runs.items()},
        "staged_blocks_staging": on["staged_blocks"],
        "requests": w.requests, "prompt_tokens": w.prompt_tokens, "output_tokens": w.output_tokens,
        "fast_output_tokens": w.fast_output_tokens, "p_kv_blocks": w.p_blocks, "stage_after_ms": w.stage_after_ms,
        "staging_pool_blocks": w.pool_blocks, "cores": {"prefill": P_CORES, "decode": D_CORES},
        "log_dir": str(log_dir),
    }


def print_report(r: dict[str, Any]) -> None:
    print(f"vLLM P/D on CPU with a slow D: {r['requests']} requests x {r['prompt_tokens']} prompt tokens at once, "
          f"P KV pool {r['p_kv_blocks']} blocks, D one request at a time ({r['output_tokens']} output tokens; fast D "
          f"{r['fast_output_tokens']}), stage after {r['stage_after_ms']} ms into {r['staging_pool_blocks']} slots")
    print(f"{'':28}{'fast D':>12}{'slow D':>12}{'slow D+stg':>12}")
    names = ("fast_d", "slow_d_no_staging", "slow_d_staging")
    for label, key in (("prefill throughput (req/s)", "prefill_throughput_rps"), ("TTFT median (ms)", "ttft_ms_median"),
                       ("TTFT max (ms)", "ttft_ms_max"), ("pinned block-seconds", "pinned_block_seconds")):
        print(f"{label:28}" + "".join(f"{r[key][n]:>12}" for n in names))
    print(f"throughput vs fast D: staging {r['prefill_throughput_ratio_staging']}, no staging "
          f"{r['prefill_throughput_ratio_no_staging']}; preemptions: staging {r['preemptions_staging']}, no staging "
          f"{r['preemptions_no_staging']}; staged blocks {r['staged_blocks_staging']}; "
          f"outputs equal a single instance: {r['outputs_equal']}")
    print(f"server logs: {r['log_dir']}")
