"""``bench gpu --verify all``: P's digest pass over a request's blocks (the GPU digester's two kernels) against a
device copy of the same bytes, same run: the contiguous copy (the ceiling) and the block-copy kernel of the same
blocks. Digests are checked bit-exact against ``xxhash`` over a host copy of one request's bytes."""

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
    nb = shape.nbytes
    out: dict[str, Any] = {
        "units": shape.blocks, "unit_bytes": shape.regions * shape.block_bytes,
        "digest_event_s": event_s, "digest_wall_s": wall_s,
        "gbps_digest_event": gbps(nb, event_s), "gbps_digest_wall": gbps(nb, wall_s),
        "gbps_ceiling_event": gbps(nb, copies["ceiling_event_s"]),
        "gbps_kernel_event": gbps(nb, copies["kernel_event_s"]),
        "digest_exact": bool(np.array_equal(got, want)),
    }
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
              f"({v['ratio_digest_to_kernel']:.3f}x); bit-exact with xxhash: {v['digest_exact']}")
