"""Host staging on a GPU: the staging copy (P's KV blocks, device -> pinned host pool) against a plain ``copy_``.

What a staging copy does that a plain copy does not: it gathers a request's blocks (scattered in each layer's KV
tensor) into host-pool slots, on a side stream ordered after the producer's stream by an event, so the scheduler's
thread only enqueues. The plain baseline copies one contiguous device tensor of the same bytes into pinned memory.
D's pull from P's host pool is measured as pinned host -> device (and, where NIXL loads, as a NIXL DRAM -> VRAM
read through a UCX loopback). Prints one JSON object; the ratios are side by side in one run.

    python3 bench/staging_copy.py --layers 32 --blocks 256 --reps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def _gbps(nbytes: int, seconds: list[float]) -> dict[str, float]:
    med = statistics.median(seconds)
    return {"median_s": med, "gbps": nbytes / med / 1e9, "min_s": min(seconds)}


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--pool-blocks", type=int, default=4096, help="blocks in each layer's device KV tensor")
    ap.add_argument("--blocks", type=int, default=256, help="blocks of the request staged (16 tokens each)")
    ap.add_argument("--block-elems", type=int, default=2 * 16 * 8 * 128, help="bf16 elements per block per layer")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    dev = torch.device("cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    kv = [torch.randn(args.pool_blocks, args.block_elems, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    scattered = torch.randperm(args.pool_blocks, generator=gen)[: args.blocks].sort().values.to(dev)
    contiguous = torch.arange(args.blocks, device=dev)
    nbytes = args.layers * args.blocks * args.block_elems * 2
    host_pool = torch.empty(args.layers, args.blocks, args.block_elems, dtype=torch.bfloat16, pin_memory=True)
    plain_src = torch.randn(args.layers, args.blocks, args.block_elems, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()
    scratch = torch.empty(args.blocks, args.block_elems, dtype=torch.bfloat16, device=dev)

    def plain() -> None:
        host_pool.copy_(plain_src, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    def staging(ids: torch.Tensor, per_layer_gather: bool) -> None:
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream())  # the prefill's writes come first
        with torch.cuda.stream(side):
            side.wait_event(produced)
            for layer in range(args.layers):
                if per_layer_gather:  # gather on the GPU, then one device -> host copy per layer
                    torch.index_select(kv[layer], 0, ids, out=scratch)
                    host_pool[layer].copy_(scratch, non_blocking=True)
                else:  # one copy per block: what a gather-less copy engine path costs
                    for slot, block in enumerate(ids.tolist()):
                        host_pool[layer, slot].copy_(kv[layer][block], non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        done.synchronize()

    def timed(fn: Any, reps: int) -> list[float]:
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "bytes": nbytes,
        "layers": args.layers,
        "blocks": args.blocks,
        "block_bytes_per_layer": args.block_elems * 2,
    }
    result["plain_copy_to_pinned"] = _gbps(nbytes, timed(plain, args.reps))
    result["staging_gather_scattered"] = _gbps(nbytes, timed(lambda: staging(scattered, True), args.reps))
    result["staging_gather_contiguous"] = _gbps(nbytes, timed(lambda: staging(contiguous, True), args.reps))
    result["staging_per_block_scattered"] = _gbps(
        nbytes, timed(lambda: staging(scattered, False), max(3, args.reps // 5)))
    result["kvlifecycle_cuda_staging_copy"] = _kvl_staging_copy(kv, scattered, args.blocks, nbytes, args.reps)
    # staging copy's bandwidth against the plain copy, side by side
    base = result["plain_copy_to_pinned"]["gbps"]
    for key in ("staging_gather_scattered", "staging_gather_contiguous", "staging_per_block_scattered",
                "kvlifecycle_cuda_staging_copy"):
        if "gbps" in result[key]:
            result[f"{key}_vs_plain"] = result[key]["gbps"] / base
    # D's pull from the host pool, as a local pinned -> device copy
    landing = torch.empty_like(plain_src)

    def pull() -> None:
        landing.copy_(host_pool, non_blocking=True)
        torch.cuda.current_stream().synchronize()

    result["pull_pinned_to_device"] = _gbps(nbytes, timed(pull, args.reps))
    result["nixl_pull_dram_to_vram"] = _nixl_pull(host_pool, landing, nbytes, args.reps)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


def _kvl_staging_copy(kv: list[Any], ids: Any, blocks: int, nbytes: int, reps: int) -> dict[str, Any]:
    """The library's staging copy (transports/staging_copy_cuda.py: one gather kernel writing into the mapped,
    pinned host pool, on its own stream) of the same scattered blocks into slots, posted and polled as the
    Producer's service step does."""
    try:
        from kvlifecycle.transports.host_pool import HostPool
        from kvlifecycle.transports.staging_copy_cuda import CudaStagingCopy

        from kvlifecycle.transport import KVLayout, MemoryKind, XferOp, XferStatus
    except ImportError as exc:
        return {"skipped": f"kvlifecycle not importable: {exc}"}
    block_bytes = kv[0][0].numel() * kv[0].element_size()
    layout = KVLayout(MemoryKind.VRAM, kv[0].device.index or 0, kv[0].shape[0], tuple(t.data_ptr() for t in kv),
                      (block_bytes,) * len(kv))
    copier = CudaStagingCopy(layout, HostPool(layout, blocks))
    src, slots = ids.cpu().numpy().astype("int32"), list(range(blocks))
    seconds = []
    try:
        for i in range(reps + 1):
            t0 = time.perf_counter()
            handle = copier.post(XferOp.READ, None, slots, src)
            deadline = time.monotonic() + 30
            while copier.poll(handle) is XferStatus.PENDING and time.monotonic() < deadline:
                pass
            copier.release(handle)
            if i:
                seconds.append(time.perf_counter() - t0)
    finally:
        copier.close()
    return _gbps(nbytes, seconds)


def _nixl_pull(host: Any, device: Any, nbytes: int, reps: int) -> dict[str, Any]:
    """D's read of P's host pool through NIXL: two agents in one process over UCX, DRAM -> VRAM."""
    try:
        import nixl._api as api
    except ImportError as exc:
        return {"skipped": f"nixl not importable: {exc}"}
    try:
        cfg = api.nixl_agent_config(backends=["UCX"])
        p, d = api.nixl_agent("p-host", cfg), api.nixl_agent("d-gpu", cfg)
        p_reg = p.register_memory(host)
        d_reg = d.register_memory(device)
        d.add_remote_agent(p.get_agent_metadata())
        remote = p_reg.trim()
        local = d_reg.trim()
        handle = d.initialize_xfer("READ", local, remote, "p-host")
        seconds = []
        for i in range(reps + 1):
            t0 = time.perf_counter()
            state = d.transfer(handle)
            deadline = time.monotonic() + 30
            while state not in ("DONE", "ERR") and time.monotonic() < deadline:
                state = d.check_xfer_state(handle)
            if state != "DONE":
                return {"error": f"transfer state {state}"}
            if i:
                seconds.append(time.perf_counter() - t0)
        return _gbps(nbytes, seconds)
    except Exception as exc:  # a figure that could not be taken is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    main()
