"""The host staging tier in the real handoff: a Producer with a :class:`StagingTier` and a Consumer over the loopback
transport (the same flows the core's tests drive by hand, here through the side channel, the claim reply and D's
reads). A slow D that claims after staging reads the host copy while P's GPU blocks hold another request's bytes; a
D that claimed while the copy was in flight keeps the GPU copy pinned until its read ends; the logs of P, its pool
and D replay clean with ``replay --check --quiescent``; the claim reply's new field decodes totally."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import attrs
import msgspec
import numpy as np
import pytest
from fuzz_msgpack import FUZZ, hostile, tagged
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from held_transport import Gated
from kvlifecycle.transports.digest_host import HostDigester
from kvlifecycle.transports.host_pool import HostPool
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.control import Claimed, LoadFailed
from kvlifecycle.eventlog import EventLog
from kvlifecycle.handoff import REPLY_TYPES, Consumer, HandoffOptions, Producer
from kvlifecycle.handoff.staging_tier import StagingTier
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_merged, check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol import WRITE_IN_FLIGHT
from kvlifecycle.sidechannel import Ack, ErrorReply, FrameError, _decode_body
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_checks import check_staging, check_staging_events, check_staging_merged
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StageWhen, StagingPolicy
from kvlifecycle.transport import KVLayout, MemoryKind
from kvlifecycle.untrusted import UntrustedInputError, check_msgpack

BLOCKS, SLOTS, REGIONS, BYTES = 16, 6, 2, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


class Rig:
    """P (GPU ledger + host pool under a manual clock, its service loop turned by the test) and a threaded D, every
    event kept, logs under ``log_dir``."""

    def __init__(self, name: str, log_dir: Path, *, gate_d: bool = False, gate_copy: bool = False,
                 verify: bool = False, push: bool = False) -> None:
        import torch

        self.src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
        self.dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
        layout = KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in self.src), (BYTES,) * REGIONS)
        self.tp, td = LoopbackTransport(f"p-{name}"), LoopbackTransport(f"d-{name}")
        self.tp.register(layout)
        td.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in self.dst), (BYTES,) * REGIONS))
        self.host = HostPool(layout, SLOTS)
        self.th = LoopbackTransport(f"p-{name}~host")
        self.th.register(self.host.layout)
        d_layout = KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in self.dst), (BYTES,) * REGIONS)
        digesters = (HostDigester(layout), HostDigester(self.host.layout), HostDigester(d_layout)) if verify \
            else (None, None, None)
        options = HandoffOptions(verify="all" if verify else "none")
        self.clock, hlc = ManualClock(), HybridLogicalClock()
        self.logs = {n: EventLog(log_dir / n, fsync="never") for n in ("p", "staging", "d")}
        self.p = SourceLedger(BLOCKS, clock=self.clock, hlc=hlc, worker="p", default_ttl_s=30.0, log=self.logs["p"])
        self.pool = StagingLedger(SLOTS, clock=self.clock, hlc=hlc, source_worker="p", log=self.logs["staging"])
        self.d = TargetLedger(BLOCKS, worker="d", log=self.logs["d"])
        self.events: dict[str, list[ev.Event]] = {"p": [], "staging": [], "d": []}
        for n, ledger in (("p", self.p), ("staging", self.pool), ("d", self.d)):
            ledger.listeners.append(self.events[n].append)
        policy = StagingPolicy(when=StageWhen.AFTER, stage_after_ms=100, pool_blocks=SLOTS)
        self.copy_gate = Gated(self.th) if gate_copy else None
        tier = StagingTier(HostStaging(self.p, self.pool, policy), self.copy_gate or self.th,  # type: ignore[arg-type]
                           digester=digesters[1])
        self.prod = Producer(self.p, self.tp, COMPAT, staging=tier, thread=False, options=options,
                             digester=digesters[0])
        self.read_gate = Gated(td) if gate_d else None
        self.cons = Consumer(self.d, self.read_gate or td, COMPAT,  # type: ignore[arg-type]
                             options=attrs.evolve(options, heartbeat_every_s=0.01), digester=digesters[2])
        self.cons.connect(self.prod.address, push=push)
        self._closers = [self.cons.close, self.prod.close, self.tp.close, td.close, self.th.close]

    def grant(self, request: str, blocks: list[int]) -> object:
        self.p.allocate(request, blocks)
        self.p.prefill_done(request)
        return self.prod.grant(request)

    def p_steps_until(self, done: object) -> bool:
        """Turn P's service loop until ``done()`` (D's notifications arrive on P's transports)."""
        return until(lambda: (self.prod.step_once(), done())[1])  # type: ignore[operator]

    def violations(self) -> list[str]:
        e = self.events
        out = check_source(self.p) + check_target(self.d) + check_staging(self.pool)
        out += check_staging_events(e["staging"]) + check_staging_merged(e["p"], e["staging"], e["d"])
        out += check_merged(e["p"], e["d"])
        return [str(v) for v in out]

    def close_and_replay_check(self, log_dir: Path) -> None:
        for close in self._closers:
            close()
        for log in self.logs.values():
            log.close()
        out = subprocess.run([sys.executable, "-m", "kvlifecycle", "replay",
                              *(str(log_dir / n) for n in ("p", "staging", "d")), "--check", "--quiescent"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def make_rig(request: pytest.FixtureRequest, tmp_path: Path):
    rigs: list[Rig] = []

    def make(**kwargs: bool) -> Rig:
        rig = Rig(f"{request.node.name}-{time.monotonic_ns()}", tmp_path, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:  # a test that failed before its own close still closes its threads
        for close in rig._closers:
            close()


def test_a_slow_d_claims_after_staging_and_reads_the_host_copy(make_rig, tmp_path: Path) -> None:
    rig = make_rig()
    g = rig.grant("slow", [1, 2, 3])
    expected = [x[[1, 2, 3]].clone() for x in rig.src]
    rig.prod.step_once()
    assert rig.pool.occupancy() == 0  # not due yet: the lease has been unclaimed for less than stage_after_ms
    rig.clock.advance(0.2)
    rig.prod.step_once()  # posts the copy to host, polls it, hands the GPU lease over
    assert [r.reason for r in rig.p.take_released()] == ["staged"]
    assert rig.pool.counts()["STAGED"] == 3
    rig.p.free("slow")  # the engine takes its GPU blocks back and reuses them before D reads
    rig.p.allocate("next", [1, 2, 3])
    for x in rig.src:
        x[[1, 2, 3]] = 0xAB
    rig.d.reserve("slow", [5, 6, 7])
    rig.cons.pull("slow", g, address=rig.prod.address)  # type: ignore[arg-type]
    assert rig.cons.wait_idle(10)
    assert rig.d.stats["loaded"] == 1
    for r in range(REGIONS):  # the bytes of the prefill, not of the blocks' new owner
        assert np.array_equal(rig.dst[r][[5, 6, 7]].numpy(), expected[r].numpy())
    assert rig.p_steps_until(lambda: rig.pool.stats["completed"] == 1)  # D's notification ends the host read
    assert rig.pool.counts()["FREE"] == SLOTS and rig.pool.stats["served"] == 1
    rig.d.finish("slow")
    rig.p.cancel("next")
    assert rig.violations() == []
    rig.close_and_replay_check(tmp_path)


def _stage_then_reuse(rig: Rig, request: str, blocks: list[int]) -> object:
    """Grant ``request``, stage it (the clock past stage_after_ms), then let P's engine reuse its GPU blocks."""
    g = rig.grant(request, blocks)
    rig.clock.advance(0.2)
    rig.prod.step_once()
    assert [r.reason for r in rig.p.take_released()] == ["staged"]
    rig.p.free(request)
    rig.p.allocate("next", blocks)
    for x in rig.src:
        x[blocks] = 0xAB
    return g


def test_a_push_of_a_staged_lease_is_written_from_the_host_copy(make_rig, tmp_path: Path) -> None:
    """D pushes (P writes) a lease staged before D asked: P writes the host slots, not the GPU blocks its engine
    reused, and the write's completion ends the claimant's read of the copy, which frees its slots."""
    rig = make_rig(push=True)
    expected = [x[[1, 2, 3]].clone() for x in rig.src]
    _stage_then_reuse(rig, "slow", [1, 2, 3])
    rig.d.reserve("slow", [5, 6, 7])
    assert rig.cons.load("slow", "slow", [rig.prod.address], push=True) is not None
    assert rig.p_steps_until(lambda: rig.d.stats["loaded"] == 1 and rig.pool.stats["completed"] == 1)
    for r in range(REGIONS):  # the prefill's bytes, from the pool
        assert np.array_equal(rig.dst[r][[5, 6, 7]].numpy(), expected[r].numpy())
    assert rig.pool.counts()["FREE"] == SLOTS and rig.pool.stats["served"] == 1
    rig.d.finish("slow")
    rig.p.cancel("next")
    assert rig.violations() == []
    rig.close_and_replay_check(tmp_path)


@pytest.mark.mutants
@pytest.mark.parametrize("mutant", [False, True])
def test_a_staged_push_in_flight_when_its_lease_ends_is_cancelled_before_its_slots_are_freed(
        make_rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutant: bool) -> None:
    """The write from the pool is held (gated) and D goes silent, so the copy's lease runs out: the service step
    cancels the write before the sweep frees the slots, so no write from freed slots is left pending. The mutant
    keeps the write in flight past the lease: the slots are freed under it."""
    if mutant:
        def never_cancel(self, now):  # type: ignore[no-untyped-def]
            self._pushes = [p for p in self._pushes if p.path.transport.poll(p.handle).name == "PENDING"]
            return []

        monkeypatch.setattr(StagingTier, "poll_pushes", never_cancel)
    rig = make_rig(push=True, gate_copy=True)
    g = rig.grant("slow", [1, 2, 3])
    rig.clock.advance(0.2)
    rig.prod.step_once()  # the copy is posted, held at the gate
    assert rig.copy_gate.let_go() == 1
    rig.prod.step_once()  # the copy completed: staged
    assert [r.reason for r in rig.p.take_released()] == ["staged"]
    rig.d.reserve("slow", [5, 6, 7])
    assert rig.cons.load("slow", "slow", [rig.prod.address], push=True) is not None
    assert rig.p_steps_until(lambda: len(rig.copy_gate.pending) == 1)  # the write from the slots, held
    rig.cons.close()  # D goes silent: no renewal reaches P any more
    rig.clock.advance(31.0)  # past the copy's lease (30 s)
    rig.prod.step_once()
    assert rig.pool.counts()["FREE"] == SLOTS  # swept: the slots may be staged into again
    if mutant:
        assert rig.copy_gate.pending and rig.copy_gate.cancelled == 0  # a write from freed slots, still pending
        return
    assert not rig.copy_gate.pending and rig.copy_gate.cancelled == 1
    assert rig.pool.requests.get(g.transfer) is None  # type: ignore[attr-defined]
    assert all(not x[[5, 6, 7]].any() for x in rig.dst)  # not a byte of it landed


@pytest.mark.mutants
@pytest.mark.parametrize("mutant", [False, True])
def test_a_consumer_giving_up_a_staged_push_in_flight_hears_back_only_once_the_write_was_cancelled(
        make_rig, monkeypatch: pytest.MonkeyPatch, mutant: bool) -> None:
    """D gives its push load up (``LoadFailed``) while P's write from the pool is still in flight: P answers
    "write in flight" (so D keeps its blocks), cancels the write on its next step, and only then ends the read and
    tells D. The mutant ends the read at once: D would free blocks the write still lands in."""
    if mutant:
        monkeypatch.setattr(StagingTier, "hand_back", lambda self, transfer, generation, reason: False)
    rig = make_rig(push=True, gate_copy=True)
    g = rig.grant("slow", [1, 2, 3])
    rig.clock.advance(0.2)
    rig.prod.step_once()
    assert rig.copy_gate.let_go() == 1
    rig.prod.step_once()
    rig.d.reserve("slow", [5, 6, 7])
    assert rig.cons.load("slow", "slow", [rig.prod.address], push=True) is not None
    assert rig.p_steps_until(lambda: len(rig.copy_gate.pending) == 1)  # the write from the slots, held
    (load,) = rig.cons._loads.values()
    gave_up = LoadFailed(g.transfer, g.generation, "D gave up", token=load.tokens[0], consumer=0)  # type: ignore[attr-defined]
    answer = rig.prod._on_load_failed(gave_up, b"")
    if mutant:
        assert answer.ok and rig.copy_gate.pending  # acknowledged while the write may still land
        return
    assert not answer.ok and answer.detail == WRITE_IN_FLIGHT
    assert rig.pool.requests[g.transfer].readers == 1  # type: ignore[attr-defined]  # the read goes on until...
    rig.prod.step_once()
    assert not rig.copy_gate.pending and rig.copy_gate.cancelled == 1  # ...the write was cancelled
    assert g.transfer not in rig.pool.requests  # type: ignore[attr-defined]
    assert rig.pool.stats["failed"] == 1 and all(not x[[5, 6, 7]].any() for x in rig.dst)


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_lease_staged_before_d_asked_is_verified_against_its_host_copy(make_rig, tmp_path: Path,
                                                                         corrupt: bool) -> None:
    """D asks for the grant only after staging and P's reuse: the digests come from the host copy (the GPU blocks
    hold the new owner's bytes), D checks what landed against them, and a byte flipped in a host slot after P
    digested it is refused before attention could read it."""
    rig = make_rig(verify=True)
    g = _stage_then_reuse(rig, "slow", [1, 2, 3])
    asked = rig.cons.fetch_grant(rig.prod.address, "slow")  # P digests the host copy now, once, for every ask
    assert asked.digests is not None and asked.transfer == g.transfer  # type: ignore[attr-defined]
    if corrupt:  # a fault in host memory after P digested it: the slot no longer holds what P sent digests of
        slot = int(rig.pool.requests[g.transfer].blocks[1])  # type: ignore[attr-defined]
        rig.host._buffers[0][slot * BYTES + 7] ^= 0x5A
    rig.d.reserve("slow", [5, 6, 7])
    assert rig.cons.load("slow", "slow", [rig.prod.address]) is not None  # D fetches the grant from P now
    assert rig.cons.wait_idle(10)
    mismatches = [e for e in rig.events["d"] if isinstance(e, ev.TgtDigestMismatch)]
    verified = sum(e.verified for e in rig.events["d"] if isinstance(e, ev.TgtPartDone))
    if corrupt:
        assert rig.d.stats["loaded"] == 0 and len(mismatches) == 1 and verified == 0
        assert np.frombuffer(mismatches[0].blocks, dtype=np.int32).tolist() == [6]
    else:
        assert rig.d.stats["loaded"] == 1 and mismatches == [] and verified == 3
    assert rig.p_steps_until(lambda: rig.pool.stats["completed"] + rig.pool.stats["failed"] == 1)
    if not corrupt:
        rig.d.finish("slow")
    rig.p.cancel("next")
    assert rig.violations() == []
    rig.close_and_replay_check(tmp_path)


def test_a_d_that_claimed_while_the_copy_was_in_flight_keeps_the_gpu_copy_pinned_until_its_read_ends(
        make_rig, tmp_path: Path) -> None:
    rig = make_rig(gate_d=True, gate_copy=True)
    assert rig.read_gate is not None and rig.copy_gate is not None
    g = rig.grant("early", [4, 5])
    rig.clock.advance(0.2)
    rig.prod.step_once()  # the copy is posted, and held in flight
    assert rig.pool.counts()["STAGING"] == 2
    rig.d.reserve("early", [8, 9])
    rig.cons.pull("early", g, address=rig.prod.address)  # type: ignore[arg-type]
    assert until(lambda: rig.p.leases[g.transfer].claimed)  # type: ignore[attr-defined]
    assert until(lambda: rig.read_gate.pending)  # D's read of the GPU copy is in flight
    rig.copy_gate.let_go()
    rig.copy_gate.gate_open = True
    rig.prod.step_once()  # the copy completed, but its lease was claimed: dropped, the GPU copy stays pinned
    assert rig.pool.occupancy() == 0 and rig.pool.stats["cancelled"] == 1
    assert g.transfer in rig.p.leases and rig.p.take_released() == []  # type: ignore[attr-defined]
    for _ in range(5):
        rig.prod.step_once()
        assert g.transfer in rig.p.leases  # type: ignore[attr-defined]
    rig.read_gate.gate_open = True
    assert rig.cons.wait_idle(10)
    for r in range(REGIONS):
        assert np.array_equal(rig.dst[r][[8, 9]].numpy(), rig.src[r][[4, 5]].numpy())
    assert rig.p_steps_until(lambda: g.transfer not in rig.p.leases)  # type: ignore[attr-defined]
    assert [r.reason for r in rig.p.take_released()] == ["completed"]
    rig.d.finish("early")
    rig.p.free("early")
    assert rig.violations() == []
    rig.close_and_replay_check(tmp_path)


def test_without_a_staging_tier_nothing_is_staged_and_the_claim_names_no_host_slots(make_rig) -> None:
    rig = make_rig()
    rig.prod.staging = None  # today's Producer: the same loop, no tier
    g = rig.grant("plain", [2])
    rig.clock.advance(10)
    rig.prod.step_once()
    assert rig.pool.occupancy() == 0 and g.transfer in rig.p.leases  # type: ignore[attr-defined]
    rig.d.reserve("plain", [3])
    rig.cons.pull("plain", g, address=rig.prod.address)  # type: ignore[arg-type]
    assert rig.cons.wait_idle(10) and rig.d.stats["loaded"] == 1
    assert rig.p_steps_until(lambda: g.transfer not in rig.p.leases)  # type: ignore[attr-defined]


def test_a_claim_reply_whose_host_slots_do_not_fit_the_grant_fails_the_load_and_frees_the_copy(
        make_rig, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig()
    g = rig.grant("odd", [1, 2])
    rig.clock.advance(0.2)
    rig.prod.step_once()
    assert rig.pool.counts()["STAGED"] == 2
    renew = StagingTier.renew

    def short(self, *args, **kwargs):  # a P whose claim reply names one slot for two blocks
        answer, host = renew(self, *args, **kwargs)
        return answer, (None if host is None else host[:1])

    monkeypatch.setattr(StagingTier, "renew", short)
    rig.d.reserve("odd", [7, 8])
    rig.cons.pull("odd", g, address=rig.prod.address)  # type: ignore[arg-type]
    assert rig.cons.wait_idle(10)
    assert "host slots" in rig.cons.abandoned["odd"] and rig.d.stats["loaded"] == 0
    assert rig.p_steps_until(lambda: rig.pool.occupancy() == 0)  # D told P: the copy is released, not leaked
    assert rig.pool.stats["failed"] == 1


# --- the claim reply's new field on the wire ----------------------------------------------------------------------

_replies = msgspec.msgpack.Decoder(Claimed | Ack | ErrorReply)  # what D's side-channel client decodes


def decode_reply(raw: bytes) -> msgspec.Struct:
    """A reply body as D's side-channel client opens it: the depth checked before any decoding, then decoded."""
    check_msgpack(raw)
    return _decode_body(_replies, raw)
VALID = [msgspec.msgpack.encode(Claimed(True, "", b"t" * 16, [3, 4])), msgspec.msgpack.encode(Claimed(True))]
typed = st.builds(Claimed, st.booleans(), st.text(max_size=8), st.binary(max_size=70),
                  st.none() | st.lists(st.integers(-(2**40), 2**40), max_size=6),
                  st.integers(-1, 2**64 - 1)).map(msgspec.msgpack.encode)


REPLY_FIELDS = ["ok", "detail", "token", "host_blocks", "hlc"]


@FUZZ
@given(raw=st.one_of(typed, hostile(VALID, tagged(["Claimed", "Ack"], REPLY_FIELDS))))
def test_the_claim_reply_decoder_is_total_and_bounds_the_host_slots(raw: bytes) -> None:
    try:
        msg = decode_reply(raw)
    except (UntrustedInputError, FrameError):
        pass
    else:
        if isinstance(msg, Claimed):
            assert msg.host_blocks is None or all(0 <= b < 2**31 for b in msg.host_blocks)
            assert 0 <= msg.hlc < 2**63
    assert decode_reply(VALID[0]) == Claimed(True, "", b"t" * 16, [3, 4])
    assert Claimed in REPLY_TYPES


def test_an_older_claim_reply_decodes_with_no_host_slots() -> None:
    class OldClaimed(msgspec.Struct, frozen=True, tag="Claimed"):
        ok: bool
        detail: str = ""
        token: bytes = b""

    assert decode_reply(msgspec.msgpack.encode(OldClaimed(True, "", b"x"))) == Claimed(True, "", b"x", None, 0)
