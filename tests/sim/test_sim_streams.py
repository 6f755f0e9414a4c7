"""Layer-wise streaming and prefix-cache hits in the simulation: their edges and faults are exercised, a streamed
request's bytes are tag-checked layer by layer when it becomes READY, and the stream logic run is the real one."""

from __future__ import annotations

from collections import Counter

from kvlifecycle.machines import TargetState
from kvlifecycle.sim import checks
from kvlifecycle.sim.runner import Simulation, run_seed, run_steps
from kvlifecycle.sim.streams import SimStreamConsumer, SimStreamProducer
from kvlifecycle.sim.world import SimConfig
from kvlifecycle.streaming import StreamConsumer, StreamProducer


def test_sixty_seeds_stream_share_and_decline_cleanly() -> None:
    coverage: Counter[str] = Counter()
    for seed in range(60):
        result = run_seed(seed)
        assert result.ok, (seed, result.violations, result.leaks)
        coverage.update(result.coverage)
    for edge in ("target: LOADING -> LOADING (layer_landed)", "target: LOADING -> RESERVED (decline)"):
        assert coverage[edge], edge
    for fault in ("stream", "stream_declined", "stream_cancel_d", "stream_cancel_p", "prefix_share"):
        assert coverage[f"fault: {fault}"], fault


def test_a_prefix_hit_is_granted_from_the_cache_and_its_bytes_check() -> None:
    """P2 serves r0 locally and caches its blocks; r1 hits that prefix (``share``), is granted from the cached
    blocks and loaded by D0, whose READY bytes are r0's (same blocks, same epoch)."""
    steps = [("arrive", 1, 0, 2, False, ""), ("prefill", 0), ("p_local", 1),  # odd pick: cached
             ("arrive", 1, 0, 2, False, "share"), ("prefill", 0), ("grant", 0)]
    result = run_steps(steps, config=SimConfig(d_groups=(1, 1)))  # D0 a TP-1 worker: one load
    assert result.ok, (result.violations, result.leaks)
    assert result.coverage["fault: prefix_share"] == 1
    assert result.coverage["source: PREFIX_CACHED -> PINNED_FOR_TRANSFER (grant)"] == 1
    assert result.coverage["target: LOADING -> READY_FOR_ATTENTION (part_done [all_parts_done])"] == 1


def _streamed(d, request: str) -> bool:
    loads = [t for t, e in d.expect.items() if e[0] == request]
    return bool(loads) and loads[-1].startswith("stream:")


def _first_streamed_ready(tmp_path) -> tuple[Simulation, object, str]:
    for seed in range(300):
        sim = Simulation(SimConfig(), seed, tmp_path / str(seed))
        ready: list = []
        hook = sim.world.on_ready_hook
        sim.world.on_ready_hook = (lambda d, request, hook=hook, ready=ready:
                                   (ready.append((d, request)), hook(d, request)))
        for _ in range(SimConfig().steps):
            sim.apply(sim.choose())
            for d, request in ready:
                req = d.ledger.requests.get(request)
                if req is not None and req.state == TargetState.READY_FOR_ATTENTION and _streamed(d, request):
                    return sim, d, request
            ready.clear()
    raise AssertionError("no streamed request became READY in 300 seeds")


def test_a_block_missing_one_layer_fails_the_tag_check(tmp_path) -> None:
    """A streamed request READY: every layer of every block checks; wipe one layer (region) of one block and the
    tag check names it (what a block READY before its last layer landed would hold)."""
    sim, d, request = _first_streamed_ready(tmp_path)
    assert checks.tag_check(sim.world, d, request) == [] and not sim.violations
    block = int(d.ledger.requests[request].blocks[-1])
    d.regions[1][block, :] = 0
    found = checks.tag_check(sim.world, d, request)
    assert found and f"block {block} region 1" in found[0]


def test_the_simulated_streams_run_the_real_decisions() -> None:
    """The simulation replaces the threads and the clock, never a decision of the stream classes."""
    for method in ("begin", "layer_done", "cancel", "release", "_on_stream_request", "_on_stream_cancel",
                   "_post_layer", "_halt", "_poll", "_settle"):
        assert method not in SimStreamProducer.__dict__ and method in StreamProducer.__dict__, method
    for method in ("cancel", "_on_note", "_settle", "_failing", "_send_cancel", "request_streams"):
        assert method not in SimStreamConsumer.__dict__ and method in StreamConsumer.__dict__, method
