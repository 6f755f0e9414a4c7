"""P/D on real vLLM (CPU): vLLM's own NixlConnector vs KVLifecycleConnector, side by side in one run.

Same workload for both: a tiny random Llama, ``--requests`` distinct prompts of ``--prompt-tokens`` tokens, greedy,
``--output-tokens`` tokens each, sent one at a time through ``kvlifecycle proxy``; P pinned to core 0, D to core 1.
Prints TTFT and end-to-end medians, their ratio (KVLifecycle / NIXL; goal ≤ 1.0), whether the outputs were equal
(to each other and to a single instance of the model), and the idle CPU of each P/D pair. Not a test: no
assertions on speed. Run it through bench/vllm_pd.sh.

``--layerwise`` instead runs pull after the prefill, push after the prefill and layer-wise streaming side by side
(``--prompt-lengths 512,1500,4000``), with TTFT, T_visible and where TTFT goes per mode (bench/vllm_pd_layerwise.py).

``--verify all`` instead runs KVLifecycleConnector P/D without and with per-block digests side by side (TTFT,
e2e and their ratios, and the blocks D's log says it checked).

``--tp-shapes 2x2,2x1,1x2`` (P TP x D TP) instead runs KVLifecycleConnector P/D at those tensor-parallel sizes
(a TP 2 server binds rank i to core i, so P and D share both cores) and, in the same run, a single TP 1 instance
on the same two cores: per shape ``outputs_equal`` (to the single instance), TTFT and end-to-end medians, and the
TTFT ratio P/D / single.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "vllm"))

import vllm_harness as h

from kvlifecycle.tools.progress import progress

P_CORES, D_CORES = [0], [1]


def connector_config(kind: str, role: str, side_port: int, log_dir: Path, verify: str = "none") -> dict:
    if kind == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                "kv_load_failure_policy": "fail"}
    return {"kv_connector": "KVLifecycleConnector", "kv_connector_module_path": "kvlifecycle.adapters.vllm",
            "kv_role": role, "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"side_channel_port": side_port, "log_dir": str(log_dir / "events" / kind),
                                          "verify": verify}}


def idle_cpu(servers: list[h.VLLMServer], seconds: float) -> list[float]:
    """Cores used by each server's process tree while it serves nothing."""
    assert all(s.proc is not None for s in servers)
    before = [h.process_cpu_seconds(s.proc.pid) for s in servers]  # type: ignore[union-attr]
    time.sleep(seconds)
    after = [h.process_cpu_seconds(s.proc.pid) for s in servers]  # type: ignore[union-attr]
    return [round((b - a) / seconds, 3) for a, b in zip(before, after, strict=True)]


def run_pair(kind: str, model: Path, prompts: list[str], output_tokens: int, log_dir: Path,
             idle_s: float, verify: str = "none") -> dict:
    side = h.free_port_pair()
    p_port, d_port, proxy_port = h.free_port(), h.free_port(), h.free_port()
    env_p = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    env_d = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(h.free_port_pair())}
    prefill = h.vllm_server(f"{kind}-prefill", model, p_port, log_dir, cores=P_CORES, extra_env=env_p,
                            kv_transfer_config=connector_config(kind, "kv_producer", side, log_dir, verify))
    decode = h.vllm_server(f"{kind}-decode", model, d_port, log_dir, cores=D_CORES, extra_env=env_d,
                           kv_transfer_config=connector_config(kind, "kv_consumer", side, log_dir, verify))
    proxy = h.proxy_process(proxy_port, [prefill.url], [decode.url], log_dir)
    servers = [prefill, decode, proxy]
    started = time.perf_counter()
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        startup_s = time.perf_counter() - started
        h.stream_completion(proxy_port, h.prompt_of_length(len(prompts[0].split()), offset=99991), output_tokens)
        results = [h.stream_completion(proxy_port, prompt, output_tokens, timeout_s=300) for prompt in prompts]
        bad = [r for r in results if r.status != 200 or not r.text]  # an error mid-stream leaves no text
        if bad:
            raise RuntimeError(f"{kind}: {len(bad)} request(s) failed ({bad[0].status}: {bad[0].text[:300]!r}); "
                               f"decode log tail:\n{decode.log_tail(15)}")
        time.sleep(1.0)  # let the last request's lease settle before measuring idle
        cpu_p, cpu_d = idle_cpu([prefill, decode], idle_s)
        return {
            "ttft_ms": round(1000 * statistics.median(r.ttft_s for r in results), 1),
            "e2e_ms": round(1000 * statistics.median(r.e2e_s for r in results), 1),
            "ttft_ms_all": [round(1000 * r.ttft_s, 1) for r in results],
            "outputs": [r.text for r in results],
            "idle_cpu_cores": {"prefill": cpu_p, "decode": cpu_d, "pair": round(cpu_p + cpu_d, 3)},
            "startup_s": round(startup_s, 1),
        }
    finally:
        for server in reversed(servers):
            server.stop()


def tp_server(name: str, model: Path, tp: int, log_dir: Path, **kwargs: object) -> h.VLLMServer:
    """TP 1 on core 0 (P) or 1 (D) as in the pair runs; TP 2 with rank i on core i."""
    if tp == 1:
        cores = P_CORES if name.endswith("prefill") else D_CORES
        return h.vllm_server(name, model, h.free_port(), log_dir, cores=cores, **kwargs)  # type: ignore[arg-type]
    return h.vllm_server(name, model, h.free_port(), log_dir, extra_args=["--tensor-parallel-size", str(tp)],
                         extra_env={"VLLM_CPU_OMP_THREADS_BIND": "|".join(map(str, range(tp)))},
                         **kwargs)  # type: ignore[arg-type]


def serve_prompts(servers: list[h.VLLMServer], port: int, prompts: list[str], output_tokens: int,
                  what: str, allow_failures: bool = False) -> dict:
    """Start ``servers``, warm up once, stream every prompt through ``port``; stop them. Medians (over the requests
    that answered) and outputs; ``allow_failures``: count failed requests (``failed``) instead of raising."""
    started = time.perf_counter()
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready(600)
        startup_s = time.perf_counter() - started
        h.stream_completion(port, h.prompt_of_length(len(prompts[0].split()), offset=99991), output_tokens)
        results = [h.stream_completion(port, prompt, output_tokens, timeout_s=300) for prompt in prompts]
        bad = [r for r in results if r.status != 200 or not r.text]  # an error mid-stream leaves no text
        if bad and (not allow_failures or len(bad) == len(results)):
            raise RuntimeError(f"{what}: {len(bad)} request(s) failed ({bad[0].status}: {bad[0].text[:300]!r})")
        good = [r for r in results if r not in bad]
        return {
            "ttft_ms": round(1000 * statistics.median(r.ttft_s for r in good), 1),
            "e2e_ms": round(1000 * statistics.median(r.e2e_s for r in good), 1),
            "outputs": [r.text for r in results],
            "failed": len(bad),
            "startup_s": round(startup_s, 1),
        }
    finally:
        for server in reversed(servers):
            server.stop()


def run_tp_shapes(shapes: list[tuple[int, int]], model: Path, prompts: list[str], output_tokens: int,
                  log_dir: Path) -> dict:
    single_server = h.vllm_server("single-2cores", model, h.free_port(), log_dir, cores=P_CORES + D_CORES)
    single = serve_prompts([single_server], single_server.port, prompts, output_tokens, "single")
    report: dict = {"single_ttft_ms": single["ttft_ms"], "single_e2e_ms": single["e2e_ms"], "shapes": {}}
    for p_tp, d_tp in shapes:
        side = h.free_port_pair()
        shape_dir = log_dir / f"p{p_tp}-d{d_tp}"
        # generous side-channel bounds, as in tests/vllm/test_vllm_tp.py: with P and D sharing both cores a rank's
        # connector threads can go seconds without a core (5 s handshakes, 30 s and 60 s leases were seen to expire)
        config = {"side_channel_port": side, "log_dir": str(shape_dir / "events"), "decode_tp_size": d_tp,
                  "handshake_timeout_s": 30.0, "grant_wait_s": 30.0, "lease_ttl_s": 120.0}
        kv = {"kv_connector": "KVLifecycleConnector", "kv_connector_module_path": "kvlifecycle.adapters.vllm",
              "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail", "kv_connector_extra_config": config}
        prefill = tp_server("prefill", model, p_tp, shape_dir, kv_transfer_config={**kv, "kv_role": "kv_producer"})
        decode = tp_server("decode", model, d_tp, shape_dir, kv_transfer_config={**kv, "kv_role": "kv_consumer"})
        proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], shape_dir)
        pd = serve_prompts([prefill, decode, proxy], proxy.port, prompts, output_tokens, f"P TP {p_tp} D TP {d_tp}",
                           allow_failures=True)
        report["shapes"][f"p{p_tp}-d{d_tp}"] = {
            "outputs_equal": pd["outputs"] == single["outputs"],
            "failed_requests": pd["failed"],
            "ttft_ms": pd["ttft_ms"],
            "e2e_ms": pd["e2e_ms"],
            "ratio_ttft_vs_single": round(pd["ttft_ms"] / single["ttft_ms"], 3),
            "startup_s": pd["startup_s"],
        }
    return report


def single_outputs(model: Path, prompts: list[str], output_tokens: int, log_dir: Path) -> list[str]:
    server = h.vllm_server("single", model, h.free_port(), log_dir, cores=P_CORES)
    try:
        server.start().wait_ready(600)
        out = []
        for prompt in prompts:
            status, body = h.post_json(server.port, "/v1/completions", h.completion_body(prompt, output_tokens))
            if status != 200:
                raise RuntimeError(f"single instance: {body}")
            out.append(body["choices"][0]["text"])
        return out
    finally:
        server.stop()


def _verify_cost(args: argparse.Namespace) -> int:
    """``--verify MODE``: KVLifecycleConnector P/D without and with per-block digests, side by side: TTFT and
    end-to-end medians, their ratios (verified / unverified), outputs equal, and the blocks D's log says it
    checked (each part's ``TgtPartDone.verified``)."""
    from kvlifecycle import events as ev
    from kvlifecycle.eventlog import read_events

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvl-bench-vllm-verify-"))
    model = h.build_tiny_model(Path(args.model_cache))
    prompts = [h.prompt_of_length(args.prompt_tokens, offset=1 + 131 * i) for i in range(args.requests)]
    with progress("vLLM P/D verify", 2, json_output=args.json) as tick:
        plain = run_pair("kvl", model, prompts, args.output_tokens, log_dir, args.idle_seconds)
        tick("unverified pair")
        checked = run_pair("kvl-verify", model, prompts, args.output_tokens, log_dir, args.idle_seconds,
                           verify=args.verify)
        tick(f"verify: {args.verify} pair")
    verified = sum(e.verified for target in h.event_dirs(log_dir / "events" / "kvl-verify", "target")
                   for e in read_events(target) if isinstance(e, ev.TgtPartDone))
    report = {
        "requests": args.requests, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "verify": args.verify,
        "ttft_ms_unverified": plain["ttft_ms"], "ttft_ms_verified": checked["ttft_ms"],
        "ratio_ttft_verify": round(checked["ttft_ms"] / plain["ttft_ms"], 3),
        "e2e_ms_unverified": plain["e2e_ms"], "e2e_ms_verified": checked["e2e_ms"],
        "ratio_e2e_verify": round(checked["e2e_ms"] / plain["e2e_ms"], 3),
        "outputs_equal": plain["outputs"] == checked["outputs"],
        "verified_blocks": verified,
        "log_dir": str(log_dir),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"vLLM P/D on CPU, verify: {args.verify}: TTFT median {plain['ttft_ms']} -> {checked['ttft_ms']} ms "
          f"({report['ratio_ttft_verify']} x), e2e median {plain['e2e_ms']} -> {checked['e2e_ms']} ms "
          f"({report['ratio_e2e_verify']} x); outputs equal {report['outputs_equal']}; {verified} block(s) checked")
    return 0


def _slow_decode(args: argparse.Namespace) -> int:
    import vllm_pd_staging as stg

    if not args.staging:
        raise SystemExit("--slow-decode runs staging off and on side by side: pass --staging")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvl-bench-vllm-staging-"))
    workload = stg.Workload(requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                            fast_output_tokens=args.fast_output_tokens, p_blocks=args.p_kv_blocks,
                            stage_after_ms=args.stage_after_ms, pool_blocks=args.staging_pool_blocks)
    with progress("vLLM P/D slow decode", 4, json_output=args.json) as tick:
        report = stg.run(Path(args.model_cache), workload, log_dir, tick)
    if args.json:
        print(json.dumps(report))
    else:
        stg.print_report(report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--requests", type=int, default=None, help="default 8 (24 with --slow-decode)")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 32 (128 with --slow-decode)")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--model-cache", default=os.environ.get("KVL_MODEL_CACHE",
                                                                 str(Path.home() / ".cache/kvlifecycle/models")))
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary directory)")
    parser.add_argument("--skip-single", action="store_true", help="do not compare with a single instance")
    parser.add_argument("--tp-shapes", default="", help="P/D TP shapes to run instead, e.g. 2x2,2x1,1x2")
    parser.add_argument("--layerwise", action="store_true", help="pull, push and layer-wise streaming instead")
    parser.add_argument("--prompt-lengths", default="512", help="--layerwise: prompt lengths, e.g. 512,1500,4000")
    parser.add_argument("--slow-decode", action="store_true",
                        help="P's prefill throughput under a slow D, against a fast D (bench/vllm_pd_staging.py)")
    parser.add_argument("--verify", choices=("none", "sample", "all"), default="none",
                        help="KVLifecycleConnector without and with per-block digests instead, side by side")
    parser.add_argument("--staging", action="store_true",
                        help="--slow-decode: also with P's host staging tier on (the runs without it are kept)")
    parser.add_argument("--fast-output-tokens", type=int, default=4, help="--slow-decode: the fast D's outputs")
    parser.add_argument("--p-kv-blocks", type=int, default=16, help="--slow-decode: P's KV pool (blocks of 128)")
    parser.add_argument("--stage-after-ms", type=float, default=10.0, help="--slow-decode --staging")
    parser.add_argument("--staging-pool-blocks", type=int, default=128, help="--slow-decode --staging")
    args = parser.parse_args(argv)
    if args.requests is None:  # a slow-decode run of 8 lasts half a second: too short to rank (docs/vllm.md)
        args.requests = 24 if args.slow_decode else 8
    if args.output_tokens is None:  # the slow D's outputs: long enough that D lags P
        args.output_tokens = 128 if args.slow_decode else 32
    if args.staging and not args.slow_decode:
        parser.error("--staging goes with --slow-decode")
    if args.slow_decode:
        return _slow_decode(args)
    if args.verify != "none":
        return _verify_cost(args)
    if args.layerwise:
        import vllm_pd_layerwise as lw

        log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvl-bench-vllm-layerwise-"))
        lengths = [int(n) for n in args.prompt_lengths.split(",")]
        report = lw.run(Path(args.model_cache), lengths, args.requests, args.output_tokens, log_dir)
        if args.json:
            print(json.dumps(report))
        else:
            lw.print_report(report)
        return 0
    if args.requests < 5:
        parser.error("--requests must be at least 5")

    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvl-bench-vllm-"))
    model = h.build_tiny_model(Path(args.model_cache))
    prompts = [h.prompt_of_length(args.prompt_tokens, offset=1 + 131 * i) for i in range(args.requests)]
    if args.tp_shapes:
        shapes = [tuple(int(x) for x in shape.split("x")) for shape in args.tp_shapes.split(",")]
        tp_report = run_tp_shapes(shapes, model, prompts, args.output_tokens, log_dir)  # type: ignore[arg-type]
        tp_report.update(requests=args.requests, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
                         log_dir=str(log_dir))
        if args.json:
            print(json.dumps(tp_report))
            return 0
        print(f"vLLM P/D TP shapes on CPU: {args.requests} requests x {args.prompt_tokens} prompt tokens -> "
              f"{args.output_tokens} tokens; single TP 1 instance on cores {P_CORES + D_CORES}: TTFT median "
              f"{tp_report['single_ttft_ms']} ms")
        for name, shape in tp_report["shapes"].items():
            print(f"{name}: outputs equal {shape['outputs_equal']} ({shape['failed_requests']} failed), TTFT median "
                  f"{shape['ttft_ms']} ms "
                  f"({shape['ratio_ttft_vs_single']} x single), e2e median {shape['e2e_ms']} ms")
        return 0
    with progress("vLLM P/D", 2 + (not args.skip_single), json_output=args.json) as tick:
        nixl = run_pair("nixl", model, prompts, args.output_tokens, log_dir, args.idle_seconds)
        tick("NixlConnector pair")
        kvl = run_pair("kvl", model, prompts, args.output_tokens, log_dir, args.idle_seconds)
        tick("KVLifecycleConnector pair")
        single = None if args.skip_single else single_outputs(model, prompts, args.output_tokens, log_dir)
        tick("single instance")
    report = {
        "requests": args.requests,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "ttft_ms_nixl": nixl["ttft_ms"],
        "ttft_ms_kvl": kvl["ttft_ms"],
        "ratio_ttft": round(kvl["ttft_ms"] / nixl["ttft_ms"], 3),
        "e2e_ms_nixl": nixl["e2e_ms"],
        "e2e_ms_kvl": kvl["e2e_ms"],
        "ratio_e2e": round(kvl["e2e_ms"] / nixl["e2e_ms"], 3),
        "outputs_equal": nixl["outputs"] == kvl["outputs"],
        "outputs_equal_single": None if single is None else (kvl["outputs"] == single == nixl["outputs"]),
        "idle_cpu_cores_nixl": nixl["idle_cpu_cores"],
        "idle_cpu_cores_kvl": kvl["idle_cpu_cores"],
        "ttft_ms_all_nixl": nixl["ttft_ms_all"],
        "ttft_ms_all_kvl": kvl["ttft_ms_all"],
        "startup_s": {"nixl": nixl["startup_s"], "kvl": kvl["startup_s"]},
        "cores": {"prefill": P_CORES, "decode": D_CORES},
        "log_dir": str(log_dir),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"vLLM P/D on CPU: {args.requests} requests x {args.prompt_tokens} prompt tokens -> "
          f"{args.output_tokens} tokens, P on core {P_CORES}, D on core {D_CORES}")
    print(f"{'':24}{'NixlConnector':>16}{'KVLifecycle':>16}{'ratio':>9}")
    print(f"{'TTFT median (ms)':24}{nixl['ttft_ms']:>16}{kvl['ttft_ms']:>16}{report['ratio_ttft']:>9}")
    print(f"{'end-to-end median (ms)':24}{nixl['e2e_ms']:>16}{kvl['e2e_ms']:>16}{report['ratio_e2e']:>9}")
    print(f"{'idle CPU P+D (cores)':24}{nixl['idle_cpu_cores']['pair']:>16}{kvl['idle_cpu_cores']['pair']:>16}")
    print(f"outputs equal (NIXL vs KVLifecycle): {report['outputs_equal']}; "
          f"all equal to a single instance: {report['outputs_equal_single']}")
    print(f"server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
