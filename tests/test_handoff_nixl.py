"""P and D in two real processes over NIXL (UCX, DRAM) with ledgers and event logs on.

Every wait is bounded; nothing asserts on time. After each scenario both logs are replayed and checked.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.handoff import REPLY_TYPES
from kvlifecycle.replay import check, check_pair, replay
from kvlifecycle.sidechannel import SideChannelClient, SideChannelRefused
from kvlifecycle.tools.workers import WorkerConfig, WorkerError, WorkerProcess, default_compat

pytestmark = [pytest.mark.nixl, pytest.mark.slow]

SMALL = {"regions": 4, "blocks": 32, "block_bytes": 1024}


def start(side: str, name: str, logs: Path, **kw) -> WorkerProcess:
    cfg = {**SMALL, **kw}
    return WorkerProcess(WorkerConfig(side, name, log_dir=str(logs / name), **cfg))


def collect_released(p: WorkerProcess, want: int = 1, timeout_s: float = 30.0) -> list:
    """P's released leases (freed as they come), waiting (bounded) until ``want`` arrived."""
    released: list = []
    deadline = time.monotonic() + timeout_s
    while len(released) < want and time.monotonic() < deadline:
        released += p.call("free_released")
        if len(released) < want:
            time.sleep(0.01)
    return released


def stop_all(*workers: WorkerProcess) -> None:
    for w in workers:
        if w.proc.is_alive():
            w.stop()


def assert_logs_clean(logs: Path, names: list[str], *, quiescent: bool = True) -> None:
    results = [replay(logs / n) for n in names]
    problems = [str(v) for r in results for v in check(r, quiescent=quiescent)] + [str(v) for v in check_pair(results)]
    assert problems == []


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pair")
    p = start("producer", "p0", logs, seed=3)
    d = start("consumer", "d0", logs)
    link = d.call("connect", p.hello["address"])
    yield p, d, link, logs
    stop_all(d, p)
    assert_logs_clean(logs, ["p0", "d0"])


def test_handshake_exchanges_agents_and_epochs(pair) -> None:
    p, _d, link, _ = pair
    assert link["agent"] == "p0" and link["epoch"] == p.hello["epoch"]
    assert link["parts"] == 1 and link["consumers"] == 1


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_handoff_moves_exact_bytes_and_settles_both_ledgers(pair, mode: str) -> None:
    p, d, _, _ = pair
    addr = p.hello["address"]
    src, dst = ([1, 5, 9, 30], [31, 0, 17, 2]) if mode == "pull" else ([10, 11, 12], [20, 21, 22])
    request = f"r-{mode}"
    grant = p.call("alloc_grant", request, src)
    d.call("reserve", request, dst)
    assert p.call("digest", src) != d.call("digest", dst)
    if mode == "pull":
        d.call("pull", request, [[addr, grant]])
    else:
        d.call("push", request, grant, addr)
    assert d.call("wait", 30.0)
    assert d.call("request_state", request) == "READY_FOR_ATTENTION"
    assert p.call("digest", src) == d.call("digest", dst)
    released = collect_released(p)
    assert released == [[request, grant["transfer"], "completed"]]
    d.call("finish", request)


def test_malformed_side_channel_message_refused_and_peer_keeps_working(pair) -> None:
    p, d, _, _ = pair
    rogue = SideChannelClient(p.hello["address"], REPLY_TYPES, timeout_s=5.0)
    with pytest.raises(SideChannelRefused) as info:
        rogue.request_raw(b"\x92\xa3GET\x00 definitely not an envelope")
    assert info.value.code == "malformed"
    rogue.close()
    assert p.call("state")["refused_side"]["malformed"] >= 1
    # the real consumer is undisturbed
    grant = p.call("alloc_grant", "after-rogue", [3])
    d.call("reserve", "after-rogue", [4])
    d.call("pull", "after-rogue", [[p.hello["address"], grant]])
    assert d.call("wait", 30.0)
    assert p.call("digest", [3]) == d.call("digest", [4])
    d.call("finish", "after-rogue")


def test_compat_mismatch_refused_at_handshake(pair, tmp_path: Path) -> None:
    p, _, _, _ = pair
    bad = start("consumer", "d-bad", tmp_path, compat=default_compat(num_layers=99, dtype="float32"))
    try:
        with pytest.raises(WorkerError) as info:
            bad.call("connect", p.hello["address"])
        text = str(info.value)
        assert "CompatMismatchError" in text and "num_layers: local=99 remote=4" in text
        assert "dtype: local='float32' remote='bfloat16'" in text
    finally:
        stop_all(bad)


def test_tp_ratio_two_counts_consumer_notifications(tmp_path: Path) -> None:
    # P TP 1, D TP 2, HND: 4 KV heads × 4 tokens × 8 dims × 2 bytes = 256 B per P block, 128 B per D rank block
    kw = {"regions": 2, "blocks": 8}
    p = start("producer", "p-tp", tmp_path, block_bytes=256, seed=5, unit_bytes=16,
              compat=default_compat(kv_layout="HND", num_kv_heads=4, head_size=8, block_size=4, dtype="float16"), **kw)
    ds = [start("consumer", f"d-tp{r}", tmp_path, block_bytes=128, tp_rank=r, unit_bytes=16,
                compat=default_compat(kv_layout="HND", num_kv_heads=4, head_size=8, block_size=4, dtype="float16",
                                      tp_size=2), **kw) for r in (0, 1)]
    try:
        addr = p.hello["address"]
        links = [d.call("connect", addr) for d in ds]
        assert [link["consumers"] for link in links] == [2, 2]
        grant = p.call("alloc_grant", "tp", [1, 6], consumers=2)
        for d in ds:
            d.call("reserve", "tp", [2, 3])
        ds[0].call("pull", "tp", [[addr, grant]])
        assert ds[0].call("wait", 30.0)
        # one of two consumers done: the lease must still pin P's blocks
        lease = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            lease = p.call("lease", grant["transfer"])
            if lease and lease["done"]:
                break
            time.sleep(0.01)
        assert lease == {"done": [0], "consumers": 2}
        assert p.call("request_state", "tp") == "PINNED_FOR_TRANSFER"
        ds[1].call("pull", "tp", [[addr, grant]])
        assert ds[1].call("wait", 30.0)
        released = collect_released(p)
        assert released == [["tp", grant["transfer"], "completed"]]
        assert ds[0].call("digest", [2, 3]) == p.call("digest", [1, 6], 0, 128)
        assert ds[1].call("digest", [2, 3]) == p.call("digest", [1, 6], 128, 128)
        for d in ds:
            d.call("finish", "tp")
    finally:
        stop_all(*ds, p)
    assert_logs_clean(tmp_path, ["p-tp", "d-tp0", "d-tp1"])


def test_p_tp_two_to_d_tp_one_reads_both_p_ranks(tmp_path: Path) -> None:
    # P TP 2 (2 KV heads per rank: 128 B blocks), D TP 1 (4 heads: 256 B blocks): D's load has two parts
    hnd = {"kv_layout": "HND", "num_kv_heads": 4, "head_size": 8, "block_size": 4, "dtype": "float16"}
    kw = {"regions": 2, "blocks": 8, "unit_bytes": 16}
    ps = [start("producer", f"p-tp2r{r}", tmp_path, block_bytes=128, seed=20 + r, tp_rank=r,
                compat=default_compat(tp_size=2, **hnd), **kw) for r in (0, 1)]
    d = start("consumer", "d-tp1", tmp_path, block_bytes=256, compat=default_compat(tp_size=1, **hnd), **kw)
    try:
        addrs = [p.hello["address"] for p in ps]
        links = [d.call("connect", a, push=False) for a in addrs]
        assert [link["parts"] for link in links] == [2, 2]
        grants = [p.call("alloc_grant", "tp2", [3, 4]) for p in ps]
        d.call("reserve", "tp2", [6, 1])
        d.call("pull", "tp2", [[a, g] for a, g in zip(addrs, grants, strict=True)])
        assert d.call("wait", 30.0)
        assert d.call("request_state", "tp2") == "READY_FOR_ATTENTION"
        assert d.call("digest", [6, 1], 0, 128) == ps[0].call("digest", [3, 4])
        assert d.call("digest", [6, 1], 128, 128) == ps[1].call("digest", [3, 4])
        for p, g in zip(ps, grants, strict=True):
            assert collect_released(p) == [["tp2", g["transfer"], "completed"]]
        d.call("finish", "tp2")
    finally:
        stop_all(d, *ps)
    assert_logs_clean(tmp_path, ["p-tp2r0", "p-tp2r1", "d-tp1"])


def test_peer_restart_gets_new_epoch_and_old_grants_fail_cleanly(tmp_path: Path) -> None:
    p1 = start("producer", "p-r", tmp_path / "first", seed=1)
    d = start("consumer", "d-r", tmp_path)
    p2 = None
    try:
        addr = p1.hello["address"]
        first = d.call("connect", addr)
        old_grant = p1.call("alloc_grant", "before", [2, 3])
        p1.kill()  # crash: no goodbye
        port = int(addr.rsplit(":", 1)[1])
        p2 = start("producer", "p-r", tmp_path / "second", seed=2, port=port)
        assert p2.hello["address"] == addr
        second = d.call("connect", addr)
        assert second["agent"] == "p-r" and second["epoch"] > first["epoch"]
        # a load against the old incarnation's grant fails cleanly: nothing READY, blocks back to FREE
        d.call("reserve", "before", [0, 1])
        d.call("pull", "before", [[addr, old_grant]])
        assert d.call("wait", 30.0)
        assert d.call("request_state", "before") is None
        # the new incarnation does not know the old lease: the claim is refused, the load never starts, the
        # reservation goes back to FREE
        assert "lease refused" in d.call("abandoned")["before"]
        assert d.call("state")["stats"]["cancelled"] == 1
        # and the new incarnation serves normally
        grant = p2.call("alloc_grant", "after", [4, 5])
        d.call("reserve", "after", [6, 7])
        d.call("pull", "after", [[addr, grant]])
        assert d.call("wait", 30.0)
        assert d.call("digest", [6, 7]) == p2.call("digest", [4, 5])
        d.call("finish", "after")
        assert len(collect_released(p2)) == 1
    finally:
        stop_all(d, *( [p2] if p2 else []))
    d_log = replay(tmp_path / "d-r")
    from kvlifecycle import events as ev

    epochs = [e.epoch for e in d_log.events if isinstance(e, ev.PeerEpochChanged)]
    assert len(epochs) == 2 and epochs[1] > epochs[0]
    assert check(d_log, quiescent=True) == []
    assert_logs_clean(tmp_path, ["second/p-r", "d-r"])


def test_consumer_killed_mid_transfer_producer_reclaims_by_expiry(tmp_path: Path) -> None:
    big = {"regions": 64, "blocks": 128, "block_bytes": 16384}
    p = start("producer", "p-k", tmp_path, seed=9, ttl_s=1.0, **big)
    d = start("consumer", "d-k", tmp_path, **big)
    try:
        addr = p.hello["address"]
        d.call("connect", addr)
        blocks = list(range(128))
        grant = p.call("alloc_grant", "doomed", blocks)
        d.call("reserve", "doomed", blocks)
        d.conn.send_bytes(__import__("msgspec").msgpack.encode(["pull_then_die", ["doomed", [[addr, grant]]], {}]))
        d.proc.join(30)
        assert d.proc.exitcode == 9
        released = collect_released(p)
        assert released == [["doomed", grant["transfer"], "expired"]]
        assert p.call("state")["stats"]["renewed"] >= 1  # D had claimed the lease before it died
    finally:
        stop_all(p)
    p_log = replay(tmp_path / "p-k")
    assert check(p_log, quiescent=True) == []
    d_log = replay(tmp_path / "d-k")  # D crashed: its log replays to the load it had in flight
    assert check(d_log) == []
    assert check_pair([p_log, d_log]) == []
