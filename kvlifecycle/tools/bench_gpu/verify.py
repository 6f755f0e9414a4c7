"""``bench gpu --verify all``: P's digest pass over a request's blocks (the GPU digester's kernels) against a
device copy of the same bytes, same run: the contiguous copy (the ceiling) and the block-copy kernel of the same
blocks. D's two checks against the unverified copy (the block-copy kernel, timed again beside them): the fused copy
+ digest (the copy path that is ours, CUDA IPC, checking what it moves) and the read-back (the NIXL path's check,
forced on the same GPU: the block-copy kernel, then D digesting what landed in a second pass). The row pass and the
scramble chain are also timed alone, and the row kernels' tiles swept. Digests are checked bit-exact against
``xxhash`` over a host copy of one request's bytes, for every variant timed."""

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
    event_s = median(ip.time_events(digester.enqueue, units))  # the device pass alone
    wall_s = median(ip.time_wall(digester.digests, units))  # what P's thread waits: ids up, kernels, digests back
    ids = units[0][0]
    got = digester.digests(ids)
    rows = ip.src[:, torch.from_numpy(ids).to(ip.device)].permute(1, 0, 2).contiguous().cpu().numpy()
    want = np.array([xxhash.xxh3_64_intdigest(r.tobytes()) for r in rows], dtype=np.uint64)
    dst_bases = [ip.dst[r].data_ptr() for r in range(ip.regions)]
    pairs = [(s.astype(np.int64), d.astype(np.int64)) for s, d in sets]

    def exact(values: Any) -> bool:
        return bool(np.array_equal(values.cpu().numpy().view(np.uint64), want))

    def fused_with(dig: Any) -> tuple[float, bool]:
        def fused(src: np.ndarray, dst: np.ndarray) -> Any:
            return dig.copy_and_digest(src, dst_bases, dst)

        seconds = median(ip.time_events(fused, pairs))
        ip.poison(sets[0][1])
        digests_exact = exact(fused(*pairs[0]))  # the copy first, then the bytes checked
        return seconds, digests_exact and ip.check(*sets[0])

    fused_s, fused_exact = fused_with(digester)
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

    copier.copy(*dev[0][:2])  # through Triton's JIT once
    copy_s = median(ip.time_events(unverified, dev))
    readback_s = median(ip.time_events(readback, dev))
    ip.poison(sets[0][1])
    readback_exact = exact(readback(*dev[0])) and ip.check(*sets[0])

    nb = shape.nbytes
    out: dict[str, Any] = {
        "units": shape.blocks, "unit_bytes": shape.regions * shape.block_bytes, "defaults_error": defaults_error,
        "digest_event_s": event_s, "digest_wall_s": wall_s,
        "gbps_digest_event": gbps(nb, event_s), "gbps_digest_wall": gbps(nb, wall_s),
        "gbps_ceiling_event": gbps(nb, copies["ceiling_event_s"]),
        "gbps_kernel_event": gbps(nb, copies["kernel_event_s"]),
        "fused_event_s": fused_s, "gbps_fused_event": gbps(nb, fused_s), "fused_exact": fused_exact,
        "unverified_copy_event_s": copy_s, "gbps_unverified_copy": gbps(nb, copy_s),
        "readback_event_s": readback_s, "gbps_readback_event": gbps(nb, readback_s), "readback_exact": readback_exact,
    }
    out["ratio_fused_to_kernel"] = out["gbps_fused_event"] / out["gbps_kernel_event"]
    # D's check, verified / unverified throughput (the goals: fused >= 0.9, read-back >= 0.6)
    out["ratio_fused_to_unverified"] = copy_s / fused_s
    out["ratio_readback_to_unverified"] = copy_s / readback_s

    out["parts"] = _parts(torch, ip, digester, units, nb)
    all_exact_parts = bool(out["parts"]["chains_agree"])
    out["digest_variants"] = {}  # the row kernels' tiles: rows per program / warps, the wide kernel's and the old
    out["fused_variants"] = {}
    # name -> GpuDigester's arguments: the wide row kernel's tiles, the older row kernel (with the deep chain), the
    # older chain, and both older kernels
    variants: dict[str, dict[str, Any]] = {f"wide {r}r/{w}w": {"wide_rows": r, "wide_warps": w}
                                           for r, w in ((4, 4), (8, 4), (16, 4), (16, 8), (32, 8))}
    variants |= {f"old {r}r/{w}w": {"wide": False, "rows_per_program": r, "num_warps": w}
                 for r, w in ((32, 4), (64, 4))}
    variants |= {"wide 16r/4w, old chain": {"wide_rows": 16, "deep_chain": False},
                 "orig 32r/4w, old chain": {"wide": False, "deep_chain": False}}
    all_exact = bool(np.array_equal(got, want)) and fused_exact and readback_exact and all_exact_parts
    for key, kwargs in variants.items():
        try:
            v = GpuDigester(layout, **kwargs)
            v_s = median(ip.time_events(v.enqueue, units))
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
    """The scramble chain alone (over additions already in memory), both chain kernels per units-per-program, their
    digests compared: what part of the pass the chain is."""
    import triton

    from kvlifecycle.transports.digest_gpu import _xxh3_chain_deep_kernel, _xxh3_chain_kernel, row_shape

    n = len(units[0][0])
    total = ip.regions * ip.block_bytes
    nrows = row_shape(total)[0]
    adds = torch.randint(-2**62, 2**62, (n, nrows, 8), dtype=torch.int64, device=ip.device)
    out: dict[str, Any] = {"rows_per_unit": nrows}
    results = []
    for name, kernel in (("old", _xxh3_chain_kernel), ("deep", _xxh3_chain_deep_kernel)):
        for per in (1, 4, 8):
            res = torch.empty(n, dtype=torch.int64, device=ip.device)

            def chain(_: Any, per: int = per, kernel: Any = kernel, res: Any = res) -> None:
                kernel[(triton.cdiv(n, per),)](adds, digester._secret, res, n, nrows, total, UNITS=per, num_warps=1)
            try:
                seconds = median(ip.time_events(chain, units))
            except Exception as exc:  # reported, not fatal
                out[f"chain_{name}_{per}u_error"] = f"{type(exc).__name__}: {exc}"
                continue
            out[f"chain_{name}_{per}u_s"] = seconds
            out[f"chain_{name}_{per}u_ns_per_step"] = seconds / nrows * 1e9
            results.append(res.cpu())
    out["chains_agree"] = len(results) == 6 and all(bool(torch.equal(r, results[0])) for r in results)
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
              f"{v['ratio_fused_to_unverified']:.3f}x, read-back {v['gbps_readback_event']:.1f} GB/s "
              f"({v['ratio_readback_to_unverified']:.3f}x, exact {v['readback_exact']}); fused per tile "
              "(x unverified): " + ", ".join(f"{k} {g.get('x_unverified', float('nan')):.3f}"
                                             for k, g in v.get("fused_variants", {}).items()))
        parts = v.get("parts", {})
        print("  the scramble chain alone: " + ", ".join(f"{k} {parts[k]:.1f} ns/step" for k in parts
                                                          if k.endswith("ns_per_step")))
