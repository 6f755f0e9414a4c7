"""P's rules for its own writes. One WRITE per (transfer, generation, part), ever: a PushRequest that arrives again
after P's write of it failed, its lease still live (a retransmit whose first copy got through, before D's hand-back
reached P), is answered as a duplicate and writes nothing, so no second write lands in blocks D freed once it heard
of the failure. A lease is never released under its write: D's hand-back while the write runs is answered
``WRITE_IN_FLIGHT``, and P releases the lease only once it cancelled the write. A real Producer over the loopback
transport, its writes held and failed on demand; D's side is a bare side-channel client (so no hand-back races the
retransmit). The mutant tests put back what each rule guards against and expect the failure. Every wait is bounded;
nothing asserts on how long anything took."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest
from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.control import Claimed, Heartbeat, LoadFailed, PushRequest
from kvlifecycle.handoff import REPLY_TYPES, Producer
from kvlifecycle.handshake import CompatInfo, GetMeta
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.protocol import WRITE_IN_FLIGHT, PushWrites
from kvlifecycle.sidechannel import SideChannelClient
from kvlifecycle.transport import KVLayout, MemoryKind, XferStatus

BLOCKS, REGIONS, BYTES = 8, 2, 64
TTL_S = 5.0  # long enough that no lease expires under a slow CI step
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
_names = itertools.count()


class Failing(Gated):
    """P's transport: writes stay in flight until :meth:`fail_all`, after which they poll FAILED; counts posts."""

    def __init__(self, inner: LoopbackTransport) -> None:
        super().__init__(inner)
        self.posts = 0
        self.failed: set[int] = set()
        self.cancelled_at: list[float] = []  # when P released a write still in flight (a cancel)

    def post(self, op, plan, local_blocks, remote_blocks, **kwargs):
        self.posts += 1
        return super().post(op, plan, local_blocks, remote_blocks, **kwargs)

    def release(self, handle) -> None:
        if handle.id in self.pending:
            self.cancelled_at.append(time.monotonic())
        super().release(handle)

    def fail_all(self) -> None:
        self.failed.update(self.pending)

    def poll(self, handle):
        return XferStatus.FAILED if handle.id in self.failed else super().poll(handle)

    def error(self, handle):
        return "injected failure" if handle.id in self.failed else super().error(handle)


@pytest.fixture
def setup() -> Iterator[tuple[Producer, Failing, LoopbackTransport]]:
    n = next(_names)
    memory = [np.zeros((BLOCKS, BYTES), dtype=np.uint8) for _ in range(2 * REGIONS)]
    transports = []
    for side, regions in (("p", memory[:REGIONS]), ("d", memory[REGIONS:])):
        t = LoopbackTransport(f"{side}-dup-{n}")
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(r.ctypes.data for r in regions), (BYTES,) * REGIONS))
        transports.append(t)
    writes = Failing(transports[0])
    prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=TTL_S), writes, COMPAT)
    yield prod, writes, transports[1]
    prod.close()
    for t in transports:
        t.close()
    memory.clear()


def _pushing(prod: Producer, writes: Failing, d: LoopbackTransport,
             client: SideChannelClient) -> tuple[PushRequest, bytes]:
    """D's handshake, claim and push of a fresh grant; returns once P's write is in flight (held)."""
    prod.ledger.allocate("r", [0, 1])
    prod.ledger.prefill_done("r")
    grant = prod.grant("r")
    client.request(GetMeta(COMPAT, 0, d.agent, d.epoch, d.local_metadata()))
    claimed = client.request(Heartbeat(grant.transfer, grant.generation, d.agent))
    assert isinstance(claimed, Claimed) and claimed.ok
    push = PushRequest(grant.transfer, grant.generation, d.agent, d.epoch, [2, 3], "r-on-d", 0, claimed.token, 0.0)
    assert client.request(push).ok
    assert until(lambda: writes.posts == 1 and writes.pending, timeout_s=5.0), "P never posted its write"
    return push, claimed.token


def _push_retransmitted_after_a_failed_write(prod: Producer, writes: Failing, d: LoopbackTransport) -> None:
    client = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=5.0)
    try:
        push, _ = _pushing(prod, writes, d, client)
        grant_transfer = push.transfer
        writes.fail_all()
        assert until(lambda: any(note.kind == "failed" for _, note in d.notifications()), timeout_s=5.0)
        time.sleep(0.05)  # P's service loop turns a few more times (every ms): its book of writes is pruned
        assert grant_transfer in prod.ledger.leases  # the lease waits for D's answer to the failure
        again = client.request(push)  # the retransmit
        assert again.ok
        time.sleep(0.05)  # a second write would be posted by P's service loop meanwhile
        assert writes.posts == 1, f"P wrote the failed part again ({writes.posts} posts): {again.detail}"
        assert "duplicate" in again.detail
    finally:
        client.close()


def test_a_push_retransmitted_after_its_write_failed_is_a_duplicate_and_writes_nothing(setup) -> None:
    _push_retransmitted_after_a_failed_write(*setup)


@pytest.mark.mutants
def test_mutant_settled_writes_forgotten_writes_the_retransmit_again(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PushWrites, "prune", lambda self, is_live: setattr(
        self, "accepted", {k for k in self.accepted if self.in_flight(k[0], k[1])}))
    with pytest.raises(AssertionError, match="wrote the failed part again"):
        _push_retransmitted_after_a_failed_write(*setup)


def _handed_back_under_the_write(prod: Producer, writes: Failing, d: LoopbackTransport) -> None:
    events: list = []
    prod.ledger.listeners.append(events.append)
    client = SideChannelClient(prod.address, REPLY_TYPES, timeout_s=5.0)
    try:
        push, token = _pushing(prod, writes, d, client)
        answer = client.request(LoadFailed(push.transfer, push.generation, "D gave up", 0, token, 0))
        assert not answer.ok and answer.detail == WRITE_IN_FLIGHT, f"released under its write: {answer}"
        assert until(lambda: push.transfer not in prod.ledger.leases, timeout_s=5.0)
        released = next(e.at for e in list(events) if isinstance(e, ev.SrcLeaseReleased))
        assert writes.cancelled_at and writes.cancelled_at[0] <= released  # cancelled first, then released
    finally:
        client.close()


def test_a_lease_handed_back_under_its_write_is_released_once_the_write_was_cancelled(setup) -> None:
    _handed_back_under_the_write(*setup)


@pytest.mark.mutants
def test_mutant_a_lease_released_under_its_write(setup, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PushWrites, "held", lambda self: set())
    monkeypatch.setattr(PushWrites, "hand_back", lambda self, transfer, generation, reason: False)
    with pytest.raises(AssertionError, match="released under its write"):
        _handed_back_under_the_write(*setup)
