"""The host budget: what kvlifecycle's own host work may take on D's latency path and still meet each goal, what it
takes (the split of one request's wall), and the ledger's two commands on that path timed hot, on this host."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from .shapes import GOALS, Shape


def ledger_hot_us(blocks: int, reps: int, log_dir: str) -> dict[str, float]:
    """D's two ledger commands on a request's latency path, timed in a hot loop of nothing else (median µs; CPU
    only): the least the ledger adds to a request on this host, whatever the transport does."""
    from kvlifecycle.ledger import open_ledger

    ledger = open_ledger("target", max(4 * blocks, 64), log_dir, worker="hot")
    ids = np.arange(blocks, dtype=np.int32)
    start_us, done_us = [], []
    try:
        for i in range(reps + 50):  # the first 50 warm the loop and are dropped
            name, transfer = f"h{i}", f"ht{i}"
            ledger.reserve(name, ids)
            with ledger.step():
                t0 = time.perf_counter()
                ledger.start_load(name, transfer, peer="p", peer_epoch=1)
                t1 = time.perf_counter()
            with ledger.step():
                t2 = time.perf_counter()
                ledger.part_done(transfer)
                t3 = time.perf_counter()
            ledger.finish(name)
            ledger.commit()
            if i >= 50:
                start_us.append((t1 - t0) * 1e6)
                done_us.append((t3 - t2) * 1e6)
    finally:
        ledger.log.close()  # type: ignore[union-attr]
    return {"start_load": round(statistics.median(start_us), 2), "part_done": round(statistics.median(done_us), 2)}


def host_budget(res: dict[str, Any], e2e: dict[str, Any], shapes: dict[str, Shape]) -> dict[str, Any]:
    """How much host work of its own a request may take and still meet its goal, against what it takes (µs).

    The least a request can cost at its point of D's loop is the raw driver copy timed there (one launch, one
    event, a spin: the host work no transfer avoids) plus the device time the block-gather kernel needs beyond a
    contiguous copy (both CUDA-event timed in-process, host launch excluded). Everything kvlifecycle adds on the
    path — the ledger's ``start_load`` and ``part_done``, the post's checks, the id copy, the stream ordering —
    must fit between that floor and the goal's wall (the hot-loop copy's wall / the goal). One GPU only: on two,
    the goal is against the peer copy."""
    budget: dict[str, Any] = {}
    for label in shapes:
        r, host = res[label], res.get("host_us", {}).get(label)
        raw = e2e.get(f"{label}_ceiling_in_loop_driver_wall_s")
        if host is None or raw is None or "peer_ceiling_event_s" in r:
            continue
        floor_s = raw + max(0.0, r["kernel_event_s"] - r["ceiling_event_s"])
        goal_wall_s = r["ceiling_wall_s"] / GOALS[label]
        budget[label] = {
            "goal": GOALS[label],
            "goal_wall_us": round(goal_wall_s * 1e6, 1),
            "floor_wall_us": round(floor_s * 1e6, 1),
            "ratio_at_floor": round(r["ceiling_wall_s"] / floor_s, 3),
            "budget_us": round((goal_wall_s - floor_s) * 1e6, 1),
            "spent_us": round(e2e[f"{label}_wall_s"] * 1e6 - floor_s * 1e6, 1),
            "ledger_us": round(host["start_load"] + host["part_done"], 1),
        }
        if "ledger_hot_us" in res:  # the same two commands in a hot loop of nothing else, this host
            budget[label]["ledger_hot_us"] = round(sum(res["ledger_hot_us"].values()), 1)
    return budget


def host_split(res: dict[str, Any], e2e: dict[str, Any], shapes: dict[str, Shape]) -> dict[str, Any]:
    """The honest split of one request on D (median µs): host work before the kernel starts and after its event
    completes adds to latency; the copy's device time and the host work that overlaps it do not add twice."""
    host: dict[str, Any] = {}
    for label in shapes:
        steps, stages = e2e.get(f"{label}_steps_us"), e2e.get(f"{label}_post_stages_us", {})
        if not steps:
            continue
        h = {"start_load": steps["start_load"], "post_to_launch": stages.get("to_launch", float("nan")),
             "post_after_launch": stages.get("after_launch", float("nan")), "post_total": steps["post"],
             "complete_in_poll": steps["complete"], "part_done": steps["part_done"],
             "after_ready_observe_release": steps["after_ready"],
             "compiled_post": e2e.get(f"{label}_compiled_post")}
        h["on_latency_path"] = round(h["start_load"] + h["post_to_launch"] + h["complete_in_poll"] + h["part_done"], 1)
        h["wall_us"] = round(e2e.get(f"{label}_wall_s", float("nan")) * 1e6, 1)
        h["transfer_device_us"] = round(e2e.get(f"{label}_kernel_s", float("nan")) * 1e6, 1)
        h["ceiling_wall_us"] = round(res[label]["ceiling_wall_s"] * 1e6, 1)
        h["ceiling_in_loop_wall_us"] = round(e2e.get(f"{label}_ceiling_in_loop_wall_s", float("nan")) * 1e6, 1)
        h["raw_copy_in_loop_wall_us"] = round(e2e.get(f"{label}_ceiling_in_loop_driver_wall_s", float("nan")) * 1e6, 1)
        host[label] = h
    return host
