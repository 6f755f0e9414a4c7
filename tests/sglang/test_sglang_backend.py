"""The kvlifecycle backend inside real SGLang (0.5.23, CPU, DRAM KV over NIXL/UCX loopback).

Each scenario runs SGLang's own KV manager, sender/receiver and bootstrap server (HTTP + ZMQ) in two processes of
the SGLang venv (see ``tests/sglang/sglang_driver.py``); the assertions read what each side reported and
replay both sides' event logs. No timing is asserted; every wait is bounded by the driver's deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang_harness as h

from kvlifecycle.replay import check, check_pair, replay

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

SUITE_ENV = {"KVL_SGLANG_CLAIM_TIMEOUT_S": "4"}  # the unclaimed room fails in seconds (default 120 s)


def _rooms(result: dict, prefix: str = "") -> dict[str, dict]:
    return {k: v for k, v in result["rooms"].items() if k.startswith(prefix)}


def _room(result: dict, plan_offset: int, seed: int = 1) -> dict:
    return result["rooms"][str(7_000_000 + 1000 * seed + plan_offset)]


def _replay_all(log_dir: Path) -> list:
    dirs = sorted(p for p in log_dir.iterdir() if p.is_dir())
    assert dirs, f"no event logs under {log_dir}"
    return [replay(p) for p in dirs]


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> h.PairRun:
    h.require_sglang()
    return h.run_pair(tmp_path_factory.mktemp("sglang-suite"), "suite", env_extra=SUITE_ENV, extra=["--chunked"])


@pytest.fixture(scope="module")
def restart(tmp_path_factory: pytest.TempPathFactory) -> h.PairRun:
    h.require_sglang()
    # a long silence window, so the restart is caught by its epoch, not by the silence of the dead process
    return h.run_restart(tmp_path_factory.mktemp("sglang-restart"), env_extra={"KVL_SGLANG_PEER_TIMEOUT_S": "120"})


def test_plugin_path_adds_kvlifecycle_and_leaves_nixl_alone() -> None:
    probe = h.run_probe(Path(__file__).with_name("plugin_probe.py"), {"SGLANG_PLUGINS": "kvlifecycle"})
    assert probe["member"] == "KVLIFECYCLE"
    assert "kvlifecycle" in probe["choices"]
    assert probe["parsed_backend"] == "kvlifecycle"
    assert probe["classes"] == {
        "MANAGER": "kvlifecycle.adapters.sglang.manager.KVLifecycleKVManager",
        "SENDER": "kvlifecycle.adapters.sglang.conn.KVLifecycleKVSender",
        "RECEIVER": "kvlifecycle.adapters.sglang.conn.KVLifecycleKVReceiver",
        "BOOTSTRAP_SERVER": "kvlifecycle.adapters.sglang.conn.KVLifecycleKVBootstrapServer",
    }
    assert probe["halves"] == {  # one class for both roles; made for a role, it is that role's half
        "PREFILL": "kvlifecycle.adapters.sglang.prefill.PrefillKVManager",
        "DECODE": "kvlifecycle.adapters.sglang.decode.DecodeKVManager",
    }
    assert probe["nixl"]["MANAGER"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager"
    assert probe["nixl"]["SENDER"] == "sglang.srt.disaggregation.nixl.conn.NixlKVSender"
    assert probe["kvargs_shared"] == "KVArgs"
    assert probe["nixl_members_intact"] == ["mooncake", "mori", "nixl", "ascend", "fake"]


def test_sglang_plugins_filter_keeps_the_backend_out() -> None:
    probe = h.run_probe(Path(__file__).with_name("plugin_probe.py"), {"SGLANG_PLUGINS": "some_other_plugin"})
    assert probe["member"] is None
    assert "kvlifecycle" not in probe["choices"]
    assert probe["nixl"]["MANAGER"] == "sglang.srt.disaggregation.nixl.conn.NixlKVManager"


def test_transfer_is_byte_exact_and_leaves_other_pages_untouched(suite: h.PairRun) -> None:
    d, p = suite.results["decode"], suite.results["prefill"]
    for offset in (0, 1, 2, 3, 4):  # warm-up + 4 rooms
        assert _room(d, offset)["status"] == "success", _room(d, offset)
        assert _room(p, offset)["status"] == "success", _room(p, offset)
    assert d["mismatches"] == []
    assert d["bytes_equal"] is True  # KV pages of every region and every aux (metadata) row
    assert d["untouched_ok"] is True  # pages and aux rows no successful room targeted kept their sentinel


def test_malformed_control_frames_are_refused_and_lose_nothing(suite: h.PairRun) -> None:
    d, p = suite.results["decode"], suite.results["prefill"]
    assert d["malformed_sent"] == 2 and d["foreign_sent"] == 1
    assert d["malformed_answers"] == ["malformed", "malformed"]  # each answered in words, not dropped
    assert p["malformed"] == 2  # the shared side channel refused and counted both, never half-applied
    assert p["rank_socket_refused"] == 1  # SGLang's rank socket takes its ABORT frames only
    assert all(_room(p, offset)["status"] == "success" for offset in (1, 2, 3, 4))  # sent after the garbage


def test_abort_by_decode_is_acknowledged_and_nothing_lands(suite: h.PairRun) -> None:
    d, p = suite.results["decode"], suite.results["prefill"]
    for offset in (200, 201):  # before metadata; after metadata, with P holding its send until the ABORT went out
        assert _room(p, offset)["status"] == "failed"
        assert "aborted by decode" in _room(p, offset)["reason"]
        assert _room(d, offset)["status"] == "failed"
        assert _room(d, offset)["abort_acked"] is True, _room(d, offset)
    # the room whose pages D had published got no byte (untouched_ok covers its pages)
    assert d["untouched_ok"] is True
    # P streamed only the rooms that transferred (warm-up + 4 rooms), one post per chunk (two rooms in two chunks)
    assert p["streams"]["streamed"] == 5 and p["streams"]["layers_posted"] == 7


def test_prefill_abort_reaches_decode(suite: h.PairRun) -> None:
    d, p = suite.results["decode"], suite.results["prefill"]
    assert _room(p, 202)["status"] == "failed"
    assert _room(d, 202)["status"] == "failed"
    assert "aborted on prefill" in _room(d, 202)["reason"]


def test_room_no_decode_claims_fails_with_a_bootstrap_timeout(suite: h.PairRun) -> None:
    p = suite.results["prefill"]
    assert _room(p, 203)["status"] == "failed"
    assert "bootstrap timeout" in _room(p, 203)["reason"]


def test_ledgers_end_quiescent(suite: h.PairRun) -> None:
    d, p = suite.results["decode"], suite.results["prefill"]
    assert p["ledger"]["leases_at_exit"] == 0 and p["streams_pending_at_exit"] == 0
    assert p["ledger"]["counts"]["PINNED_FOR_TRANSFER"] == 0
    assert d["ledger"]["loads"] == 0
    assert d["ledger"]["counts"]["LOADING"] == 0 and d["ledger"]["counts"]["RESERVED"] == 0
    assert p["ledger"]["refusals"] == {} and d["ledger"]["refusals"] == {}


def test_both_event_logs_replay_clean(suite: h.PairRun) -> None:
    results = _replay_all(suite.log_dir)
    assert sorted(r.side for r in results) == ["source", "target"]
    for r in results:
        assert r.tail is None or not r.tail.dropped_bytes
        assert check(r, quiescent=True) == []
    assert check_pair(results) == []
    source = next(r for r in results if r.side == "source")
    target = next(r for r in results if r.side == "target")
    # the same transfer ids on both sides: P's writes (one per chunk) and D's loads (one per room, a stream) line
    # up in the merged log
    written = [e.transfer for e in source.events if type(e).__name__ == "TransferObserved"]
    loaded = {e.transfer for e in target.events if type(e).__name__ == "TgtLoadStarted"}
    assert written and set(written) <= loaded
    assert max(written.count(t) for t in written) == 2  # the chunked rooms really went out in chunks


def test_peer_that_never_appears_fails_the_receiver(tmp_path: Path) -> None:
    h.require_sglang()
    port, absent = h.free_port(), h.free_port()
    env = h.base_env(tmp_path / "logs", KVL_SGLANG_CLAIM_TIMEOUT_S="3")
    proc = h.spawn("decode", tmp_path, ["--role", "decode", "--scenario", "never", "--port", str(port),
                                        "--absent-port", str(absent), "--deadline", "60"], env)
    try:
        proc.wait(180)
        d = proc.result()
    finally:
        h.kill(proc)
    assert d["parallel_info"] is False
    room = _room(d, 500)
    assert room["status"] == "failed", room  # not Bootstrapping until the driver's deadline
    assert str(absent) in room["reason"] and "never appeared within 3 s" in room["reason"]


def _ledgers_quiescent(run: h.PairRun) -> None:
    d, p = run.results["decode"], run.results["prefill"]
    assert p["ledger"]["leases_at_exit"] == 0
    assert p["ledger"]["counts"]["PINNED_FOR_TRANSFER"] == 0
    assert d["ledger"]["loads"] == 0
    assert d["ledger"]["counts"]["LOADING"] == 0 and d["ledger"]["counts"]["RESERVED"] == 0
    for r in _replay_all(run.log_dir):
        assert check(r, quiescent=True) == []


def test_room_a_live_prefill_never_serves_ends_on_both_sides(tmp_path: Path) -> None:
    # P heartbeats and bootstraps the room but never sends: SGLang's waiting timeout is off in this backend,
    # so only the serve bound ends it; D's reserved pages must come back.
    run = h.run_pair(tmp_path, "silent", env_extra={"KVL_SGLANG_SERVE_TIMEOUT_S": "3"})
    d, p = run.results["decode"], run.results["prefill"]
    assert _room(d, 0)["status"] == "success" and _room(p, 0)["status"] == "success"
    assert _room(d, 600)["status"] == "failed", _room(d, 600)
    assert _room(p, 600)["status"] == "failed", _room(p, 600)
    for side in (d, p):
        assert "did not serve room" in _room(side, 600)["reason"] and "3 s" in _room(side, 600)["reason"]
    _ledgers_quiescent(run)


def test_refused_registration_reaches_decode_with_its_reason(tmp_path: Path) -> None:
    # D's KV rows are half the size of P's (SGLang checks the page size itself, not this): P refuses the
    # registration and tells D, whose room fails with P's reason, not 120 s later as "prefill silent".
    run = h.run_pair(tmp_path, "refused", env_extra={"KVL_SGLANG_PEER_TIMEOUT_S": "120"},
                     decode_extra=["--item-bytes", "2048"])
    room = _room(run.results["decode"], 700)
    assert room["status"] == "failed", room
    assert "refused this decode's registration" in room["reason"], room
    assert "KV layout mismatch" in room["reason"], room
    assert "silent" not in room["reason"]


def test_restarted_prefill_is_caught_by_its_epoch(restart: h.PairRun) -> None:
    d = restart.results["decode"]
    p1, p2 = restart.results["prefill1"], restart.results["prefill2"]
    assert p1.get("crashed") is True
    crash = _room(d, 300)
    assert crash["status"] == "failed"
    assert "restarted" in crash["reason"] and str(p1["epoch"]) in crash["reason"]
    # the rooms after the restart go through the new incarnation, byte-exact
    for offset in (400, 401, 402, 403):
        assert _room(d, offset)["status"] == "success", _room(d, offset)
    assert d["bytes_equal"] is True and d["untouched_ok"] is True
    assert set(d["ledger"]["peer_epochs"].values()) == {p2["epoch"]}
    assert p2["epoch"] > p1["epoch"]


def test_restart_logs_replay_clean_and_record_the_epoch_change(restart: h.PairRun) -> None:
    results = _replay_all(restart.log_dir)
    assert sorted(r.side for r in results) == ["source", "source", "target"]
    target = next(r for r in results if r.side == "target")
    for r in results:
        assert check(r, quiescent=True) == []
    assert check_pair(results) == []
    kinds = [type(e).__name__ for e in target.events]
    assert kinds.count("PeerEpochChanged") == 2  # first sight of prefill #1, then #2
    failed = [e for e in target.events if type(e).__name__ == "TgtLoadFailed"]
    assert len(failed) == 1 and failed[0].reason.startswith("peer_restarted")


def test_serial_rooms_each_land_byte_exact_one_at_a_time_with_a_latency_each(tmp_path: Path) -> None:
    """The benchmark's small-room mode (driver scenario ``serial``): every room succeeds, its bytes are P's, and the
    decode reports one latency per room (the rooms go one at a time, so one missing would mean one never landed)."""
    run = h.run_pair(tmp_path, "serial", extra=["--rooms", "6", "--aux-rows", "40"])
    d = run.results["decode"]
    assert all(_room(d, offset)["status"] == "success" for offset in range(7)), d["rooms"]
    assert d["bytes_equal"] is True and d["untouched_ok"] is True
    assert len(d["room_latencies_s"]) == 6
    assert all(t > 0 for t in d["room_latencies_s"])
