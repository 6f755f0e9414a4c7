"""Producer / Consumer failure paths in one process over the loopback transport (the fast double; the same flows
run over real NIXL in two processes in test_handoff_nixl.py). Every wait is bounded."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_merged, check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.transport import KVLayout, MemoryKind

BLOCKS, REGIONS, BYTES = 16, 3, 64
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=3, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


class Recorder:
    """Every event a ledger records, in memory (a ledger listener)."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)


@pytest.fixture
def pd(request: pytest.FixtureRequest):
    import torch

    suffix = f"{request.node.name}-{time.monotonic_ns()}"
    src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
    tp, td = LoopbackTransport(f"p-{suffix}"), LoopbackTransport(f"d-{suffix}")
    for t, kv in ((tp, src), (td, dst)):
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * REGIONS))
    plog, dlog = Recorder(), Recorder()
    sl = SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(BLOCKS, worker="d")
    sl.listeners.append(plog)
    tl.listeners.append(dlog)
    prod = Producer(sl, tp, COMPAT)
    abandoned: list[tuple[str, str]] = []
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.01,
                                                           on_abandoned=lambda r, why: abandoned.append((r, why))))
    cons.abandoned_calls = abandoned
    cons.connect(prod.address)
    yield prod, cons, src, dst, plog, dlog
    cons.close()
    prod.close()
    tp.close()
    td.close()
    assert check_source(sl) == [] and check_target(tl) == []
    assert check_merged(plog.events, dlog.events) == []


def grant(prod: Producer, request: str, blocks: list[int]):
    prod.ledger.allocate(request, blocks)
    prod.ledger.prefill_done(request)
    return prod.grant(request)


def test_pull_and_push_over_loopback(pd) -> None:
    prod, cons, src, dst, _, _ = pd
    for mode, s, d in (("pull", [1, 2], [5, 6]), ("push", [3], [9])):
        g = grant(prod, mode, s)
        cons.ledger.reserve(mode, d)
        if mode == "pull":
            cons.pull(mode, g, address=prod.address)
        else:
            cons.request_push(mode, g, address=prod.address)
        assert cons.wait_idle(10)
        assert until(lambda g=g: g.transfer not in prod.ledger.leases)
        for r in range(REGIONS):
            assert np.array_equal(dst[r][d].numpy(), src[r][s].numpy())
        assert cons.ledger.stats["loaded"] == (1 if mode == "pull" else 2)
        cons.ledger.finish(mode)
    assert [r.reason for r in prod.ledger.take_released()] == ["completed", "completed"]


def test_cancelled_grant_refuses_the_claim_and_d_fails_cleanly(pd) -> None:
    prod, cons, _, dst, plog, _ = pd
    g = grant(prod, "gone", [4])
    prod.ledger.cancel("gone")  # P aborts before D claims
    cons.ledger.reserve("gone", [0])
    cons.pull("gone", g, address=prod.address)
    assert cons.wait_idle(10)
    # the claim was refused, so the load never started: the reservation went back (policy "fail")
    assert "gone" not in cons.ledger.requests and "lease refused" in cons.abandoned["gone"]
    assert [r for r, _ in cons.abandoned_calls] == ["gone"]  # the engine is told through the hook
    assert cons.ledger.stats["cancelled"] == 1 and cons.ledger.counts()["FREE"] == BLOCKS
    assert int(dst[0][0].sum()) == 0  # nothing was read
    assert any(type(e).__name__ == "Refused" and e.command == "heartbeat" for e in plog.events)


def test_failed_push_reaches_d_and_then_releases_p(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifecycle.transport import TransportError

    prod, cons, _, _, _, _ = pd

    def refuse(*_args, **_kwargs):
        raise TransportError("injected: the write cannot post")

    monkeypatch.setattr(prod.transport, "post", refuse)  # P's write fails on its service thread
    g = grant(prod, "bad-push", [1, 2, 3])
    cons.ledger.reserve("bad-push", [7, 8, 9])
    cons.request_push("bad-push", g, address=prod.address)
    assert cons.wait_idle(10)
    assert cons.ledger.stats["failed"] == 1
    assert until(lambda: g.transfer not in prod.ledger.leases)
    assert [r.reason for r in prod.ledger.take_released()] == ["failed"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_d_holding_a_prefix_gets_ps_tail(pd, mode: str) -> None:
    """P granted 3 blocks; D already holds the first one (a prefix hit) and reserved 2: they get P's last 2."""
    prod, cons, src, dst, _, _ = pd
    g = grant(prod, mode, [1, 2, 3])
    cons.ledger.reserve(mode, [10, 11])
    if mode == "pull":
        cons.pull(mode, g, address=prod.address)
    else:
        cons.request_push(mode, g, address=prod.address)
    assert cons.wait_idle(10)
    assert until(lambda: g.transfer not in prod.ledger.leases)
    for r in range(REGIONS):
        assert np.array_equal(dst[r][[10, 11]].numpy(), src[r][[2, 3]].numpy())
    assert [r.reason for r in prod.ledger.take_released()] == ["completed"]
    cons.ledger.finish(mode)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_d_reserving_more_blocks_than_granted_is_refused_before_any_is_ready(pd, mode: str) -> None:
    """A D block the grant cannot fill would become READY_FOR_ATTENTION without its bytes: refused up front."""
    prod, cons, _, dst, _, _ = pd
    g = grant(prod, mode, [1, 2])
    cons.ledger.reserve(mode, [12, 13, 14])
    if mode == "pull":
        cons.pull(mode, g, address=prod.address)
    else:
        cons.request_push(mode, g, address=prod.address)
    assert cons.wait_idle(10)
    assert "fills only 2 unit(s)" in cons.abandoned[mode]
    assert cons.ledger.stats["loaded"] == 0 and mode not in cons.ledger.requests  # policy fail: blocks back
    assert cons.ledger.counts()["READY_FOR_ATTENTION"] == 0
    assert int(dst[0][[12, 13, 14]].sum()) == 0  # nothing was read or written
    assert until(lambda: g.transfer not in prod.ledger.leases)  # P is told, and releases the lease


def test_connect_refused_for_compat_lists_the_real_fields(pd) -> None:
    """P refuses the handshake; D's error still names every mismatching field (not an empty list)."""
    from kvlifecycle.handshake import CompatMismatchError

    prod, cons, _, _, _, _ = pd
    other = Consumer(TargetLedger(BLOCKS, worker="d2"), cons.transport,
                     msgspec.structs.replace(COMPAT, dtype="float32", num_layers=5))
    try:
        with pytest.raises(CompatMismatchError) as info:
            other.connect(prod.address)
    finally:
        other.close()
    assert info.value.fields == [("dtype", "float32", "bfloat16"), ("num_layers", 5, 3)]
    assert "dtype: local='float32'" in str(info.value)


def test_push_completion_without_the_claim_token_is_dropped_by_d(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forged "done" for a push would mark D's blocks ready without their bytes: D needs the claim's token."""
    from kvlifecycle.transport import Notification

    prod, cons, src, dst, _, _ = pd
    real_start = prod._start_push
    held: list = []
    monkeypatch.setattr(prod, "_start_push", lambda *args: held.append(args))  # P accepts, then waits
    g = grant(prod, "forged", [2])
    cons.ledger.reserve("forged", [3])
    cons.request_push("forged", g, address=prod.address)
    assert until(lambda: held)
    for payload in (b"", b"\0" * 16):
        prod.transport.send_notification(cons.transport.agent,
                                         Notification("forged", g.transfer, g.generation, payload=payload))
    assert until(lambda: cons.forged_notifications == 2)
    assert cons.pending() == 1 and cons.ledger.stats["loaded"] == 0  # still waiting for the real write
    prod._jobs.put(lambda: real_start(*held[0]))  # the write happens (on P's thread); its completion has the token
    assert cons.wait_idle(10)
    assert cons.ledger.stats["loaded"] == 1
    assert np.array_equal(dst[0][[3]].numpy(), src[0][[2]].numpy())
    assert until(lambda: g.transfer not in prod.ledger.leases)
    cons.ledger.finish("forged")


def test_an_unexpected_error_while_launching_still_settles_the_load(pd, monkeypatch: pytest.MonkeyPatch) -> None:
    prod, cons, _, _, _, _ = pd

    def broken(*_args):
        raise RuntimeError("injected: a bug in the launch path")

    monkeypatch.setattr(cons, "_map_blocks", broken)
    g = grant(prod, "bug", [6])
    cons.ledger.reserve("bug", [6])
    cons.pull("bug", g, address=prod.address)
    assert cons.wait_idle(10)  # not stuck in the pending loads
    assert "internal error: RuntimeError" in cons.abandoned["bug"]
    assert "bug" not in cons.ledger.requests  # policy "fail": the reservation went back
    prod.ledger.cancel("bug")  # the unclaimed lease is P's to end
