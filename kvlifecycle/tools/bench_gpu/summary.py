"""From timings to the figures ``bench gpu`` reports: rates, every ratio to the ceiling (each way of timing it),
the goals, the compiled post's A/B and the byte check over every path. Arithmetic only: no GPU needed."""

from __future__ import annotations

from typing import Any

from .budget import host_budget, host_split
from .shapes import GOALS, Shape, gbps

NAN = float("nan")


def summarise(res: dict[str, Any], shapes: dict[str, Shape], pipeline: int) -> dict[str, Any]:
    e2e = res.get("e2e", {})
    for label, shape in shapes.items():
        _rates(res[label], e2e, label, shape.nbytes, pipeline)
    large, small = res["large"], res["small"]
    for r, shape in ((large, shapes["large"]), (small, shapes["small"])):
        if "peer_ceiling_event_s" in r:  # two GPUs: every path against the peer copy
            _peer_ratios(r, shape)
    _headline(res, large, small)
    res["host_us"] = host_split(res, e2e, shapes)
    ab = res.get("e2e_python_post", {})
    if ab and "error" not in ab:  # the same e2e with the Python post, same run: the compiled post's A/B
        _python_post(res, ab, shapes, pipeline)
    res["split"] = _split(res, large, small)
    res["goal_large_met"] = bool(res["ratio_to_ceiling"] >= GOALS["large"])
    res["goal_small_met"] = bool(res["ratio_small"] >= GOALS["small"])
    res["host_budget_us"] = host_budget(res, e2e, shapes)
    # the goals against each way of timing the contiguous copy: hot loop (the headline), torch copy_ and raw
    # driver calls at the same point of D's loop as the request
    res["goals"] = {name: {"large": bool(large_r >= GOALS["large"]), "small": bool(small_r >= GOALS["small"])}
                    for name, large_r, small_r in (
                        ("copy_hot_loop", res["ratio_to_ceiling"], res["ratio_small"]),
                        ("copy_in_loop", res["ratio_to_ceiling_in_loop"], res["ratio_small_to_ceiling_in_loop"]),
                        ("raw_copy_in_loop", res["ratio_to_ceiling_in_loop_driver"],
                         res["ratio_small_to_ceiling_in_loop_driver"]))}
    res["byte_exact"] = bool(all(
        res[lbl].get(k, True) for lbl in shapes for k in ("ceiling_exact", "torch_exact", "kernel_exact", "nixl_exact"))
        and all(res.get(key, {}).get(f"{lbl}_exact", True) for lbl in shapes for key in ("e2e", "e2e_python_post")))
    return res


def _rates(r: dict[str, Any], e2e: dict[str, Any], label: str, nb: int, pipeline: int) -> None:
    """One shape's rates (GB/s) and its ratios to the contiguous copy, in place."""
    r["gbps_ceiling_event"] = gbps(nb, r["ceiling_event_s"])
    r["gbps_ceiling_wall"] = gbps(nb, r["ceiling_wall_s"])
    r["gbps_torch_event"] = gbps(nb, r["torch_event_s"])
    r["gbps_kernel_event"] = gbps(nb, r["kernel_event_s"])
    r["gbps_nixl"] = gbps(nb, r.get("nixl_wall_s", NAN))
    r["gbps_kvl_wall"] = gbps(nb, e2e.get(f"{label}_wall_s", NAN))
    r["gbps_kvl_kernel"] = gbps(nb, e2e.get(f"{label}_kernel_s", NAN))
    r["gbps_kvl_pipelined"] = gbps(nb * pipeline, e2e.get(f"{label}_pipelined_wall_s", NAN))
    r["gbps_ceiling_pipelined"] = gbps(nb * pipeline, r["ceiling_pipelined_wall_s"])
    r["gbps_kvl_batched"] = gbps(nb * pipeline, e2e.get(f"{label}_batched_wall_s", NAN))
    r["ratio_kvl_batched"] = r["gbps_kvl_batched"] / r["gbps_ceiling_pipelined"]
    r["ratio_kvl_to_ceiling_wall"] = r["gbps_kvl_wall"] / r["gbps_ceiling_wall"]
    # the same contiguous copy timed at the same point of D's loop as the request (side by side, alternating)
    r["gbps_ceiling_in_loop"] = gbps(nb, e2e.get(f"{label}_ceiling_in_loop_wall_s", NAN))
    r["ratio_kvl_to_ceiling_in_loop"] = r["gbps_kvl_wall"] / r["gbps_ceiling_in_loop"]
    r["gbps_ceiling_in_loop_driver"] = gbps(nb, e2e.get(f"{label}_ceiling_in_loop_driver_wall_s", NAN))
    r["ratio_kvl_to_ceiling_in_loop_driver"] = r["gbps_kvl_wall"] / r["gbps_ceiling_in_loop_driver"]
    r["ratio_kvl_kernel_to_ceiling_event"] = r["gbps_kvl_kernel"] / r["gbps_ceiling_event"]
    r["ratio_kernel_to_ceiling_event"] = r["gbps_kernel_event"] / r["gbps_ceiling_event"]


def _peer_ratios(r: dict[str, Any], shape: Shape) -> None:
    r["gbps_peer_ceiling"] = gbps(shape.nbytes, r["peer_ceiling_event_s"])
    r["ratio_kvl_to_peer_ceiling"] = r["gbps_kvl_wall"] / r["gbps_peer_ceiling"]
    r["ratio_kvl_kernel_to_peer_ceiling"] = r["gbps_kvl_kernel"] / r["gbps_peer_ceiling"]
    r["ratio_nixl_to_peer_ceiling"] = r["gbps_nixl"] / r["gbps_peer_ceiling"]
    if "peer_ceiling_wall_s" in r:  # wall against wall, as the one-GPU headline compares them
        r["gbps_peer_ceiling_wall"] = gbps(shape.nbytes, r["peer_ceiling_wall_s"])
        r["ratio_kvl_to_peer_ceiling_wall"] = r["gbps_kvl_wall"] / r["gbps_peer_ceiling_wall"]
    for rows in r.get("peer_kernel_variants", {}).values():
        for v in rows.values():
            v["ratio_to_peer_ceiling"] = v["gbps"] / r["gbps_peer_ceiling"]


def _headline(res: dict[str, Any], large: dict[str, Any], small: dict[str, Any]) -> None:
    """The top-level keys: the large request's figures, and the small one's where they differ."""
    res["gbps_kvl"] = large["gbps_kvl_wall"]
    res["gbps_ceiling"] = large["gbps_ceiling_wall"]
    res["ratio_to_ceiling"] = large["ratio_kvl_to_ceiling_wall"]
    res["gbps_kvl_kernel"] = large["gbps_kvl_kernel"]
    res["gbps_ceiling_event"] = large["gbps_ceiling_event"]
    res["ratio_kernel_to_ceiling"] = large["ratio_kvl_kernel_to_ceiling_event"]
    res["gbps_nixl"] = large["gbps_nixl"]
    res["gbps_torch"] = large["gbps_torch_event"]
    res["gbps_kvl_small"] = small["gbps_kvl_wall"]
    res["ratio_small"] = small["ratio_kvl_to_ceiling_wall"]
    res["ratio_to_ceiling_in_loop"] = large["ratio_kvl_to_ceiling_in_loop"]
    res["ratio_small_to_ceiling_in_loop"] = small["ratio_kvl_to_ceiling_in_loop"]
    res["ratio_to_ceiling_in_loop_driver"] = large["ratio_kvl_to_ceiling_in_loop_driver"]
    res["ratio_small_to_ceiling_in_loop_driver"] = small["ratio_kvl_to_ceiling_in_loop_driver"]
    res["ratio_small_kernel"] = small["ratio_kvl_kernel_to_ceiling_event"]
    res["gbps_kvl_pipelined"] = large["gbps_kvl_pipelined"]
    res["gbps_kvl_small_pipelined"] = small["gbps_kvl_pipelined"]
    res["ratio_pipelined"] = large["gbps_kvl_pipelined"] / large["gbps_ceiling_pipelined"]
    res["ratio_small_pipelined"] = small["gbps_kvl_pipelined"] / small["gbps_ceiling_pipelined"]
    res["ratio_batched"] = large["ratio_kvl_batched"]
    res["ratio_small_batched"] = small["ratio_kvl_batched"]


def _python_post(res: dict[str, Any], ab: dict[str, Any], shapes: dict[str, Shape], pipeline: int) -> None:
    for label, shape in shapes.items():
        r = res[label]
        r["gbps_kvl_wall_python_post"] = gbps(shape.nbytes, ab.get(f"{label}_wall_s", NAN))
        r["ratio_kvl_python_post"] = r["gbps_kvl_wall_python_post"] / r["gbps_ceiling_wall"]
        r["gbps_kvl_pipelined_python_post"] = gbps(shape.nbytes * pipeline, ab.get(f"{label}_pipelined_wall_s", NAN))
    res["ratio_to_ceiling_python_post"] = res["large"]["ratio_kvl_python_post"]
    res["ratio_small_python_post"] = res["small"]["ratio_kvl_python_post"]
    res["host_us_python_post"] = host_split(res, ab, shapes)


def _split(res: dict[str, Any], large: dict[str, Any], small: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        "single_wall": {"large": res["ratio_to_ceiling"], "small": res["ratio_small"]},
        "single_wall_vs_ceiling_in_loop": {"large": res["ratio_to_ceiling_in_loop"],
                                           "small": res["ratio_small_to_ceiling_in_loop"]},
        "single_wall_vs_raw_copy_in_loop": {"large": res["ratio_to_ceiling_in_loop_driver"],
                                            "small": res["ratio_small_to_ceiling_in_loop_driver"]},
        "transfer_device_time": {"large": res["ratio_kernel_to_ceiling"], "small": res["ratio_small_kernel"]},
        "pipelined_wall": {"large": res["ratio_pipelined"], "small": res["ratio_small_pipelined"]},
        "step_batched_wall": {"large": res["ratio_batched"], "small": res["ratio_small_batched"]},
        "kernel_in_process": {"large": large["ratio_kernel_to_ceiling_event"],
                              "small": small["ratio_kernel_to_ceiling_event"]},
    }
