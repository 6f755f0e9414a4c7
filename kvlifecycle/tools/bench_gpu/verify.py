"""``bench gpu --verify all``: P's digest pass over a request's blocks (the GPU digester's kernels) against a
device copy of the same bytes, same run: the contiguous copy (the ceiling) and the block-copy kernel of the same
blocks. D's two checks against the unverified copy (the block-copy kernel, timed again beside them): the fused copy
+ digest (the copy path that is ours, CUDA IPC, checking what it moves) and the read-back (the NIXL path's check,
forced on the same GPU: the block-copy kernel, then D digesting what landed in a second pass). The row pass and the
scramble chains and the root are also timed alone, and the row kernels' tiles swept. Digests are checked bit-exact
against the host contract (``xxhash``) over a host copy of one request's bytes, for every variant timed."""

from __future__ import annotations

from typing import Any

import numpy as np

from .in_process import InProcess
from .shapes import Shape, gbps, median

# ~1 ms of GPU spin ahead of each timed launch, for every figure here alike (the copy and the checks): a check is
# two launches and an id upload, whose Python the default 0.1 ms does not cover for a small request
BUSY_CYCLES = 2_000_000


def bench_verify(torch: Any, ip: InProcess, shape: Shape, sets: list[Any], copies: dict[str, Any]) -> dict[str, Any]:
    """``copies``: this shape's in-process figures (``ceiling_event_s``, ``kernel_event_s``) from the same run."""
    from kvlifecycle.transport import KVLayout, MemoryKind
    from kvlifecycle.transports.digest_gpu import GpuDigester, reference_digests

    from . import fastpath

    def vram(pool: Any) -> KVLayout:
        return KVLayout(MemoryKind.VRAM, ip.device.index or 0, ip.pool, [pool[r].data_ptr() for r in range(ip.regions)],
                        [ip.block_bytes] * ip.regions)

    layout = vram(ip.src)
    kw: dict[str, Any] = {}
    digester = GpuDigester(layout)
    try:
        digester.digests(sets[0][0].astype(np.int64))
        defaults_error = None
    except Exception as exc:  # the kernels of before, so the other figures are still taken
        defaults_error = f"{type(exc).__name__}: {exc}"
        kw = {"wide": False, "deep_chain": False}
        digester = GpuDigester(layout, **kw)
    units = [(s.astype(np.int64),) for s, _ in sets]
    event_s = median(ip.time_events(digester.enqueue, units, busy_cycles=BUSY_CYCLES))  # the device pass alone
    wall_s = median(ip.time_wall(digester.digests, units))  # what P's thread waits: ids up, kernels, digests back
    ids = units[0][0]
    got = digester.digests(ids)
    want = reference_digests([ip.src[r] for r in range(ip.regions)], ids)
    dst_bases = [ip.dst[r].data_ptr() for r in range(ip.regions)]
    pairs = [(s.astype(np.int64), d.astype(np.int64)) for s, d in sets]

    def exact(values: Any) -> bool:
        return bool(np.array_equal(values.cpu().numpy().view(np.uint64), want))

    def fused_with(dig: Any) -> tuple[float, bool]:
        def fused(src: np.ndarray, dst: np.ndarray) -> Any:
            return dig.copy_and_digest(src, dst_bases, dst)

        seconds = median(ip.time_events(fused, pairs, busy_cycles=BUSY_CYCLES))
        ip.poison(sets[0][1])
        digests_exact = exact(fused(*pairs[0]))  # the copy first, then the bytes checked
        return seconds, digests_exact and ip.check(*sets[0])

    fused_s, fused_exact = fused_with(digester)
    fused_short_spin_s = median(ip.time_events(lambda s, d: digester.copy_and_digest(s, dst_bases, d), pairs))
    # like for like with the unverified copy below, whose ids are on the device before it is timed
    on_device = [(s, d, (torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device))) for s, d in pairs]
    fused_device_ids_s = median(ip.time_events(
        lambda s, d, t: digester.copy_and_digest(s, dst_bases, d, device_ids=t), on_device, busy_cycles=BUSY_CYCLES))
    fused_host_s = median(ip.time_host(lambda s, d: digester.copy_and_digest(s, dst_bases, d), pairs))
    # the unverified copy and the read-back, side by side: the block-copy kernel (the transport's default shape),
    # then D's digester over the destination blocks, on the same stream
    specs = [[fastpath.RegionSpec.of_tensor(pool[r]) for r in range(ip.regions)] for pool in (ip.src, ip.dst)]
    copier = fastpath.BlockCopier(specs[0], specs[1], ip.device)
    d_digester = GpuDigester(vram(ip.dst), **kw)
    dev = [(torch.from_numpy(s).to(ip.device), torch.from_numpy(d).to(ip.device), d.astype(np.int64)) for s, d in sets]

    def unverified(s: Any, d: Any, _: np.ndarray) -> None:
        copier.copy(s, d)

    def readback(s: Any, d: Any, d_ids: np.ndarray) -> Any:
        copier.copy(s, d)
        return d_digester.enqueue(d_ids)

    uploading = GpuDigester(vram(ip.dst), **kw, inline_ids=False)

    def readback_uploaded(s: Any, d: Any, d_ids: np.ndarray) -> Any:
        copier.copy(s, d)
        return uploading.enqueue(d_ids)

    copier.copy(*dev[0][:2])  # through Triton's JIT once
    copy_s = median(ip.time_events(unverified, dev, busy_cycles=BUSY_CYCLES))
    readback_s = median(ip.time_events(readback, dev, busy_cycles=BUSY_CYCLES))
    readback_uploaded_s = median(ip.time_events(readback_uploaded, dev, busy_cycles=BUSY_CYCLES))
    ip.poison(sets[0][1])
    readback_exact = exact(readback(*dev[0])) and ip.check(*sets[0])

    nb = shape.nbytes
    out: dict[str, Any] = {
        "units": shape.blocks, "unit_bytes": shape.regions * shape.block_bytes, "leaf_bytes": shape.block_bytes,
        "defaults_error": defaults_error,
        "digest_event_s": event_s, "digest_wall_s": wall_s,
        "gbps_digest_event": gbps(nb, event_s), "gbps_digest_wall": gbps(nb, wall_s),
        "gbps_ceiling_event": gbps(nb, copies["ceiling_event_s"]),
        "gbps_kernel_event": gbps(nb, copies["kernel_event_s"]),
        "fused_event_s": fused_s, "fused_event_s_0_1ms_spin": fused_short_spin_s,
        "fused_device_ids_event_s": fused_device_ids_s, "fused_host_s": fused_host_s,
        "gbps_fused_event": gbps(nb, fused_s), "fused_exact": fused_exact,
        "unverified_copy_event_s": copy_s, "gbps_unverified_copy": gbps(nb, copy_s),
        "readback_event_s": readback_s, "gbps_readback_event": gbps(nb, readback_s), "readback_exact": readback_exact,
        "readback_uploaded_ids_event_s": readback_uploaded_s,
    }
    out["ratio_fused_to_kernel"] = out["gbps_fused_event"] / out["gbps_kernel_event"]
    # D's check, verified / unverified throughput (the goals: fused >= 0.9, read-back >= 0.6)
    out["ratio_fused_to_unverified"] = copy_s / fused_s
    out["ratio_readback_to_unverified"] = copy_s / readback_s
    out["ratio_fused_device_ids_to_unverified"] = copy_s / fused_device_ids_s
    out["ratio_readback_uploaded_ids_to_unverified"] = copy_s / readback_uploaded_s

    out["parts"] = _parts(torch, ip, digester, units, nb)
    all_exact_parts = bool(out["parts"]["chains_agree"])
    out["digest_variants"] = {}  # the row kernels' tiles: rows per program / warps, the wide kernel's and the old
    out["fused_variants"] = {}
    # name -> GpuDigester's arguments: the one-launch kernel's warps and cache hints; the two-launch path (the row
    # pass, then the chains and roots) with the wide row kernel's tiles, the older row kernel (with the deep chain),
    # the older chain, and both older kernels
    variants: dict[str, dict[str, Any]] = {f"one launch {w}w x{k}": {"leaf_warps": w, "leaf_split": k}
                                           for w, k in ((2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (2, 4))}
    variants |= {"one launch 4w, no cache hints": {"wide_cache": 0},
                 "one launch 4w, ids uploaded": {"inline_ids": False},
                 "one launch 4w, stores step by step": {"loads_first": False}}
    two: dict[str, Any] = {"one_launch": False}
    variants |= {f"two launches, wide {r}r/{w}w": {**two, "wide_rows": r, "wide_warps": w}
                 for r, w in ((8, 4), (16, 4), (32, 8))}
    variants |= {"two launches, wide 32r/8w, no cache hints": {**two, "wide_rows": 32, "wide_warps": 8,
                                                               "wide_cache": 0}}
    variants |= {f"two launches, old {r}r/{w}w": {**two, "wide": False, "rows_per_program": r, "num_warps": w}
                 for r, w in ((32, 4), (64, 4))}
    variants |= {"two launches, wide 16r/4w, old chain": {**two, "deep_chain": False},
                 "two launches, orig 32r/4w, old chain": {**two, "wide": False, "deep_chain": False}}
    all_exact = bool(np.array_equal(got, want)) and fused_exact and readback_exact and all_exact_parts
    for key, kwargs in variants.items():
        try:
            v = GpuDigester(layout, **kwargs)
            v_s = median(ip.time_events(v.enqueue, units, busy_cycles=BUSY_CYCLES))
            v_exact = exact(v.enqueue(ids))
            f_s, f_exact = fused_with(v)
            out["digest_variants"][key] = {"gbps": gbps(nb, v_s), "exact": v_exact}
            out["fused_variants"][key] = {"gbps": gbps(nb, f_s), "exact": f_exact, "x_unverified": copy_s / f_s}
            all_exact = all_exact and v_exact and f_exact
        except Exception as exc:  # a variant that does not compile is reported, not fatal
            out["digest_variants"][key] = {"error": f"{type(exc).__name__}: {exc}"}
            all_exact = False
    out["digest_exact"] = all_exact and defaults_error is None
    out["ratio_digest_to_ceiling"] = out["gbps_digest_event"] / out["gbps_ceiling_event"]
    out["ratio_digest_to_kernel"] = out["gbps_digest_event"] / out["gbps_kernel_event"]
    return out


def _parts(torch: Any, ip: InProcess, digester: Any, units: list[Any], nbytes: int) -> dict[str, Any]:
    """The scramble chains alone (over additions already in memory, one leaf per (unit, region)), each chain kernel
    per leaves-per-program, their digests compared; the root alone over those leaves: what part of the pass they are."""
    import triton

    from kvlifecycle.transports.digest_gpu import (
        ROOT_UNITS,
        SHORT_CHAIN_ROWS,
        _xxh3_chain_deep_kernel,
        _xxh3_chain_kernel,
        _xxh3_chain_short_kernel,
        _xxh3_leaves_root_kernel,
        _xxh64_root_kernel,
        row_shape,
    )

    n = len(units[0][0])
    leaves, total = n * ip.regions, ip.block_bytes
    nrows = row_shape(total)[0]
    adds = torch.randint(-2**62, 2**62, (leaves, nrows, 8), dtype=torch.int64, device=ip.device)
    out: dict[str, Any] = {"rows_per_leaf": nrows, "leaves": leaves}
    kernels: list[tuple[str, Any]] = [("old", _xxh3_chain_kernel), ("deep", _xxh3_chain_deep_kernel)]
    if nrows <= SHORT_CHAIN_ROWS:
        kernels.append(("short", _xxh3_chain_short_kernel))
    results = []
    for name, kernel in kernels:
        for per in (1, 4, 8):
            res = torch.empty(leaves, dtype=torch.int64, device=ip.device)

            def chain(_: Any, per: int = per, kernel: Any = kernel, name: str = name, res: Any = res) -> None:
                grid = (triton.cdiv(leaves, per),)
                if name == "short":
                    kernel[grid](adds, digester._secret, res, leaves, total, NROWS=nrows, UNITS=per, num_warps=1)
                else:
                    kernel[grid](adds, digester._secret, res, leaves, nrows, total, UNITS=per, num_warps=1)
            try:
                seconds = median(ip.time_events(chain, units, busy_cycles=BUSY_CYCLES))
            except Exception as exc:  # reported, not fatal
                out[f"chain_{name}_{per}u_error"] = f"{type(exc).__name__}: {exc}"
                continue
            out[f"chain_{name}_{per}u_s"] = seconds
            out[f"chain_{name}_{per}u_ns_per_step"] = seconds / nrows * 1e9
            results.append(res.cpu())
    out["chains_agree"] = len(results) == 3 * len(kernels) and all(bool(torch.equal(r, results[0]))
                                                                   for r in results)
    leaf_digests = results[0].to(ip.device) if results else adds[:, 0, 0].contiguous()
    root = torch.empty(n, dtype=torch.int64, device=ip.device)

    def root_pass(_: Any) -> None:
        _xxh64_root_kernel[(triton.cdiv(n, ROOT_UNITS),)](leaf_digests, digester._primes, root, n,
                                                          REGIONS=ip.regions, UNITS=ROOT_UNITS, num_warps=1)

    def merged_pass(_: Any) -> None:
        rp2 = triton.next_power_of_2(ip.regions)
        _xxh3_leaves_root_kernel[(n,)](adds, digester._secret, digester._primes, leaf_digests, root, total,
                                       NROWS=nrows, REGIONS=ip.regions, RP2=rp2,
                                       num_warps=min(16, max(1, rp2 // 4)))
    for key, fn in (("root_s", root_pass), ("chains_and_root_s", merged_pass)):
        try:
            out[key] = median(ip.time_events(fn, units, busy_cycles=BUSY_CYCLES))
        except Exception as exc:  # reported, not fatal
            out[key.replace("_s", "_error")] = f"{type(exc).__name__}: {exc}"
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
              + ", ".join(f"{k} {g.get('gbps', float('nan')):.1f}" for k, g in v.get("digest_variants", {}).items()))
        print(f"  D's check vs the unverified block copy ({v['gbps_unverified_copy']:.1f} GB/s, same run): fused "
              f"{v['ratio_fused_to_unverified']:.3f}x ({v['ratio_fused_device_ids_to_unverified']:.3f}x with its ids "
              f"on the device as the copy's are; {v['fused_host_s'] * 1e6:.1f} us of host time a call), "
              f"read-back {v['gbps_readback_event']:.1f} GB/s "
              f"({v['ratio_readback_to_unverified']:.3f}x, exact {v['readback_exact']}; "
              f"{v.get('ratio_readback_uploaded_ids_to_unverified', float('nan')):.3f}x with D's ids uploaded); "
              "fused per tile "
              "(x unverified): " + ", ".join(f"{k} {g.get('x_unverified', float('nan')):.3f}"
                                             for k, g in v.get("fused_variants", {}).items()))
        parts = v.get("parts", {})
        print(f"  the scramble chains alone ({parts.get('leaves')} leaves of {parts.get('rows_per_leaf')} rows): "
              + ", ".join(f"{k} {parts[k] * 1e6:.2f} us" for k in parts if k.startswith("chain_") and
                          k.endswith("u_s"))
              + f"; the root alone {parts.get('root_s', float('nan')) * 1e6:.2f} us; chains and root in one launch "
                f"{parts.get('chains_and_root_s', float('nan')) * 1e6:.2f} us")
