"""Per-block digests over real NIXL (UCX, DRAM): P digests its granted blocks, D re-reads what landed and refuses
the load before ``part_done`` when a byte changed on the way (pull and push), and when one P rank's head slice
landed in the wrong heads (P TP 2 → D TP 1). A transport wrapper flips the byte, after NIXL moved it, where D
receives. Every wait is bounded; nothing asserts on time."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.digest_host import HostDigester
from kvlifecycle.transports.nixl import NixlTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle import layout as L
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.transport import BlockView, XferStatus

pytestmark = pytest.mark.nixl

BLOCKS, REGIONS, HEADS, HEAD_BYTES = 16, 4, 2, 128
_names = itertools.count()


class Pool:
    """One worker's KV regions in DRAM (HND: each block is its heads, one after the other)."""

    def __init__(self, seed: int | None, heads: int) -> None:
        rng = np.random.default_rng(seed)
        block = heads * HEAD_BYTES
        self.kv = [rng.integers(0, 256, (BLOCKS, block), dtype=np.uint8) if seed is not None
                   else np.zeros((BLOCKS, block), dtype=np.uint8) for _ in range(REGIONS)]
        self.layout = L.rows_layout("DRAM", 0, [a.ctypes.data for a in self.kv], [a.nbytes for a in self.kv],
                                    [block] * REGIONS)


class CorruptOnArrival:
    """A transport that is ``inner`` except that ``corrupt`` runs once, when the first transfer D posted
    completes (pull) or the first ``done`` notification from P arrives (push): the bytes changed after NIXL
    moved them, before D's service thread sees the completion."""

    def __init__(self, inner: NixlTransport, corrupt: Callable[[], None]) -> None:
        self._inner, self._corrupt, self.fired = inner, corrupt, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            self._corrupt()

    def poll(self, handle: Any) -> XferStatus:
        status = self._inner.poll(handle)
        if status is XferStatus.DONE:
            self._fire()
        return status

    def notifications(self) -> list:
        notes = list(self._inner.notifications())
        if any(note.kind == "done" for _, note in notes):
            self._fire()
        return notes


COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=REGIONS // 2, num_kv_heads=HEADS,
                    head_size=HEAD_BYTES // 2, block_size=1, kv_layout="HND")


def handoff(*, flip: tuple[int, int, int] | None, mode: str, verify: str = "all", policy: str = "fail"):
    """One request P → D over NIXL with digests on P; D verifies under ``verify``; ``flip``: (region, D block,
    byte) to flip on arrival. Returns (src, dst, D ledger, consumer, P's release reasons, p blocks, d blocks)."""
    n = next(_names)
    src, dst = Pool(1, HEADS), Pool(None, HEADS)
    tp, td = NixlTransport(f"dg-p{n}", probe_bytes=0), NixlTransport(f"dg-d{n}", probe_bytes=0)
    tp.register(src.layout)
    td.register(dst.layout)

    def corrupt() -> None:
        if flip is not None:
            region, block, byte = flip
            dst.kv[region][block, byte] ^= 0x10

    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(BLOCKS, worker="d", failure_policy=policy)
    prod = Producer(sl, tp, COMPAT, options=HandoffOptions(verify="all"), digester=HostDigester(src.layout))
    cons = Consumer(tl, CorruptOnArrival(td, corrupt), COMPAT,  # type: ignore[arg-type]
                    options=HandoffOptions(verify=verify, heartbeat_every_s=0.05, probe=False, quarantine_s=60.0),
                    digester=HostDigester(dst.layout))
    try:
        cons.connect(prod.address)
        p_blocks, d_blocks = [2, 7, 11, 4], [9, 0, 5, 13]
        sl.allocate("r", p_blocks)
        sl.prefill_done("r")
        prod.grant("r")
        grant = cons.fetch_grant(prod.address, "r")
        assert grant.digests is not None and grant.digests.slices == 1
        tl.reserve("r", d_blocks)
        if mode == "pull":
            cons.pull("r", grant, address=prod.address)
        else:
            cons.request_push("r", grant, address=prod.address)
        assert cons.wait_idle(20)
        assert until(lambda: grant.transfer not in sl.leases, 20)
        released = [r.reason for r in sl.take_released()]
        assert check_source(sl) == [] and check_target(tl) == []
        return src, dst, tl, cons, released, p_blocks, d_blocks
    finally:
        cons.close()
        prod.close()
        td.close()
        tp.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_verified_bytes_load(mode: str) -> None:
    src, dst, tl, cons, released, p_blocks, d_blocks = handoff(flip=None, mode=mode)
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION and released == ["completed"]
    assert cons.verified_parts == 1 and cons.unverified_parts == 0
    # D's log says so: the part's TgtPartDone counts the blocks whose digests matched (what replay and explain tell)
    assert tl.stats["verified_parts"] == 1 and tl.stats["verified_blocks"] == len(d_blocks)
    assert all(np.array_equal(d[d_blocks], s[p_blocks]) for s, d in zip(src.kv, dst.kv, strict=True))


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_one_flipped_byte_is_refused_before_attention(mode: str, policy: str) -> None:
    _, _, tl, cons, released, _, _ = handoff(flip=(2, 5, 77), mode=mode, policy=policy)
    assert tl.stats["digest_mismatches"] == 1 and cons.verified_parts == 0 and "verified_blocks" not in tl.stats
    assert tl.stats["failed" if policy == "fail" else "recompute"] == 1 and tl.stats["loaded"] == 0
    if policy == "fail":
        assert "r" not in tl.requests  # the request fails; nothing of it is held
    else:
        assert tl.requests["r"].state == TargetState.RESERVED  # the engine recomputes into its blocks
    assert set(tl.quarantined()) == {5}  # only the corrupted block is held back
    # push: P's write completed its lease before D's check. pull: the read's own notification (NIXL sends it with
    # the READ) may reach P before D's LoadFailed: either way the lease ended once, after D's read ended
    assert released == ["completed"] if mode == "push" else released in (["failed"], ["completed"])


@pytest.mark.mutants
def test_mutant_verification_skipped_accepts_the_corruption() -> None:
    """With D's check switched off (verify none) the same flipped byte reaches attention: the check is needed."""
    src, dst, tl, cons, released, p_blocks, d_blocks = handoff(flip=(2, 5, 77), mode="pull", verify="none")
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION and released == ["completed"]
    assert cons.unverified_parts == 1 and "verified_blocks" not in tl.stats  # the log says it went unchecked
    assert not np.array_equal(dst.kv[2][5], src.kv[2][p_blocks[d_blocks.index(5)]])


def test_digests_of_another_algorithm_load_unchecked_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A P whose digests this D does not compute (a rolling upgrade across a change of the digest) is treated as a P
    that sends none: the load is not refused, and it is counted as unchecked (the log has no verified blocks)."""
    from kvlifecycle.digest import BlockDigests

    def older(digests: np.ndarray) -> BlockDigests:
        arr = np.asarray(digests, dtype="<u8").reshape(1, -1)
        return BlockDigests("xxh3-64", 1, arr.tobytes())

    monkeypatch.setattr(BlockDigests, "of", staticmethod(older))
    _, _, tl, cons, released, _, _ = handoff(flip=None, mode="pull")
    assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION and released == ["completed"]
    assert cons.unverified_parts == 1 and cons.verified_parts == 0 and "digest_mismatches" not in tl.stats
    assert "verified_blocks" not in tl.stats


@pytest.mark.parametrize("wrong_heads", [False, True], ids=["right-heads", "rank-1-into-rank-0-heads"])
def test_p_tp_2_to_d_tp_1_checks_each_rank_slice(wrong_heads: bool) -> None:
    """D TP 1 reads each of two P ranks' whole blocks into its half of the heads; each part is checked where the
    handshake's plan puts it. A read of P rank 1 prepared into rank 0's heads (a mapping bug, moved by real NIXL)
    leaves D's second half unwritten: that part fails its digest and the load is refused."""
    n = next(_names)
    ps = [Pool(20 + r, 1) for r in range(2)]
    dst = Pool(None, 2)
    tps = [NixlTransport(f"dgtp-p{r}-{n}", probe_bytes=0) for r in range(2)]
    td = NixlTransport(f"dgtp-d{n}", probe_bytes=0)
    p_compat = msgspec.structs.replace(COMPAT, tp_size=2)
    opts = {"verify": "all", "unit_bytes": HEAD_BYTES}
    sls = [SourceLedger(BLOCKS, worker=f"p{r}", default_ttl_s=30.0) for r in range(2)]
    tl = TargetLedger(BLOCKS, worker="d")
    seen: list[ev.Event] = []
    tl.listeners.append(seen.append)
    prods, cons = [], None
    try:
        for pool, t in zip(ps, tps, strict=True):
            t.register(pool.layout)
        td.register(dst.layout)
        prods = [Producer(sl, t, p_compat, tp_rank=r, options=HandoffOptions(**opts),
                          digester=HostDigester(pool.layout))
                 for r, (sl, t, pool) in enumerate(zip(sls, tps, ps, strict=True))]
        cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05, probe=False, **opts),
                        digester=HostDigester(dst.layout))
        links = [cons.connect(p.address) for p in prods]
        if wrong_heads:
            link = links[1]
            bad = td.prepare(link.prepared.peer, local_view=BlockView(0, HEAD_BYTES),
                             remote_view=link.prepared.remote_view)
            link.prepared = bad
        p_blocks, d_blocks = [3, 8, 1], [6, 0, 12]
        grants = []
        for sl, prod in zip(sls, prods, strict=True):
            sl.allocate("r", p_blocks)
            sl.prefill_done("r")
            prod.grant("r")
            grants.append((prod.address, cons.fetch_grant(prod.address, "r")))
        tl.reserve("r", d_blocks)
        cons.pull("r", grants)
        assert cons.wait_idle(20)
        assert until(lambda: all(g.transfer not in sl.leases for sl, (_, g) in zip(sls, grants, strict=True)), 20)
        if wrong_heads:
            # rank 1's bytes sit in rank 0's heads and rank 1's heads hold nothing: whichever part is checked
            # first fails (both, if the second lands before the load settles); no block became ready
            mismatches = [e for e in seen if isinstance(e, ev.TgtDigestMismatch)]
            assert mismatches and "r" not in tl.requests and tl.stats["loaded"] == 0
            assert all(ev.unpack_blocks(m.blocks).tolist() == d_blocks for m in mismatches)
            assert cons.verified_parts + len(mismatches) <= 2
        else:
            assert tl.requests["r"].state == TargetState.READY_FOR_ATTENTION and cons.verified_parts == 2
            assert [e.verified for e in seen if isinstance(e, ev.TgtPartDone)] == [len(d_blocks)] * 2
            for r in range(REGIONS):
                want = np.concatenate([p.kv[r][p_blocks] for p in ps], axis=1)
                assert np.array_equal(dst.kv[r][d_blocks], want)
    finally:
        if cons is not None:
            cons.close()
        for prod in prods:
            prod.close()
        for t in [td, *tps]:
            t.close()



def test_p_tp_1_to_d_tp_2_each_d_rank_checks_its_head_slice() -> None:
    """One P rank read by two D ranks: P sends a digest per head slice; each D rank checks the slice it read. A
    byte flipped in D rank 1's landed heads fails rank 1's load only."""
    n = next(_names)
    src = Pool(30, 2)
    dsts = [Pool(None, 1) for _ in range(2)]
    tp = NixlTransport(f"dgtp2-p{n}", probe_bytes=0)
    tds = [NixlTransport(f"dgtp2-d{r}-{n}", probe_bytes=0) for r in range(2)]
    d_compat = msgspec.structs.replace(COMPAT, tp_size=2)
    opts = {"verify": "all", "unit_bytes": HEAD_BYTES}
    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tls = [TargetLedger(BLOCKS, worker=f"d{r}") for r in range(2)]
    prod, conss = None, []
    try:
        tp.register(src.layout)
        for pool, t in zip(dsts, tds, strict=True):
            t.register(pool.layout)
        prod = Producer(sl, tp, COMPAT, options=HandoffOptions(**opts), digester=HostDigester(src.layout),
                        slice_bytes=2 * HEAD_BYTES)

        def flip_rank_1() -> None:
            dsts[1].kv[0][4, 5] ^= 0x01

        conss = [Consumer(tl, CorruptOnArrival(t, flip_rank_1) if r == 1 else t, d_compat, tp_rank=r,  # type: ignore[arg-type]
                          options=HandoffOptions(heartbeat_every_s=0.05, probe=False, **opts),
                          digester=HostDigester(pool.layout))
                 for r, (tl, t, pool) in enumerate(zip(tls, tds, dsts, strict=True))]
        for cons in conss:
            cons.connect(prod.address)
        p_blocks, d_blocks = [3, 8, 1], [6, 4, 12]
        sl.allocate("r", p_blocks)
        sl.prefill_done("r")
        prod.grant("r", consumers=2)
        for cons, tl in zip(conss, tls, strict=True):
            grant = cons.fetch_grant(prod.address, "r")
            assert grant.digests is not None and grant.digests.slices == 2
            tl.reserve("r", d_blocks)
            cons.pull("r", grant, address=prod.address)
        assert all(cons.wait_idle(20) for cons in conss)
        assert tls[0].requests["r"].state == TargetState.READY_FOR_ATTENTION and conss[0].verified_parts == 1
        for r in range(REGIONS):
            assert np.array_equal(dsts[0].kv[r][d_blocks], src.kv[r][p_blocks][:, :HEAD_BYTES])
        assert "r" not in tls[1].requests and tls[1].stats["digest_mismatches"] == 1
        assert set(tls[1].quarantined()) == {4}
    finally:
        for cons in conss:
            cons.close()
        if prod is not None:
            prod.close()
        for t in [*tds, tp]:
            t.close()
