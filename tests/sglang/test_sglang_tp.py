"""The kvlifecycle backend between prefill and decode of different attention TP sizes, inside real SGLang.

Every TP rank is its own process of the SGLang venv (``sglang_driver.py --tp N --tp-rank R``):
SGLang's own manager, sender/receiver and bootstrap server map the ranks (``CommonKVManager._resolve_rank_mapping``),
the core's TP plans slice the heads. The model has 4 KV heads; each prefill rank fills its own heads' bytes, and
each decode rank checks that its pages hold exactly its heads (the concatenation of two prefill ranks' heads, or
a half of one rank's). No timing is asserted; every wait is bounded by the driver's deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import sglang_harness as h

from kvlifecycle.replay import check, check_pair, replay

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

HEADS = 4
HEAD_BYTES = 64
ROOMS = 3  # after the warm-up room
FIRST_ROOM = 7_001_000  # the plan's warm-up room for seed 1; the transfer rooms follow it


def _args(page_size: int) -> list[str]:
    return ["--page-size", str(page_size), "--heads", str(HEADS), "--item-bytes", str(page_size * HEADS * HEAD_BYTES),
            "--rooms", str(ROOMS), "--deadline", "90", "--linger", "30"]


def _transfer_rooms() -> list[str]:
    return [str(FIRST_ROOM + i) for i in range(ROOMS + 1)]


@pytest.fixture(scope="module")
def p2_d1(tmp_path_factory: pytest.TempPathFactory) -> h.PairRun:
    h.require_sglang()
    return h.run_tp(tmp_path_factory.mktemp("sglang-tp-p2-d1"), "transfer", p_tp=2, d_tp=1, extra=_args(1))


@pytest.fixture(scope="module")
def p1_d2(tmp_path_factory: pytest.TempPathFactory) -> h.PairRun:
    h.require_sglang()
    return h.run_tp(tmp_path_factory.mktemp("sglang-tp-p1-d2"), "transfer", p_tp=1, d_tp=2, extra=_args(1))


def _ranks(run: h.PairRun, role: str) -> list[dict]:
    return [v for k, v in sorted(run.results.items()) if k.startswith(role)]


def _assert_rooms_landed(run: h.PairRun) -> None:
    for result in _ranks(run, "prefill") + _ranks(run, "decode"):
        for room in _transfer_rooms():
            assert result["rooms"][room]["status"] == "success", (result["role"], room, result["rooms"][room])
    for d in _ranks(run, "decode"):
        assert d["mismatches"] == []
        assert d["bytes_equal"] is True  # this rank's heads of every page of every region, and the aux rows
        assert d["untouched_ok"] is True  # pages and aux rows no room targeted kept their sentinel


def _assert_logs_replay_clean(run: h.PairRun, sources: int, targets: int) -> None:
    assert run.log_dir is not None
    results = [replay(p) for p in sorted(run.log_dir.iterdir()) if p.is_dir()]
    assert sorted(r.side for r in results) == ["source"] * sources + ["target"] * targets
    for r in results:
        assert r.tail is None or not r.tail.dropped_bytes
        assert check(r, quiescent=True) == []
    assert check_pair(results) == []


def test_two_prefill_ranks_fill_one_decode_rank_byte_exact(p2_d1: h.PairRun) -> None:
    # D TP 1 reads its 4 heads from P ranks 0 and 1 (SGLang's target_tp_ranks [0, 1]): one load of two parts
    _assert_rooms_landed(p2_d1)
    for p in _ranks(p2_d1, "prefill"):
        assert set(p["reserved_at_send"].values()) == {1}  # each prefill rank streams to the one decode rank
        assert p["streams"]["streamed"] == ROOMS + 1
    (d,) = _ranks(p2_d1, "decode")
    assert d["ledger"]["loads"] == 0
    assert d["ledger"]["counts"]["LOADING"] == 0 and d["ledger"]["counts"]["RESERVED"] == 0


def test_one_prefill_rank_feeds_two_decode_ranks_their_halves(p1_d2: h.PairRun) -> None:
    # D ranks 0 and 1 each take their 2 heads of P rank 0's pages (SGLang's required_dst_info_num 2)
    _assert_rooms_landed(p1_d2)
    (p,) = _ranks(p1_d2, "prefill")
    # the prefill started no room before both decode ranks had reserved it
    assert p["reserved_at_send"] == {room: 2 for room in _transfer_rooms()}
    assert p["streams"]["streamed"] == 2 * (ROOMS + 1)  # one stream per (room, decode rank)
    assert p["ledger"]["leases_at_exit"] == 0 and p["streams_pending_at_exit"] == 0


def test_heterogeneous_tp_logs_replay_clean(p2_d1: h.PairRun, p1_d2: h.PairRun) -> None:
    _assert_logs_replay_clean(p2_d1, sources=2, targets=1)
    _assert_logs_replay_clean(p1_d2, sources=1, targets=2)


def test_differing_tp_with_pages_of_16_tokens_is_refused_with_the_page_size(tmp_path: Path) -> None:
    # SGLang's MHA pages are token-major: the heads of a rank are one slice only in pages of one token
    run = h.run_tp(tmp_path, "refused", p_tp=2, d_tp=1, extra=_args(16),
                   env_extra={"KVL_SGLANG_PEER_TIMEOUT_S": "120"})
    (d,) = _ranks(run, "decode")
    room = d["rooms"][str(FIRST_ROOM + 700)]
    assert room["status"] == "failed", room
    assert "refused this decode's registration" in room["reason"], room
    assert "NHD blocks of 16 tokens" in room["reason"] and "--page-size 1" in room["reason"], room
    assert d["untouched_ok"] is True  # nothing was written


def test_mla_between_different_tp_sizes_fails_the_room_naming_mla(tmp_path: Path) -> None:
    # an MLA backend's latent KV is whole on every rank: a head split would stitch parts of two copies together.
    # The decode refuses the room before it reserves anything, and says why (not a timeout, not a head count)
    run = h.run_tp(tmp_path, "refused", p_tp=2, d_tp=1, extra=[*_args(1), "--mla"],
                   env_extra={"KVL_SGLANG_PEER_TIMEOUT_S": "120"})
    (d,) = _ranks(run, "decode")
    room = d["rooms"][str(FIRST_ROOM + 700)]
    assert room["status"] == "failed", room
    assert "MLA" in room["reason"] and "replicated on every TP rank" in room["reason"], room
    assert d["ledger"]["counts"]["RESERVED"] == 0 and d["ledger"]["counts"]["LOADING"] == 0
