"""``bench gpu``'s table: the figures of one run as a person reads them (``--json`` prints the same object whole)."""

from __future__ import annotations

from typing import Any

from .shapes import gbps


def _print_budget(res: dict[str, Any]) -> None:
    for label, b in res.get("host_budget_us", {}).items():
        print(f"{label}: goal {b['goal']}x needs wall <= {b['goal_wall_us']} us; the floor at that point of D's loop "
              f"(raw driver copy + the kernel's extra device time) is {b['floor_wall_us']} us "
              f"({_fmt(b['ratio_at_floor'], 3)}x), so kvl's own host work may take {b['budget_us']} us: it takes "
              f"{b['spent_us']} us, the ledger's start_load + part_done alone {b['ledger_us']} us (in a hot loop "
              f"of nothing else: {_fmt(b.get('ledger_hot_us'))} us)")


def _fmt(x: Any, digits: int = 1) -> str:
    return "n/a" if x is None or (isinstance(x, float) and x != x) else f"{x:,.{digits}f}"


def print_table(res: dict[str, Any]) -> None:
    print(f"device: {res['device']}   torch {res['torch']}   triton {res['triton']}")
    for label in ("large", "small"):
        _print_shape(res, label)
    _print_e2e(res)
    print(f"\nbyte-exact: {res['byte_exact']}   goal 512 MiB >= 0.9x: {res['goal_large_met']} "
          f"({_fmt(res['ratio_to_ceiling'], 3)})   goal 16 blocks >= 0.6x: {res['goal_small_met']} "
          f"({_fmt(res['ratio_small'], 3)})   [vs the copy hot; per way of timing it: {res.get('goals')}]")


def _print_shape(res: dict[str, Any], label: str) -> None:
    """One request shape: every path's rate and its ratio to the ceiling, then the two-GPU and variant lines."""
    from .fastpath import REGION_GROUP_HOST_IDS

    r, shp = res[label], res["shape"][label]
    print(f"\n{label}: {shp['regions']} regions x {shp['blocks']} blocks x {shp['block_bytes'] // 1024} KiB "
          f"= {shp['bytes'] / 2**20:.0f} MiB")
    print(f"  {'path':<52}{'GB/s':>10}{'x ceiling':>11}")
    rows = [
        ("(d) contiguous copy, wall (ceiling)", r["gbps_ceiling_wall"], 1.0),
        ("(d) contiguous copy, CUDA events", r["gbps_ceiling_event"], 1.0),
        ("(a) kvl cuda_ipc e2e, 2 procs, wall", r["gbps_kvl_wall"], r["ratio_kvl_to_ceiling_wall"]),
        ("    same, Python post (A/B, same run)", r.get("gbps_kvl_wall_python_post"),
         r.get("ratio_kvl_python_post")),
        ("(d) contiguous copy_, wall, timed in D's loop", r.get("gbps_ceiling_in_loop"), 1.0),
        ("(a) kvl e2e, x that copy_", r["gbps_kvl_wall"], r.get("ratio_kvl_to_ceiling_in_loop")),
        ("(d) raw cuMemcpyDtoDAsync, wall, timed in D's loop", r.get("gbps_ceiling_in_loop_driver"), 1.0),
        ("(a) kvl e2e, x that raw copy", r["gbps_kvl_wall"], r.get("ratio_kvl_to_ceiling_in_loop_driver")),
        ("(a) kvl cuda_ipc device time post->done (events)", r["gbps_kvl_kernel"],
         r["ratio_kvl_kernel_to_ceiling_event"]),
        ("(d) contiguous copies back to back, wall", r["gbps_ceiling_pipelined"], 1.0),
        ("(a) kvl e2e pipelined, wall (x back-to-back)", r["gbps_kvl_pipelined"],
         r["gbps_kvl_pipelined"] / r["gbps_ceiling_pipelined"]),
        ("(a) kvl e2e, same requests as one step (post_batch)", r["gbps_kvl_batched"], r["ratio_kvl_batched"]),
        (f"    batched kernel in-process, events ({r.get('kernel_config')})", r["gbps_kernel_event"],
         r["ratio_kernel_to_ceiling_event"]),
        (f"    same, ids read from pinned host memory, G{REGION_GROUP_HOST_IDS}",
         gbps(shp["bytes"], r.get("kernel_host_ids_event_s", 0)),
         gbps(shp["bytes"], r.get("kernel_host_ids_event_s", 0)) / r["gbps_ceiling_event"]),
        ("(c) torch index_select+index_copy_, events", r["gbps_torch_event"],
         r["gbps_torch_event"] / r["gbps_ceiling_event"]),
        ("(b) raw NIXL/UCX READ, wall", r["gbps_nixl"], r["gbps_nixl"] / r["gbps_ceiling_wall"]),
    ]
    for name, rate, ratio in rows:
        print(f"  {name:<52}{_fmt(rate):>10}{_fmt(ratio, 3):>11}")
    if "gbps_peer_ceiling" in r:
        print(f"  two GPUs: torch peer copy (events) {_fmt(r['gbps_peer_ceiling'])} GB/s; kvl e2e "
              f"{_fmt(r['ratio_kvl_to_peer_ceiling'], 3)}x (x the peer copy's wall in a hot loop, "
              f"{_fmt(r.get('gbps_peer_ceiling_wall'))} GB/s: {_fmt(r.get('ratio_kvl_to_peer_ceiling_wall'), 3)}x)"
              f", kvl device time "
              f"{_fmt(r['ratio_kvl_kernel_to_peer_ceiling'], 3)}x, raw NIXL/UCX "
              f"{_fmt(r['ratio_nixl_to_peer_ceiling'], 4)}x of it")
        for direction, rows in r.get("peer_kernel_variants", {}).items():
            print(f"  kernel across the peer link, {direction} (GB/s, x the peer copy): " + ", ".join(
                f"{k} {_fmt(v['gbps'])} ({_fmt(v['ratio_to_peer_ceiling'], 3)}){'' if v['exact'] else ' NOT EXACT'}"
                for k, v in rows.items()))
    if "nixl_error" in r:
        print(f"  NIXL: {r['nixl_error']}")
    if r.get("kernel_variants") and len(r["kernel_variants"]) > 2:
        print("  kernel variants (GB/s, events): " + ", ".join(
            f"{k} {_fmt(v['gbps'])}" for k, v in r["kernel_variants"].items()))


def _print_e2e(res: dict[str, Any]) -> None:
    """The two-process run: connect, round trips, where one request's host time goes, the budget, the replay."""
    e2e = res.get("e2e", {})
    if "error" in e2e:
        print(f"\ne2e failed: {e2e['error']}\n{e2e.get('trace', '')}")
    elif e2e:
        print(f"\nconnect (map + self-test): {_fmt(e2e['connect_s'] * 1e3, 2)} ms {e2e['connect']}")
        print(f"P round trip (grant -> lease released), median: large {_fmt(e2e['large_roundtrip_s'] * 1e6)} us, "
              f"small {_fmt(e2e['small_roundtrip_s'] * 1e6)} us")
        print(f"D single request, median us: large {e2e['large_steps_us']}, small {e2e['small_steps_us']}")
        for label, h in [*res.get("host_us", {}).items(),
                         *((f"{k} (Python post)", v) for k, v in res.get("host_us_python_post", {}).items())]:
            print(f"{label}: wall {h['wall_us']} us = host on the latency path {h['on_latency_path']} us (start_load "
                  f"{h['start_load']}, post up to the launch {h['post_to_launch']}, completion in poll "
                  f"{h['complete_in_poll']}, part_done {h['part_done']}) + device/poll; transfer device time "
                  f"{h['transfer_device_us']} us; overlapped: post after the launch {h['post_after_launch']}; "
                  f"after ready: observe+release {h['after_ready_observe_release']}; ceiling {h['ceiling_wall_us']} us")
        if "large_post_stages_us" in e2e:
            print(f"post stages, median us: large {e2e['large_post_stages_us']}, small {e2e['small_post_stages_us']}")
        print(f"post() host time, median: large {_fmt(e2e['large_post_us'])} us, small {_fmt(e2e['small_post_us'])} us;"
              f" kernel launch alone (in-process): {_fmt(res['large'].get('kernel_launch_host_us'))} us"
              f" (direct launch: {res['large'].get('kernel_fast_launch')})")
        for label in ("large", "small"):
            for kind, what in (("pipelined", "in flight"), ("batched", "as one step")):
                if f"{label}_{kind}_split_us" in e2e:
                    print(f"{label}, {kind} requests {what}, where the wall goes (median us): "
                          f"{e2e[f'{label}_{kind}_split_us']}")
        _print_budget(res)
        print(f"ledgers replayed: {e2e['replay_events']} events, violations: {len(e2e['replay_violations'])}")
