"""``kvlifecycle bench load``: sustained load through the real Producer and Consumer over NIXL (DRAM, two processes).

Many requests (default 10,000) with a bounded number in flight (default 64), pull and push alternating, with a few
cancels (by P right after the grant; by D right after asking for the load) and lease expiries (grants with a TTL of
zero) among them. Blocks come from a pool on each side and go back when the side frees them, so the pools are
reused many times over. Reported: requests per second, handoff latency (D: from asking for the load to the load
settled) p50/p99, each process's peak and current RSS at the start, the middle and the end (memory must stay flat:
nothing may grow per request), how every request ended on each side, and both event logs replayed and checked at
quiescence (``replay --check --quiescent``, called as a library).

The worker processes are :class:`kvlifecycle.tools.workers.WorkerProcess` running :class:`LoadWorker` (the handoff
worker with a few batch commands), so one pipe round trip starts or reaps many requests.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvlifecycle.cli.arguments import non_negative_int
from kvlifecycle.tools.workers import WORKER_MAX_LIFETIME_S, BlockPool, HandoffWorker, WorkerConfig, WorkerProcess

SETTLE_TIMEOUT_S = 120.0  # after the last request started: every load settles and every lease ends by then
LOAD_TTL_S = 2.0  # a lease D never claims (D cancelled first) holds P's blocks this long


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=10_000, help="requests in all (pull and push alternate)")
    parser.add_argument("--inflight", type=int, default=64, help="requests in flight at most")
    parser.add_argument("--blocks-per-request", type=int, default=4, help="blocks each request hands off")
    parser.add_argument("--regions", type=int, default=4, help="KV regions per side")
    parser.add_argument("--blocks", type=int, default=1024, help="blocks per region (each side's pool)")
    parser.add_argument("--block-bytes", type=int, default=1024, help="bytes per block per region")
    parser.add_argument("--cancel-every", type=non_negative_int, default=500,
                        help="every Nth request is cancelled (0: none)")
    parser.add_argument("--expire-every", type=non_negative_int, default=700,
                        help="every Nth request's lease expires (0: none)")
    parser.add_argument("--keep", default=None, help="keep the event logs in this directory")


def _rss_kib() -> dict[str, int]:
    """This process's current and peak resident set, KiB."""
    out = {"rss_kib": 0, "peak_rss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                out["rss_kib"] = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                out["peak_rss_kib"] = int(line.split()[1])
    return out


class LoadWorker(HandoffWorker):
    """The handoff worker with batch commands: grant many, start many, reap what settled or was released."""

    def __init__(self, cfg: WorkerConfig) -> None:
        super().__init__(cfg)
        self._request_of: dict[str, str] = {}  # D: load transfer -> request
        self._started: dict[str, float] = {}  # D: request -> when the load was asked for
        self._settled: collections.deque[tuple[str, float]] = collections.deque()
        self._lock = threading.Lock()
        if self.cfg.side == "consumer":
            self.ledger.listeners.append(self._on_event)

    # -- P ----------------------------------------------------------------------------------------------------------
    def grant_batch(self, specs: list[list[Any]]) -> list[dict[str, Any]]:
        """``[request, blocks, ttl_s, cancel]`` each: allocate, prefill, grant; ``cancel``: P cancels right away
        (the lease is unclaimed, so it is released at once and D's claim will be refused)."""
        out = []
        for request, blocks, ttl_s, cancel in specs:
            out.append(self.alloc_grant(request, blocks, ttl_s=ttl_s))
            if cancel:
                self.ledger.cancel(request)
        return out

    def reap_released(self) -> list[list[str]]:
        """Free every request whose lease ended and stop publishing its grant: ``[request, reason]`` each."""
        out = []
        for rel in self.ledger.take_released():
            self.ledger.free(rel.request)
            self.role.forget(rel.request)
            out.append([rel.request, rel.reason])
        return out

    # -- D ----------------------------------------------------------------------------------------------------------
    def start_batch(self, specs: list[list[Any]]) -> None:
        """``[request, blocks, grant, mode, address, cancel]`` each: reserve and ask for the load (pull or push);
        ``cancel``: D cancels right after asking (the load is abandoned; P's unclaimed lease expires)."""
        import msgspec

        from kvlifecycle.handoff import GrantReply

        for request, blocks, grant, mode, address, cancel in specs:
            reply = msgspec.convert(grant, GrantReply)
            self.ledger.reserve(request, blocks)
            with self._lock:  # before the load starts: it may settle before pull() returns
                self._started[request] = time.perf_counter()
                self._request_of[reply.transfer] = request  # one P rank: D's transfer id is the grant's
            if mode == "pull":
                self.role.pull(request, [(address, reply)])
            else:
                self.role.request_push(request, reply, address=address)
            if cancel:
                self.ledger.cancel(request)

    def _on_event(self, event: Any) -> None:
        """Ledger listener (any thread, under the ledger's lock): note when each request's load settled."""
        from kvlifecycle import events as ev

        ledger = self.ledger
        if isinstance(event, ev.TgtPartDone | ev.TgtLoadFailed):
            if event.transfer in ledger.loads:  # parts still missing
                return
            request = self._request_of.get(event.transfer)
        elif isinstance(event, ev.TgtCancelled):
            if event.request in ledger.requests:  # a load is in flight: it settles (discarded) later
                return
            request = event.request
        else:
            return
        if request is not None:
            self._settled.append((request, time.perf_counter()))

    def reap_settled(self) -> list[list[Any]]:
        """Every request whose load settled since the last call: ``[request, outcome, latency_s]``. A loaded one is
        finished here (the engine decoded it), so its blocks are free again."""
        from kvlifecycle.machines import TargetState

        out = []
        while self._settled:
            request, at = self._settled.popleft()
            with self._lock:
                started = self._started.pop(request, at)
            req = self.ledger.requests.get(request)
            if req is not None and req.state == TargetState.READY_FOR_ATTENTION:
                self.ledger.finish(request)
                outcome = "loaded"
            elif req is not None:  # not READY and still held: no load will come; give the blocks back
                self.ledger.cancel(request)
                outcome = "failed"
            else:
                outcome = "abandoned" if request in self.role.abandoned else "dropped"
            self.role.abandoned.pop(request, None)  # bounded: the bench has read it
            out.append([request, outcome, at - started])
        with self._lock:
            live = set(self._started)
            for transfer in [t for t, r in self._request_of.items() if r not in live]:
                del self._request_of[transfer]
        return out

    def rss(self) -> dict[str, int]:
        return _rss_kib()


# --- the benchmark --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Plan:
    """What happens to request ``i``: its mode, and whether it is cancelled (by whom) or its lease expires."""

    cancel_every: int
    expire_every: int

    def of(self, i: int) -> tuple[str, str]:
        mode = "pull" if i % 2 == 0 else "push"
        if self.cancel_every and i % self.cancel_every == self.cancel_every - 1:
            return mode, "cancel_p" if (i // self.cancel_every) % 2 == 0 else "cancel_d"
        if self.expire_every and i % self.expire_every == self.expire_every // 2:
            return mode, "expire"
        return mode, ""


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def refuse_arguments(args: argparse.Namespace) -> str:
    for name in ("requests", "inflight", "blocks_per_request", "regions", "blocks", "block_bytes"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.blocks_per_request > args.blocks:
        return f"--blocks-per-request {args.blocks_per_request} does not fit a pool of --blocks {args.blocks}"
    return ""


def drive(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Run the load and return the measurements (the logs stay in ``logs``)."""
    from kvlifecycle.replay import check, check_pair, replay

    common = {"regions": args.regions, "blocks": args.blocks, "block_bytes": args.block_bytes, "ttl_s": LOAD_TTL_S,
              "fsync": "never", "max_lifetime_s": WORKER_MAX_LIFETIME_S + 0.1 * args.requests}
    p = WorkerProcess(WorkerConfig("producer", "p0", log_dir=str(logs / "p0"), seed=11, **common), LoadWorker)
    d = WorkerProcess(WorkerConfig("consumer", "d0", log_dir=str(logs / "d0"), **common), LoadWorker)
    plan = _Plan(args.cancel_every, args.expire_every)
    per = args.blocks_per_request
    src_pool, dst_pool = BlockPool(args.blocks), BlockPool(args.blocks)
    d_outcomes: collections.Counter[str] = collections.Counter()
    p_releases: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    rss: dict[str, dict[str, dict[str, int]]] = {}
    started = settled = released = 0
    last_settled = 0.0
    try:
        addr = p.hello["address"]
        d.call("connect", addr)
        rss["start"] = {"p": p.call("rss"), "d": d.call("rss")}
        t0 = time.perf_counter()
        deadline = None
        while settled < args.requests or released < started:
            # start what fits: bounded in flight, and blocks free on both sides
            p_specs: list[list[object]] = []  # the workers' grant_batch / start_batch rows (see LoadWorker)
            d_specs: list[list[object]] = []
            while started + len(p_specs) < args.requests and started + len(p_specs) - settled < args.inflight:
                i = started + len(p_specs)
                request = f"req-{i}"
                src, dst = src_pool.take(request, per), dst_pool.take(request, per)
                if src is None or dst is None:
                    if src is not None:
                        src_pool.give_back(request)
                    if dst is not None:
                        dst_pool.give_back(request)
                    break
                mode, twist = plan.of(i)
                p_specs.append([request, src, 0.0 if twist == "expire" else None, twist == "cancel_p"])
                d_specs.append([request, dst, None, mode, addr, twist == "cancel_d"])
            if p_specs:
                for spec, grant in zip(d_specs, p.call("grant_batch", p_specs), strict=True):
                    spec[2] = grant
                d.call("start_batch", d_specs)
                started += len(p_specs)
            progress = bool(p_specs)
            for request, outcome, latency in d.call("reap_settled"):
                d_outcomes[outcome] += 1
                dst_pool.give_back(request)
                if outcome == "loaded":
                    latencies.append(latency)
                settled += 1
                last_settled = time.perf_counter()
                progress = True
                if settled == args.requests // 2 and "middle" not in rss:
                    rss["middle"] = {"p": p.call("rss"), "d": d.call("rss")}
            for request, reason in p.call("reap_released"):
                p_releases[reason] += 1
                src_pool.give_back(request)
                released += 1
                progress = True
            if started == args.requests and deadline is None:
                deadline = time.monotonic() + SETTLE_TIMEOUT_S
            if deadline is not None and time.monotonic() > deadline:
                break
            if not progress:
                time.sleep(0.001)
        wall = last_settled - t0  # the rate is of handoffs; the leases D dropped unclaimed end by expiry later
        until_leases_ended = time.perf_counter() - t0
        rss.setdefault("middle", rss["start"])
        rss["end"] = {"p": p.call("rss"), "d": d.call("rss")}
        p_state, d_state = p.call("state"), d.call("state")
    finally:
        d.stop()
        p.stop()
    results = [replay(logs / "p0"), replay(logs / "d0")]
    violations = [f"{r.path}: {v}" for r in results for v in check(r, quiescent=True)]
    violations += [str(v) for v in check_pair(results)]
    loaded = d_outcomes["loaded"]
    return {
        "requests": args.requests,
        "inflight": args.inflight,
        "started": started,
        "settled": settled,
        "released": released,
        "wall_s": wall,
        "until_leases_ended_s": until_leases_ended,
        "requests_per_s": settled / wall if wall > 0 else 0.0,
        "loaded_per_s": loaded / wall if wall > 0 else 0.0,
        "latency_p50_ms": _percentile(latencies, 0.50) * 1e3,
        "latency_p99_ms": _percentile(latencies, 0.99) * 1e3,
        "d_outcomes": dict(d_outcomes),
        "p_releases": dict(p_releases),
        "p_leases_left": len(p_state["leases"]),
        "d_loads_left": len(d_state["loads"]),
        "p_refusals": p_state["refusals"],
        "d_refusals": d_state["refusals"],
        "rss_kib": rss,
        "log_events": {"p0": len(results[0].events), "d0": len(results[1].events)},
        "violations": violations,
        "all_ended": settled == started == args.requests and released == started,
        "ok": not violations and settled == started == args.requests and released == started,
    }


def run(args: argparse.Namespace) -> int:
    import sys

    refused = refuse_arguments(args)
    if refused:
        print(f"kvlifecycle bench load: {refused}", file=sys.stderr)
        return 2
    logs = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvl-load-"))
    logs.mkdir(parents=True, exist_ok=True)
    try:
        result = drive(args, logs)
    finally:
        if not args.keep:
            shutil.rmtree(logs, ignore_errors=True)
    if not getattr(args, "json", False):
        _print_table(result)
    print(json.dumps(result) if getattr(args, "json", False) else f"load bench {'OK' if result['ok'] else 'FAILED'}")
    return 0 if result["ok"] else 1


def _print_table(r: dict[str, Any]) -> None:
    print(f"load bench: {r['requests']} requests, {r['inflight']} in flight, over NIXL (DRAM, two processes)")
    print(f"  throughput         {r['requests_per_s']:.0f} requests/s ({r['loaded_per_s']:.0f} loaded/s), "
          f"{r['wall_s']:.1f} s (every lease ended after {r['until_leases_ended_s']:.1f} s)")
    print(f"  handoff latency    p50 {r['latency_p50_ms']:.2f} ms   p99 {r['latency_p99_ms']:.2f} ms")
    for when in ("start", "middle", "end"):
        sides = r["rss_kib"][when]
        p_rss, d_rss = (f"{s['rss_kib'] / 1024:.1f} MiB (peak {s['peak_rss_kib'] / 1024:.1f})"
                        for s in (sides["p"], sides["d"]))
        print(f"  RSS {when:<7}        P {p_rss}   D {d_rss}")
    print(f"  D outcomes         {r['d_outcomes']}")
    print(f"  P releases         {r['p_releases']}")
    print(f"  logs               {r['log_events']} events, "
          f"{'clean at quiescence' if not r['violations'] else str(len(r['violations'])) + ' violation(s)'}")
    for v in r["violations"][:20]:
        print(f"    VIOLATION {v}")
