"""``bench/vllm_pd.sh --layerwise``: pull after the prefill, push after the prefill and layer-wise streaming side by
side in one run, on real vLLM (CPU, float32), with a single instance on P's core as the reference.

Model: a random Llama of 8 layers, 8 KV heads of head size 128 (64 KiB of KV per token in float32), so the
transfer is not negligible next to the prefill on this CPU. Per prompt length and mode: TTFT medians, T_visible
(P's last layer computed → D's blocks READY_FOR_ATTENTION) and where TTFT goes, read from both event logs.

Where the times come from: the bench, the ledgers and the servers share the host's monotonic clock (the ledgers'
``at``). Per request, in order: ``send`` (the bench sends it), D reserves (``TgtReserved``), D starts the load
(``TgtLoadStarted``: after the grant was fetched and claimed, or, streaming, when D's reservation left for P), D's
blocks READY (the last ``TgtPartDone``), the first token at the bench. P's side: the grant (``SrcGranted``, one
scheduler step after P's last layer: the post-prefill paths' "prefill done") and, streaming, each layer's WRITE
(``TransferObserved``: it settled at ``at``, was posted ``t_xfer_s`` earlier, right after its layer returned).
T_visible: pull/push from P's grant (an upper bound: the grant follows the last layer by one scheduler step),
streaming from the post of P's last layer. Not a test: nothing asserts on speed.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import vllm_harness as h

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events

SHAPE = {"hidden_size": 1024, "intermediate_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 8, "max_position_embeddings": 8192}
P_CORES, D_CORES = [0], [1]
MODES = ("pull", "push", "stream")


def _config(role: str, mode: str, side: int, events: Path) -> dict:
    return {"kv_connector": "KVLifecycleConnector", "kv_connector_module_path": "kvlifecycle.adapters.vllm",
            "kv_role": role, "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"side_channel_port": side, "log_dir": str(events),
                                          "mode": "push" if mode == "push" else "pull"}}


SERVER_ARGS = ["--max-model-len", "8192", "--max-num-batched-tokens", "8192"]


def _serve(servers: list[h.VLLMServer], port: int, lengths: list[int], requests: int,
           output_tokens: int) -> dict[int, list[tuple[float, h.StreamResult]]]:
    """Start ``servers``, warm up, send ``requests`` prompts per length one at a time; (send time, result)."""
    out: dict[int, list[tuple[float, h.StreamResult]]] = {}
    try:
        h.start_all(servers, timeout_s=900)
        h.stream_completion(port, h.prompt_of_length(64, offset=99991), output_tokens, timeout_s=300)
        for length in lengths:
            runs = []
            for i in range(requests):
                sent = time.monotonic()
                result = h.stream_completion(port, h.prompt_of_length(length, offset=1 + 131 * i + length),
                                             output_tokens, timeout_s=600)
                if result.status != 200 or not result.text:
                    raise RuntimeError(f"{length} tokens: {result.status} {result.text[:300]!r}")
                runs.append((sent, result))
            out[length] = runs
    finally:
        for server in reversed(servers):
            server.stop()
    return out


def _loads(events: Path) -> tuple[list[dict[str, Any]], dict[str, list[ev.TransferObserved]], list[float]]:
    """D's loads in time order (reserved, started, ready, streamed), P's writes per transfer, P's grant times."""
    d_events = [e for d in h.event_dirs(events, "target") for e in read_events(d)]
    p_events = [e for p in h.event_dirs(events, "source") for e in read_events(p)]
    reserved: dict[str, float] = {}
    loads: dict[str, dict[str, Any]] = {}
    for e in sorted(d_events, key=lambda e: e.at):
        if isinstance(e, ev.TgtReserved):
            reserved[e.request] = e.at
        elif isinstance(e, ev.TgtLoadStarted):  # a declined stream's load never gets "ready": dropped below
            loads[e.transfer] = {"reserved": reserved.get(e.request, e.at), "started": e.at,
                                 "transfer": e.transfer, "streamed": bool(e.layers)}
        elif isinstance(e, ev.TgtPartDone) and e.transfer in loads:
            loads[e.transfer]["ready"] = e.at
    writes: dict[str, list[ev.TransferObserved]] = {}
    for e in p_events:
        if isinstance(e, ev.TransferObserved):
            writes.setdefault(e.transfer, []).append(e)
    grants = sorted(e.at for e in p_events if isinstance(e, ev.SrcGranted))
    return sorted((v for v in loads.values() if "ready" in v), key=lambda v: v["started"]), writes, grants


def _breakdown(mode: str, runs: list[tuple[float, h.StreamResult]], loads: list[dict[str, Any]],
               writes: dict[str, list[ev.TransferObserved]], grants: list[float]) -> dict[str, float]:
    """Median milliseconds per part of TTFT, and T_visible, over the requests of one length."""
    parts: dict[str, list[float]] = {}
    streamed = 0

    def add(name: str, seconds: float) -> None:
        parts.setdefault(name, []).append(1000 * seconds)

    for sent, result in runs:
        load = next((ld for ld in loads if ld["reserved"] >= sent - 1e-3), None)
        if load is None:
            continue
        loads.remove(load)
        first_token = sent + result.ttft_s
        add("to_d_reserved", load["reserved"] - sent)
        add("d_reserved_to_load_started", load["started"] - load["reserved"])
        add("load_started_to_ready", load["ready"] - load["started"])
        add("ready_to_first_token", first_token - load["ready"])
        if load["streamed"] and writes.get(load["transfer"]):
            streamed += 1
            posted = sorted(w.at - w.t_xfer_s for w in writes[load["transfer"]])
            last = max(writes[load["transfer"]], key=lambda w: w.at)
            # D's reservation left for P -> P's first layer posted: the proxy's submit to P, P's HTTP path and
            # scheduling, and layer 0 of the first step; first -> last post: the rest of P's forward
            add("load_started_to_first_post", posted[0] - load["started"])
            add("first_post_to_last_post", posted[-1] - posted[0])
            add("t_visible", load["ready"] - (last.at - last.t_xfer_s))
            add("stream_overlap", sum(w.t_xfer_s for w in writes[load["transfer"]]))
        elif mode != "stream":
            grant = next((g for g in grants if sent <= g <= load["started"] + 1e-3), None)
            if grant is not None:
                add("to_p_grant", grant - sent)
                add("p_grant_to_d_load_started", load["started"] - grant)
                add("t_visible", load["ready"] - grant)
    out: dict[str, float] = {name: round(statistics.median(values), 1) for name, values in parts.items()}
    if mode == "stream":  # the others: a reservation that came after P's prefill ended (the pull fallback)
        out["requests_streamed"] = streamed
    return out


def run(model_cache: Path, lengths: list[int], requests: int, output_tokens: int, log_dir: Path) -> dict[str, Any]:
    model = h.build_tiny_model(model_cache, overrides=SHAPE)
    single_server = h.vllm_server("single", model, h.free_port(), log_dir, cores=P_CORES, extra_args=SERVER_ARGS)
    single = _serve([single_server], single_server.port, lengths, requests, output_tokens)
    report: dict[str, Any] = {"model": SHAPE, "lengths": lengths, "requests": requests,
                              "output_tokens": output_tokens, "cores": {"prefill": P_CORES, "decode": D_CORES},
                              "per_length": {}, "log_dir": str(log_dir)}
    outputs = {"single": {n: [r.text for _, r in runs] for n, runs in single.items()}}
    measured: dict[str, dict[int, list[tuple[float, h.StreamResult]]]] = {}
    breakdowns: dict[str, dict[int, dict[str, float]]] = {}
    for mode in MODES:
        mode_dir = log_dir / mode
        events, side = mode_dir / "events", h.free_port_pair()
        prefill = h.vllm_server("prefill", model, h.free_port(), mode_dir, cores=P_CORES, extra_args=SERVER_ARGS,
                                kv_transfer_config=_config("kv_producer", mode, side, events))
        decode = h.vllm_server("decode", model, h.free_port(), mode_dir, cores=D_CORES, extra_args=SERVER_ARGS,
                               kv_transfer_config=_config("kv_consumer", mode, side, events))
        extra = ["--layerwise", f"{h.HOST}:{side}"] if mode == "stream" else []
        proxy = h.proxy_process(h.free_port(), [prefill.url], [decode.url], mode_dir, extra_args=extra)
        measured[mode] = _serve([prefill, decode, proxy], proxy.port, lengths, requests, output_tokens)
        outputs[mode] = {n: [r.text for _, r in runs] for n, runs in measured[mode].items()}
        try:  # the measurements stand even if the logs cannot be read
            loads, writes, grants = _loads(events)
            first = min(s for runs in measured[mode].values() for s, _ in runs)
            loads = [ld for ld in loads if ld["reserved"] >= first - 1e-3]
            breakdowns[mode] = {n: _breakdown(mode, runs, loads, writes, grants) for n, runs in measured[mode].items()}
        except Exception as exc:  # reported in the JSON, next to the TTFTs it does not affect
            breakdowns[mode] = {n: {"error": repr(exc)} for n in lengths}
    for n in lengths:
        row: dict[str, Any] = {"ttft_ms_single": _median_ttft(single[n])}
        for mode in MODES:
            row[f"ttft_ms_{mode}"] = _median_ttft(measured[mode][n])
            row[f"t_visible_ms_{mode}"] = breakdowns[mode][n].get("t_visible")
            row[f"ratio_ttft_{mode}_vs_single"] = round(row[f"ttft_ms_{mode}"] / row["ttft_ms_single"], 3)
            row[f"breakdown_ms_{mode}"] = breakdowns[mode][n]
        row["outputs_equal"] = all(outputs[m][n] == outputs["single"][n] for m in MODES)
        report["per_length"][str(n)] = row
    longest = report["per_length"][str(max(lengths))]
    report.update({key: longest[key] for key in ("ttft_ms_single", "ttft_ms_pull", "ttft_ms_push", "ttft_ms_stream",
                                                  "t_visible_ms_pull", "t_visible_ms_push", "t_visible_ms_stream")})
    report["outputs_equal"] = all(row["outputs_equal"] for row in report["per_length"].values())
    return report


def _median_ttft(runs: list[tuple[float, h.StreamResult]]) -> float:
    return round(1000 * statistics.median(r.ttft_s for _, r in runs), 1)


def print_report(report: dict[str, Any]) -> None:
    print(f"vLLM P/D layer-wise on CPU: {report['requests']} requests per length, model {report['model']}")
    print(f"{'prompt':>8}{'single':>10}{'pull':>10}{'push':>10}{'stream':>10}{'T_vis pull':>12}{'T_vis stream':>14}"
          f"{'equal':>7}")
    for n, row in report["per_length"].items():
        print(f"{n:>8}{row['ttft_ms_single']:>10}{row['ttft_ms_pull']:>10}{row['ttft_ms_push']:>10}"
              f"{row['ttft_ms_stream']:>10}{row['t_visible_ms_pull']!s:>12}{row['t_visible_ms_stream']!s:>14}"
              f"{row['outputs_equal']!s:>7}")
        for mode in MODES:
            print(f"    {mode}: {row[f'breakdown_ms_{mode}']}")
    print(f"server logs: {report['log_dir']}")
