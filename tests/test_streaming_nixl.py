"""Layer-wise streaming between two real processes over NIXL (UCX, DRAM), both event logs on.

D reserves and sends its reservation before P begins; P posts each layer's blocks as it "computes" them (the test
plays P's forward pass: chunk by chunk, layer by layer). Every wait is bounded; nothing asserts on time. After each
scenario both logs are replayed and checked (a partially loaded block never READY, no leak, no duplicate layer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from streaming_worker import StreamWorkerProcess

from kvlifecycle import events as ev
from kvlifecycle.eventlog import read_events
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.tools.workers import WorkerConfig

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

LAYERS, RPL = 4, 2  # 4 layers, K and V regions each
SHAPE = {"regions": LAYERS * RPL, "blocks": 32, "block_bytes": 1024}


def start(side: str, name: str, logs: Path, **kw) -> StreamWorkerProcess:
    w = StreamWorkerProcess(WorkerConfig(side, name, log_dir=str(logs / name), **{**SHAPE, **kw}))
    return w


def assert_logs_clean(logs: Path, names: list[str]) -> None:
    results = [replay(logs / n) for n in names]
    problems = [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]
    assert problems == []


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("stream")
    p = start("producer", "p0", logs, seed=5)
    d = start("consumer", "d0", logs)
    p.call("stream_setup", LAYERS, RPL)
    d.call("stream_setup", LAYERS, RPL, 20.0)
    d.call("connect", p.hello["address"])
    yield p, d, logs
    for w in (d, p):
        if w.proc.is_alive():
            w.stop()
    assert_logs_clean(logs, ["p0", "d0"])


def _forward(p: StreamWorkerProcess, request: str, src: list[int], upto: int) -> None:
    """P's forward pass over one chunk: after each layer, the blocks complete so far."""
    for layer in range(LAYERS):
        p.call("layer", request, layer, src[:upto])


def test_a_stream_lands_layer_by_layer_and_is_ready_only_after_the_last(pair) -> None:
    p, d, logs = pair
    src, dst = [1, 5, 9, 30, 2], [31, 0, 17, 3, 8]
    p.call("allocate", "s1", src)
    d.call("reserve", "s1", dst)
    transfer = d.call("stream", "s1", p.hello["address"], LAYERS)
    assert transfer is not None
    assert p.call("begin", "s1")  # the reservation was there before the prefill began
    _forward(p, "s1", src, 3)  # chunk 1: three blocks complete
    assert d.call("wait_landed", transfer, 3 * LAYERS) == 3 * LAYERS
    assert d.call("request_state", "s1") == "LOADING"  # every layer of 3 blocks landed; 2 blocks still lack all
    assert p.call("digest", src[:3]) == d.call("digest", dst[:3])
    _forward(p, "s1", src, 5)  # chunk 2: the rest; blocks 0-2 are not sent again
    p.call("prefill_done_release", "s1")
    assert d.call("wait_streams") and p.call("wait_streams")
    assert d.call("request_state", "s1") == "READY_FOR_ATTENTION"
    assert p.call("digest", src) == d.call("digest", dst)
    assert p.call("counts")["layers_posted"] == 2 * LAYERS  # one WRITE per (chunk, layer), nothing twice
    assert p.call("request_state", "s1") is None  # P freed its blocks once its writes settled
    d.call("finish", "s1")
    d_events = list(read_events(logs / "d0"))
    landed = [e for e in d_events if isinstance(e, ev.TgtLayersLanded) and e.transfer == transfer]
    assert len(landed) == 2 * LAYERS
    done = [i for i, e in enumerate(d_events) if isinstance(e, ev.TgtPartDone) and e.transfer == transfer]
    assert done == [d_events.index(landed[-1]) + 1]  # READY came with the last layer batch, not before
    p_posts = [e for e in read_events(logs / "p0") if isinstance(e, ev.TransferObserved) and e.transfer == transfer]
    assert len(p_posts) == 2 * LAYERS and all(e.ok for e in p_posts)  # the per-layer posts, for the timeline


def test_prefill_ended_before_the_reservation_falls_back_to_the_post_prefill_push(pair) -> None:
    p, d, _ = pair
    before = p.call("counts")
    src, dst = [10, 11], [20, 21]
    assert not p.call("begin", "s2")  # no reservation yet: P never waits for D
    assert not p.call("prefill_ended", "s2")  # none came before the prefill's end: the post-prefill path
    grant = p.call("alloc_grant", "s2", src)
    d.call("reserve", "s2", dst)
    assert d.call("stream", "s2", p.hello["address"], LAYERS) is None  # declined: nothing was written
    assert d.call("request_state", "s2") == "RESERVED"
    d.call("push", "s2", grant, p.hello["address"])  # the fallback, into the same reservation
    assert d.call("wait", 30.0)
    assert d.call("request_state", "s2") == "READY_FOR_ATTENTION"
    assert p.call("digest", src) == d.call("digest", dst)
    after = p.call("counts")
    assert after["fallback"] == before["fallback"] + 1 and after["declined"] == before["declined"] + 1
    released = []
    for _ in range(3000):
        released += p.call("free_released")
        if released:
            break
    assert released == [["s2", grant["transfer"], "completed"]]
    d.call("finish", "s2")


def test_a_write_failing_at_layer_k_of_n_fails_the_request_with_no_ready_block_and_no_leak(pair) -> None:
    p, d, logs = pair
    src, dst = [12, 13, 14], [22, 23, 24]
    held = d.call("held")
    p.call("fail_writes_of_layer", 2)
    try:
        p.call("allocate", "s3", src)
        d.call("reserve", "s3", dst)
        transfer = d.call("stream", "s3", p.hello["address"], LAYERS)
        assert p.call("begin", "s3")
        _forward(p, "s3", src, 3)
        assert d.call("wait_streams")
        assert d.call("request_state", "s3") is None  # policy fail: the request's blocks are FREE
        assert d.call("held") == held
        p.call("prefill_done_release", "s3")
        assert p.call("wait_streams") and p.call("request_state", "s3") is None
        assert p.call("counts")["layers_posted"] >= 2
    finally:
        p.call("fail_writes_of_layer", -1)  # the real transport again, for the next tests
    d_events = [e for e in read_events(logs / "d0") if getattr(e, "transfer", None) == transfer]
    assert not any(isinstance(e, ev.TgtPartDone) for e in d_events)
    failed = [e for e in d_events if isinstance(e, ev.TgtLoadFailed)]
    assert len(failed) == 1 and "layer 2" in failed[0].reason


def test_d_cancels_mid_stream_no_new_layer_is_posted_and_both_sides_end_clean(pair) -> None:
    p, d, _ = pair
    src, dst = [15, 16], [25, 26]
    d_held, p_before = d.call("held"), p.call("counts")["layers_posted"]
    p.call("allocate", "s4", src)
    d.call("reserve", "s4", dst)
    transfer = d.call("stream", "s4", p.hello["address"], LAYERS)
    assert p.call("begin", "s4")
    p.call("layer", "s4", 0, src)
    assert d.call("wait_landed", transfer, 2) == 2
    assert d.call("stream_cancel", "s4")
    assert d.call("wait_streams")  # settled after P's writes did
    assert d.call("request_state", "s4") is None and d.call("held") == d_held
    p.call("layer", "s4", 1, src)  # the forward goes on: nothing is posted any more
    p.call("prefill_done_release", "s4")
    assert p.call("wait_streams") and p.call("request_state", "s4") is None
    assert p.call("counts")["layers_posted"] == p_before + 1


def test_p_killed_mid_stream_d_times_out_and_releases_its_reservation(tmp_path: Path) -> None:
    p = start("producer", "p-dies", tmp_path, seed=7)
    d = start("consumer", "d-survives", tmp_path)
    try:
        p.call("stream_setup", LAYERS, RPL)
        d.call("stream_setup", LAYERS, RPL, 2.0)
        d.call("connect", p.hello["address"])
        p.call("allocate", "s5", [1, 2])
        d.call("reserve", "s5", [3, 4])
        transfer = d.call("stream", "s5", p.hello["address"], LAYERS)
        assert p.call("begin", "s5")
        p.call("layer", "s5", 0, [1, 2])
        assert d.call("wait_landed", transfer, 2) == 2
        p.kill()
        assert d.call("wait_streams", 30.0)
        assert d.call("request_state", "s5") is None and d.call("held") == 0
        assert d.call("counts")["timed_out"] == 1
    finally:
        if d.proc.is_alive():
            d.stop()
    r = replay(tmp_path / "d-survives")
    assert [str(v) for v in check(r, quiescent=True)] == []
