"""``bench gpu --verify all``: P's digest pass over a request's blocks (the GPU digester's two kernels) against a
device copy of the same bytes, same run: the contiguous copy (the ceiling) and the block-copy kernel of the same
blocks; and the fused copy + digest (the copy path that is ours, CUDA IPC, checking what it moves) against that
block-copy kernel. Digests are checked bit-exact against ``xxhash`` over a host copy of one request's bytes."""

from __future__ import annotations

from typing import Any

import numpy as np

from .in_process import InProcess
from .shapes import Shape, gbps, median


def bench_verify(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], copies: dict[str, Any]) -> dict[str, Any]:
    """``copies``: this shape's in-process figures (``ceiling_event_s``, ``kernel_event_s``) from the same run."""
    import xxhash

    from kvlifecycle.transport import KVLayout, MemoryKind
    from kvlifecycle.transports.digest_gpu import GpuDigester

    layout = KVLayout(MemoryKind.VRAM, ip.device.index or 0, ip.pool,
                      [ip.src[r].data_ptr() for r in range(ip.regions)], [ip.block_bytes] * ip.regions)
    digester = GpuDigester(layout)
    units = [(s.astype(np.int64),) for s, _ in sets]
    event_s = median(ip.time_events(digester.enqueue, units))  # the device pass alone
    wall_s = median(ip.time_wall(digester.digests, units))  # what P's thread waits: ids up, kernels, digests back
    ids = units[0][0]
    got = digester.digests(ids)
    rows = ip.src[:, torch.from_numpy(ids).to(ip.device)].permute(1, 0, 2).contiguous().cpu().numpy()
    want = np.array([xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows], dtype=np.uint64)
    dst_bases = [ip.dst[r].data_ptr() for r in range(ip.regions)]
    pairs = [(s.astype(np.int64), d.astype(np.int64)) for s, d in sets]

    def fused(src: np.ndarray, dst: np.ndarray) -> Any:
        return digester.copy_and_digest(src, dst_bases, dst)

    fused_s = median(ip.time_events(fused, pairs))
    ip.poison(sets[0][1])
    fused_digests = fused(*pairs[0]).cpu().numpy().view(np.uint64)
    fused_exact = ip.check(*sets[0]) and bool(np.array_equal(fused_digests, want))
    nb = shape.nbytes
    out: dict[str, Any] = {
        "units": shape.blocks, "unit_bytes": shape.regions * shape.block_bytes,
        "digest_event_s": event_s, "digest_wall_s": wall_s,
        "gbps_digest_event": gbps(nb, event_s), "gbps_digest_wall": gbps(nb, wall_s),
        "gbps_ceiling_event": gbps(nb, copies["ceiling_event_s"]),
        "gbps_kernel_event": gbps(nb, copies["kernel_event_s"]),
        "digest_exact": bool(np.array_equal(got, want)) and fused_exact,
        "fused_event_s": fused_s, "gbps_fused_event": gbps(nb, fused_s), "fused_exact": fused_exact,
    }
    out["ratio_fused_to_kernel"] = out["gbps_fused_event"] / out["gbps_kernel_event"]
    out["digest_variants"] = {}  # the row kernel's tile: rows per program / warps (the default is 32/4)
    for rows, warps in ((64, 4), (128, 4), (128, 8)):
        variant = GpuDigester(layout, rows_per_program=rows, num_warps=warps)
        out["digest_variants"][f"{rows}r/{warps}w"] = gbps(nb, median(ip.time_events(variant.enqueue, units)))
    out["ratio_digest_to_ceiling"] = out["gbps_digest_event"] / out["gbps_ceiling_event"]
    out["ratio_digest_to_kernel"] = out["gbps_digest_event"] / out["gbps_kernel_event"]
    return out


def print_verify(res: dict[str, Any]) -> None:
    for label in ("large", "small"):
        v = res.get("verify", {}).get(label)
        if not v:
            continue
        if "error" in v:
            print(f"\nverify ({label}): {v['error']}")
            continue
        print(f"\nverify all ({label}: {v['units']} units of {v['unit_bytes'] / 2**20:.2f} MiB): P's digest pass "
              f"{v['gbps_digest_event']:.1f} GB/s (events; {v['gbps_digest_wall']:.1f} GB/s wall with ids up and "
              f"digests back) vs the contiguous copy {v['gbps_ceiling_event']:.1f} GB/s "
              f"({v['ratio_digest_to_ceiling']:.3f}x) and the block-copy kernel {v['gbps_kernel_event']:.1f} GB/s "
              f"({v['ratio_digest_to_kernel']:.3f}x); fused copy + digest {v['gbps_fused_event']:.1f} GB/s "
              f"({v['ratio_fused_to_kernel']:.3f}x the block-copy kernel, same blocks); bit-exact with xxhash "
              f"and copied: {v['digest_exact']}; digest pass per row tile (GB/s): "
              + ", ".join(f"{k} {g:.1f}" for k, g in v.get("digest_variants", {}).items()))
