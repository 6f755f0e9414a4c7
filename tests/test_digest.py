"""Per-block KV digests in the core: the digest is position independent and catches one flipped byte, a wrong
slot and a wrong head slice; the grant's digest field is wire-compatible both ways and its decoder total; a
mismatch is an event that fails the load under the policy, quarantines the blocks, replays, and is told by
``replay --request`` and ``explain``; so is a verified part (its ``TgtPartDone`` counts the blocks checked)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
from debug_scenarios import Pair
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlifecycle import events as ev
from kvlifecycle.cli import main
from kvlifecycle.clock import ManualClock
from kvlifecycle.control import GrantReply
from kvlifecycle.digest import (
    DIGEST_ALGO,
    BlockDigests,
    DigestError,
    VerifyMode,
    batch_digest,
    digest_units,
    expected_digests,
    mismatched,
    should_digest,
    slice_view,
)
from kvlifecycle.explain import DIGEST_MISMATCH, digest_tally, explain_logs
from kvlifecycle.ledger import BlockBusyError, TargetLedger
from kvlifecycle.replay import replay

RNG = np.random.default_rng(7)


def pool(num_blocks: int = 8, block_bytes: int = 64, regions: int = 3) -> list[list[np.ndarray]]:
    return [[RNG.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]]


def test_a_block_keeps_its_digest_in_another_slot_and_loses_it_to_one_flipped_byte() -> None:
    src = pool()
    dst = [[np.zeros_like(r) for r in src[0]]]
    for s, d in zip(src[0], dst[0], strict=True):
        d[5] = s[2]  # P's block 2 lands in D's slot 5
    want = digest_units(src, np.array([2]))
    assert digest_units(dst, np.array([5])) == want
    assert digest_units(dst, np.array([4])) != want  # the wrong slot
    dst[0][1][5, 17] ^= 0x01  # one bit of one byte in the middle region
    assert digest_units(dst, np.array([5])) != want


def _two_level(slices: list[bytes]) -> int:
    """The contract spelled out: XXH3-64 per region's slice (a leaf), XXH64 over the leaves as little-endian u64."""
    import xxhash

    leaves = b"".join(xxhash.xxh3_64_intdigest(s).to_bytes(8, "little") for s in slices)
    return int(xxhash.xxh64_intdigest(leaves))


def test_the_digest_is_xxh64_over_each_regions_xxh3_leaf_and_pieces_concatenate_per_region() -> None:
    """The wire contract (``DIGEST_ALGO``): a leaf per region, in order, the root over them; a unit of two pieces
    (D's sub-blocks of one P block) hashes each region's pieces in order, the byte order of the one P block. Swapping
    two regions' slices (equal bytes, other order) changes the digest; the flat XXH3 of the concatenation (the
    digest of before, whose peers are refused by name) is not what is computed."""
    import xxhash

    assert DIGEST_ALGO == "xxh3-64/xxh64"
    src = pool(block_bytes=1024, regions=3)
    want = _two_level([src[0][r][3].tobytes() for r in range(3)])
    assert digest_units(src, np.array([3]))[0] == want
    assert want != xxhash.xxh3_64_intdigest(b"".join(src[0][r][3].tobytes() for r in range(3)))
    two = _two_level([src[0][r][5].tobytes() + src[0][r][1].tobytes() for r in range(3)])
    assert digest_units(src, np.array([[5, 1]]))[0] == two
    swapped = [[src[0][1], src[0][0], src[0][2]]]
    assert digest_units(swapped, np.array([3]))[0] != want


def test_a_region_subset_reads_each_units_own_group_in_order_and_combines_into_one_batch_digest() -> None:
    """A stream's layer batch digests only its layer's regions (indexed over every group's regions): a unit of
    the first group reads the chosen regions of that group, one of the second group (SGLang's aux row) those of
    its own; the batch digest is XXH3-64 over the units' digests, so it changes with any unit or their order."""
    import xxhash

    groups = [[RNG.integers(0, 256, (4, 32), dtype=np.uint8) for _ in range(3)],
              [RNG.integers(0, 256, (2, 8), dtype=np.uint8)]]
    page, aux = digest_units(groups, np.array([1, 4]), only=[2, 0, 3])  # block 4: the second group's row 0
    assert page == _two_level([groups[0][2][1].tobytes(), groups[0][0][1].tobytes()])
    assert aux == _two_level([groups[1][0][0].tobytes()])
    assert digest_units(groups, np.array([1]), only=[1])[0] != digest_units(groups, np.array([1]))[0]
    both = digest_units(groups, np.array([1, 4]), only=[2, 0, 3])
    assert batch_digest(both) == xxhash.xxh3_64_intdigest(both.astype("<u8").tobytes())
    assert batch_digest(both) != batch_digest(both[::-1]) and batch_digest(both) != batch_digest(both[:1])


def test_head_slices_are_digested_apart_and_a_swapped_slice_is_caught() -> None:
    """D TP 2 reads P TP 1's blocks in two head slices: each slice has its digest; a D whose slice landed in the
    other heads' place fails. Pieces of a unit (a block-size split) concatenate per region."""
    src = pool(block_bytes=64)
    halves = [slice_view(64, 2, i) for i in range(2)]
    assert halves == [(0, 32), (32, 32)]
    per_slice = [digest_units(src, np.array([1, 3]), offset=o, length=n) for o, n in halves]
    assert (per_slice[0] != per_slice[1]).all()
    # D rank 1 holds the second half of P's heads in whole blocks of 32 bytes
    rank1 = [[r[:, 32:].copy() for r in src[0]]]
    assert (digest_units(rank1, np.array([1, 3])) == per_slice[1]).all()
    wrong = [[r[:, :32].copy() for r in src[0]]]  # written with rank 0's heads
    assert (digest_units(wrong, np.array([1, 3])) != per_slice[1]).all()
    # a P block of 64 bytes split into two D blocks of 32 (per region: first half, second half)
    split = [[np.concatenate([r[:, :32], r[:, 32:]], axis=0) for r in src[0]]]  # D blocks 0..7 and 8..15
    assert digest_units(split, np.array([[3, 11]])) == digest_units(src, np.array([3]))
    assert digest_units(split, np.array([[11, 3]])) != digest_units(src, np.array([3]))


def test_a_unit_across_region_groups_is_refused() -> None:
    groups = [pool(4)[0], pool(2, block_bytes=16, regions=1)[0]]
    digest_units(groups, np.array([0, 4, 5]))  # page blocks 0-3, aux rows 4-5
    with pytest.raises(DigestError):
        digest_units(groups, np.array([[3, 4]]))
    with pytest.raises(DigestError):
        digest_units(groups, np.array([6]))


def test_sample_mode_chooses_by_transfer_id_and_both_sides_agree() -> None:
    ids = [f"p0-{i}" for i in range(800)]
    chosen = [t for t in ids if should_digest("sample", t)]
    assert 0 < len(chosen) < len(ids) // 4
    assert chosen == [t for t in ids if should_digest(VerifyMode.SAMPLE, t)]
    assert all(should_digest("all", t) for t in ids) and not any(should_digest("none", t) for t in ids)
    with pytest.raises(ValueError, match="verify must be"):
        should_digest("some", "t")


# --- the wire field -----------------------------------------------------------------------------------------------


class OldGrantReply(msgspec.Struct, frozen=True, tag="GrantReply"):
    """GrantReply as an older peer defines it: no ``digests``."""

    request: str
    transfer: str
    generation: int
    worker: str
    block_ids: list[int]
    consumers: int
    ttl_s: float
    agent: str
    epoch: int
    tp_rank: int = 0


def grant(digests: BlockDigests | None = None) -> GrantReply:
    return GrantReply("r", "t", 1, "p0", [3, 4], 1, 30.0, "agent", 0, 0, digests)


def test_the_digest_field_crosses_the_wire_and_old_peers_interoperate() -> None:
    values = np.array([[11, 12], [21, 22]], dtype=np.uint64)
    new = grant(BlockDigests.of(values))
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=GrantReply)
    assert back == new and back.digests.algo == DIGEST_ALGO
    assert (expected_digests(back.digests, 2, 1) == values[1]).all()
    # an older D skips the field; an older P's grant decodes with no digests: D checks nothing
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldGrantReply)
    assert old.block_ids == [3, 4]
    from_old = msgspec.msgpack.decode(msgspec.msgpack.encode(OldGrantReply("r", "t", 1, "p0", [3, 4], 1, 30.0, "a",
                                                                           0)), type=GrantReply)
    assert isinstance(from_old, GrantReply) and from_old.digests is None


@pytest.mark.parametrize("field, bad", [
    ("algo", "adler32"), ("values", b"\0" * 12), ("slice", 2),
])
def test_a_digest_field_that_does_not_fit_its_grant_is_refused_in_words(field: str, bad: object) -> None:
    good = BlockDigests.of(np.array([[1, 2], [3, 4]], dtype=np.uint64))
    digests = msgspec.structs.replace(good, **{field: bad}) if field != "slice" else good
    with pytest.raises(DigestError):
        expected_digests(digests, 2, bad if field == "slice" else 0)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=96), blocks=st.integers(0, 8), index=st.integers(-2, 4))
def test_the_digest_decoder_is_total(raw: bytes, blocks: int, index: int) -> None:
    """Any bytes: a typed decode error, or a field whose use gives digests or a DigestError, nothing else."""
    try:
        digests = msgspec.msgpack.decode(raw, type=BlockDigests)
    except msgspec.DecodeError:
        return
    try:
        out = expected_digests(digests, blocks, index)
    except DigestError:
        return
    assert out.shape == (blocks,)


@settings(max_examples=100, deadline=None)
@given(algo=st.text(max_size=8), slices=st.integers(-3, 1 << 11), values=st.binary(max_size=64))
def test_out_of_bounds_digest_fields_are_decode_errors(algo: str, slices: int, values: bytes) -> None:
    raw = msgspec.msgpack.encode([algo, slices, values])
    try:
        d = msgspec.msgpack.decode(raw, type=BlockDigests)
    except msgspec.ValidationError:
        assert not 1 <= slices <= 1 << 10
        return
    assert 1 <= d.slices <= 1 << 10


# --- the event, the policy and the quarantine ---------------------------------------------------------------------


def mismatch(d: TargetLedger, transfer: str, **kw: object) -> bool:
    args: dict[str, object] = {"blocks": [2], "source_blocks": [7], "expected": np.array([0xAA], np.uint64),
                               "found": np.array([0xBB], np.uint64), "quarantine_s": 5.0, **kw}
    return d.digest_mismatch(transfer, 0, **args)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_mismatch_fails_the_load_under_the_policy_and_quarantines_the_block(policy: str) -> None:
    clock = ManualClock()
    d = TargetLedger(16, clock=clock, failure_policy=policy)
    d.reserve("r", [1, 2, 3])
    d.start_load("r", "t1")
    assert mismatch(d, "t1")
    assert not d.part_done("t1")  # nothing of it ever becomes READY_FOR_ATTENTION: only a failure ends it
    assert d.requests["r"].state == 2  # LOADING, until the failure (once sibling reads settled)
    assert d.fail("t1", "digest mismatch")
    assert "t1" not in d.loads and d.stats["digest_mismatches"] == 1 and not d.mismatched
    if policy == "recompute":
        assert d.requests["r"].state == 1  # RESERVED: the engine computes into them itself
        d.local_fill("r")
        d.finish("r")
    else:
        assert "r" not in d.requests
    with pytest.raises(BlockBusyError, match="block 2 is quarantined"):
        d.reserve("r2", [2, 4])
    d.reserve("r3", [1, 3])  # the blocks that passed are not held
    clock.advance(5.0)
    d.reserve("r2", [2, 4])  # the quarantine ended
    assert d.quarantined() == {}


def test_a_mismatch_that_does_not_fit_its_load_is_refused_and_recorded() -> None:
    d = TargetLedger(16, clock=ManualClock())
    d.reserve("r", [1, 2, 3])
    d.start_load("r", "t1", parts=2)
    seen: list[ev.Event] = []
    d.listeners.append(seen.append)
    assert not mismatch(d, "nope")
    assert not mismatch(d, "t1", blocks=[9])  # not the request's
    assert not mismatch(d, "t1", found=np.array([1, 2], np.uint64))
    assert not mismatch(d, "t1", source_blocks=[])
    assert d.part_done("t1", 0)
    assert not mismatch(d, "t1")  # part 0 completed already: its bytes are in attention's hands
    assert d.digest_mismatch("t1", 1, blocks=[2], source_blocks=[7], expected=np.array([1], np.uint64),
                             found=np.array([2], np.uint64))
    assert not d.part_done("t1", 1)
    refusals = [e for e in seen if isinstance(e, ev.Refused) and e.command == "digest_mismatch"]
    assert len(refusals) == 5
    assert [e.command for e in seen if isinstance(e, ev.Refused)][-1] == "part_done"
    assert d.stats["digest_mismatches"] == 1


def test_the_fold_of_a_mismatch_equals_the_live_ledger(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [4, 5, 6], [10, 11, 12])
    pair.pull("req-1", g)
    pair.ms(3)
    assert pair.d.digest_mismatch(g.transfer, 0, blocks=[11], source_blocks=[5], slice_index=0,
                                  expected=np.array([0x1234], np.uint64), found=np.array([0x5678], np.uint64),
                                  quarantine_s=30.0)
    assert pair.d.fail(g.transfer, "digest mismatch: 1 block(s) of part 0")
    live = dict(pair.d.quarantine)
    pair.ms(1)
    assert pair.p.fail(g.transfer, g.generation, "consumer failed: digest mismatch")
    for released in pair.p.take_released():
        pair.p.free(released.request)
    _, d_dir = pair.close()
    folded = replay(d_dir).ledger
    assert isinstance(folded, TargetLedger)
    assert folded.quarantine == live and folded.stats["digest_mismatches"] == 1


def test_explain_and_the_request_story_name_the_block_the_transfer_and_both_digests(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [4, 5, 6], [10, 11, 12])
    pair.pull("req-1", g)
    pair.ms(3)
    pair.d.digest_mismatch(g.transfer, 0, blocks=[11], source_blocks=[5], expected=np.array([0x1234], np.uint64),
                           found=np.array([0x5678], np.uint64), quarantine_s=30.0)
    pair.d.fail(g.transfer, "digest mismatch: 1 block(s) of part 0")
    pair.p.fail(g.transfer, g.generation, "consumer failed: digest mismatch")
    for released in pair.p.take_released():
        pair.p.free(released.request)
    pair.close()
    _, findings = explain_logs([tmp_path])
    (finding,) = findings
    assert finding.rule == DIGEST_MISMATCH and finding.transfer == g.transfer and finding.request == "req-1"
    assert "block 11 (P block 5): expected 0000000000001234, found 0000000000005678" in finding.sentence
    assert "before attention read them: the load failed" in finding.sentence
    assert main(["explain", str(tmp_path)]) == 1
    capsys.readouterr()
    assert main(["replay", str(tmp_path / "p0"), str(tmp_path / "d0"), "--request", "req-1", "--json"]) == 0
    story = json.loads(capsys.readouterr().out)
    text = json.dumps(story)
    assert "digest mismatch" in text and "expected 0000000000001234" in text


def test_mismatched_positions() -> None:
    assert mismatched(np.array([1, 2, 3], np.uint64), np.array([1, 9, 3], np.uint64)).tolist() == [1]


# --- a verified part: recorded, replayed, told and counted --------------------------------------------------------


def test_a_verified_part_is_recorded_replayed_and_told_by_replay_and_explain(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [4, 5, 6], [10, 11, 12])
    pair.pull("req-1", g)
    pair.ms(3)
    assert pair.d.part_done(g.transfer, 0, verified=3)
    assert pair.d.stats["verified_parts"] == 1 and pair.d.stats["verified_blocks"] == 3
    pair.ms(1)
    assert pair.p.consumer_done(g.transfer, g.generation)
    for released in pair.p.take_released():
        pair.p.free(released.request)
    _, d_dir = pair.close()
    folded = replay(d_dir).ledger
    assert isinstance(folded, TargetLedger)
    assert folded.stats["verified_parts"] == 1 and folded.stats["verified_blocks"] == 3
    assert "digest_mismatches" not in folded.stats
    trace, findings = explain_logs([tmp_path])
    assert findings == [] and digest_tally(trace) == {"d0": {"verified_parts": 1, "verified_blocks": 3,
                                                             "mismatches": 0, "mismatched_blocks": 0}}
    assert main(["explain", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["digests"]["d0"]["verified_blocks"] == 3
    assert main(["explain", str(tmp_path)]) == 0
    assert "digests on d0: 3 block(s) verified in 1 part(s), 0 block(s) failed" in capsys.readouterr().out
    logs = [str(tmp_path / "p0"), str(tmp_path / "d0")]
    assert main(["replay", *logs, "--request", "req-1", "--json"]) == 0
    story = json.loads(capsys.readouterr().out)
    (load,) = [x for part in story["parts"] for x in part["loads"]]
    assert (load["verified_parts"], load["verified_blocks"], load["mismatched_blocks"]) == (1, 3, 0)
    assert any(s["kind"] == "TgtPartDone" and "3 block(s) verified" in s["detail"] for s in story["steps"])
    assert main(["replay", *logs, "--request", "req-1"]) == 0
    assert "digests: 3 block(s) verified in 1 of 1 part(s)" in capsys.readouterr().out


def test_a_mismatch_is_told_by_the_request_story_and_the_tally(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [4, 5, 6], [10, 11, 12])
    pair.pull("req-1", g)
    pair.ms(3)
    assert pair.d.digest_mismatch(g.transfer, 0, blocks=[11, 12], source_blocks=[5, 6],
                                  expected=np.array([1, 2], np.uint64), found=np.array([3, 4], np.uint64))
    pair.d.fail(g.transfer, "digest mismatch: 2 block(s) of part 0")
    pair.p.fail(g.transfer, g.generation, "consumer failed: digest mismatch")
    pair.close()
    trace, _ = explain_logs([tmp_path])
    assert digest_tally(trace)["d0"] == {"verified_parts": 0, "verified_blocks": 0, "mismatches": 1,
                                         "mismatched_blocks": 2}
    assert main(["replay", str(tmp_path / "p0"), str(tmp_path / "d0"), "--request", "req-1"]) in (0, 1)
    assert "digests: 2 block(s) failed their digest" in capsys.readouterr().out


def test_part_done_refuses_more_verified_blocks_than_the_request_holds() -> None:
    d = TargetLedger(16, clock=ManualClock())
    d.reserve("r", [1, 2, 3])
    d.start_load("r", "t1")
    seen: list[ev.Event] = []
    d.listeners.append(seen.append)
    assert not d.part_done("t1", 0, verified=4)
    assert not d.part_done("t1", 0, verified=-1)
    assert [e.reason for e in seen if isinstance(e, ev.Refused)] == [
        "4 verified block(s) of a request holding 3", "-1 verified block(s) of a request holding 3"]
    assert d.part_done("t1", 0, verified=3) and "verified_parts" in d.stats


def test_a_part_done_of_an_older_log_reads_as_unverified_and_an_older_reader_skips_the_count() -> None:
    """The evolution rule (docs/wire.md): ``TgtPartDone.verified`` is appended with a default."""
    old = msgspec.msgpack.encode(["tp", 7, 1.5, "t1", 0])
    assert ev.decode(old) == ev.TgtPartDone(7, 1.5, "t1", 0, 0)

    class OldPartDone(msgspec.Struct, frozen=True, array_like=True, tag_field="k", tag="tp"):
        hlc: int
        at: float
        transfer: str
        part: int

    new = ev.encode(ev.TgtPartDone(7, 1.5, "t1", 0, verified=12))
    assert msgspec.msgpack.decode(new, type=OldPartDone) == OldPartDone(7, 1.5, "t1", 0)
