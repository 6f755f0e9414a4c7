"""A read never outlives its lease when P goes silent (docs/design.md): D's service loop never waits on a peer, so
with P's side channel silent (a real TCP proxy that stops forwarding, connections left open) while D's reads of it
are held in flight, D cancels each read and releases its handle strictly before the earliest instant P may expire
the lease, for one and for two loads against the silent P, while a second, healthy P's loads keep completing; and
``invalidate_peer`` runs while a call to the silent P is still outstanding. All times are ``time.monotonic`` of
this one process (the ledgers' clocks). The mutant tests put back what this guards against and expect the failure.
Every wait is bounded; nothing asserts on how long anything took."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

pytest.importorskip("torch")

from held_transport import Gated
from kvlifecycle.transports.loopback import LoopbackTransport
from silent_proxy import SilentProxy
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.control import Heartbeat
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol import consumer as rules
from kvlifecycle.protocol.launch import beat_every
from kvlifecycle.sidechannel import SideChannelError
from kvlifecycle.transport import KVLayout, MemoryKind, TransferHandle

BLOCKS, REGIONS, BYTES = 16, 2, 64
TTL_S = 1.2  # the silent P's leases: D heartbeats every TTL/6 (the default rhythm); the margin is 0.1 TTL
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")
_names = itertools.count()


class HeldFrom(Gated):
    """D's transport: reads of the ``held`` P agents stay in flight (no byte moves) until released, which cancels
    them (as NIXL cancels a released request) and records when; reads of any other P move at once."""

    def __init__(self, inner, held: set[str]) -> None:
        super().__init__(inner)
        self.held = held
        self.cancelled_at: dict[str, float] = {}  # transfer -> when D released its pending read

    def post(self, op, plan, local_blocks, remote_blocks, **kwargs) -> TransferHandle:
        if plan.peer not in self.held:
            return self.inner.post(op, plan, local_blocks, remote_blocks, **kwargs)
        return super().post(op, plan, local_blocks, remote_blocks, **kwargs)

    def poll(self, handle):
        return self.inner.poll(handle) if handle.id >= 0 else super().poll(handle)

    def stats(self, handle):
        return self.inner.stats(handle) if handle.id >= 0 else super().stats(handle)

    def error(self, handle):
        return self.inner.error(handle) if handle.id >= 0 else super().error(handle)

    def release(self, handle: TransferHandle) -> None:
        if handle.id >= 0:
            self.inner.release(handle)
            return
        if handle.id in self.pending:
            self.cancelled_at[handle.transfer] = time.monotonic()
        super().release(handle)


def _transport(kind: str, name: str):
    if kind == "nixl":
        pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")
        from kvlifecycle.transports.nixl import NixlTransport

        return NixlTransport(name, probe_bytes=0)
    return LoopbackTransport(name)


@dataclass
class Cluster:
    silent: Producer  # its side channel is reached through ``proxy``
    healthy: Producer
    cons: Consumer
    held: HeldFrom
    proxy: SilentProxy
    plog: list = field(default_factory=list)  # the silent P's events
    dlog: list = field(default_factory=list)
    closers: list = field(default_factory=list)

    def close(self) -> None:
        self.cons.close()
        self.proxy.close()
        for closer in self.closers:
            closer()


def make_cluster(kind: str, *, load_timeout_s: float = 4.0) -> Cluster:
    import torch

    n = next(_names)
    memory = []
    transports = {}
    for side in ("ps", "ph", "d"):
        kv = [torch.randint(1, 256, (BLOCKS, BYTES), dtype=torch.uint8) if side != "d" else
              torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(REGIONS)]
        memory.append(kv)
        t = _transport(kind, f"{side}-silent-{n}")
        t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * REGIONS))
        transports[side] = t
    silent = Producer(SourceLedger(BLOCKS, worker="ps", default_ttl_s=TTL_S), transports["ps"], COMPAT)
    healthy = Producer(SourceLedger(BLOCKS, worker="ph", default_ttl_s=30.0), transports["ph"], COMPAT)
    held = HeldFrom(transports["d"], {transports["ps"].agent})
    cons = Consumer(TargetLedger(BLOCKS, worker="d"), held, COMPAT,
                    options=HandoffOptions(probe=False, load_timeout_s=load_timeout_s, request_timeout_s=2.0))
    proxy = SilentProxy(silent.address)
    cluster = Cluster(silent, healthy, cons, held, proxy)
    silent.ledger.listeners.append(cluster.plog.append)
    cons.ledger.listeners.append(cluster.dlog.append)
    cons.connect(proxy.address)
    cons.connect(healthy.address)
    cluster.closers = [silent.close, healthy.close, *(t.close for t in transports.values()), lambda: memory.clear()]
    return cluster


def _grant(prod: Producer, request: str, blocks: list[int], ttl_s: float | None = None):
    prod.ledger.allocate(request, blocks)
    prod.ledger.prefill_done(request)
    return prod.grant(request, ttl_s=ttl_s)


@dataclass
class Outcome:
    """For each read of the silent P: when D released its handle and recorded the load's failure, and the earliest
    instant P could expire its lease (the last ``expires_at`` P recorded for it); and the healthy P's loads."""

    d_released: dict[str, float]
    d_failed: dict[str, float]
    p_expiry: dict[str, float]
    healthy_loaded: int
    healthy_asked: int
    renewed_while_silent: dict[str, int]  # renewals P took of each lease after the silence began (one way only)

    def margins(self) -> dict[str, float]:
        """P's expiry minus D's release of the read, per transfer (positive: D let go first)."""
        return {t: self.p_expiry[t] - self.d_released.get(t, float("inf")) for t in self.p_expiry}


def silent_peer_run(kind: str, silent_loads: int, *, healthy_loads: int = 3, replies_only: bool = False) -> Outcome:
    """Reads of the silent P held in flight, then its side channel goes silent (``replies_only``: one way, P still
    hears D); the healthy P's loads are pulled meanwhile. Returns when D ended every silent read and P released
    every lease (bounded waits)."""
    c = make_cluster(kind)
    try:
        transfers = []
        for i in range(silent_loads):
            g = _grant(c.silent, f"s{i}", [2 * i, 2 * i + 1])
            c.cons.ledger.reserve(f"s{i}", [2 * i, 2 * i + 1])
            c.cons.pull(f"s{i}", g, address=c.proxy.address)
            transfers.append(g.transfer)
        assert until(lambda: len(c.held.pending) == silent_loads), "the silent P's reads were never posted"
        renewed_before = _renewals(c.plog)
        c.proxy.silence(replies_only=replies_only)
        for j in range(healthy_loads):  # a silent peer delays no other peer's loads
            request = f"h{j}"
            g = _grant(c.healthy, request, [8 + j])
            c.cons.ledger.reserve(request, [8 + j])
            c.cons.pull(request, g, address=c.healthy.address)
            until(lambda n=j + 1: c.cons.ledger.stats["loaded"] == n, timeout_s=5.0)
        healthy_loaded = c.cons.ledger.stats["loaded"]
        # (a D that never ends them is what :func:`check` reports)
        until(lambda: set(transfers) <= {e.transfer for e in list(c.dlog) if isinstance(e, ev.TgtLoadFailed)},
              timeout_s=10.0)
        expired = {e.transfer for e in c.plog if isinstance(e, ev.SrcLeaseReleased) and e.reason == "expired"}
        assert until(lambda: set(transfers) <= {e.transfer for e in list(c.plog)
                                                if isinstance(e, ev.SrcLeaseReleased)}, timeout_s=10.0), expired
        p_expiry: dict[str, float] = {}
        for e in list(c.plog):
            if isinstance(e, ev.SrcGranted | ev.SrcLeaseRenewed) and e.transfer in transfers:
                p_expiry[e.transfer] = e.expires_at
        d_failed = {e.transfer: e.at for e in list(c.dlog) if isinstance(e, ev.TgtLoadFailed)}
        renewed_after = _renewals(c.plog)
        renewed = {t: renewed_after.get(t, 0) - renewed_before.get(t, 0) for t in transfers}
        return Outcome(dict(c.held.cancelled_at), d_failed, p_expiry, healthy_loaded, healthy_loads, renewed)
    finally:
        c.close()


def _renewals(plog: list) -> dict[str, int]:
    counts: dict[str, int] = {}
    for e in list(plog):
        if isinstance(e, ev.SrcLeaseRenewed):
            counts[e.transfer] = counts.get(e.transfer, 0) + 1
    return counts


def check(outcome: Outcome) -> None:
    """The property: every silent read released and failed at D strictly before P may expire its lease; the
    healthy P's loads all completed."""
    for transfer, expiry in outcome.p_expiry.items():
        assert transfer in outcome.d_released, f"{transfer}: D still held its read after P's expiry"
        assert outcome.d_released[transfer] < expiry, (
            f"{transfer}: D released its read {outcome.d_released[transfer] - expiry:+.4f} s after P's expiry")
        assert outcome.d_failed.get(transfer, float("inf")) < expiry, (
            f"{transfer}: D recorded the end of its read after P's expiry")
    assert outcome.healthy_loaded == outcome.healthy_asked


@pytest.fixture
def report(request: pytest.FixtureRequest) -> Iterator[list[Outcome]]:
    outcomes: list[Outcome] = []
    yield outcomes
    for o in outcomes:  # the measured margins, for the record (-rP shows them)
        print(request.node.name, {t: round(m, 4) for t, m in o.margins().items()})


@pytest.mark.parametrize("kind", ["loopback", "nixl"])
@pytest.mark.parametrize("silent_loads", [1, 2])
def test_d_ends_reads_of_a_silent_peer_before_its_leases_may_expire(kind: str, silent_loads: int, report) -> None:
    outcome = silent_peer_run(kind, silent_loads)
    report.append(outcome)
    assert len(outcome.p_expiry) == silent_loads
    check(outcome)


def test_d_ends_reads_before_p_may_expire_when_only_ps_replies_are_lost(report) -> None:
    """One way: P still hears D's renewals (its lease lives on) but D hears nothing back, so D's bound, on the
    renewals P acknowledged, ends the reads; P releases when D's hand-back reaches it, or at its expiry."""
    outcome = silent_peer_run("loopback", 2, replies_only=True)
    report.append(outcome)
    assert len(outcome.p_expiry) == 2
    check(outcome)
    # each load's renewals still went out, one after the other on the peer's worker: none starved behind the first
    assert all(n > 0 for n in outcome.renewed_while_silent.values()), outcome.renewed_while_silent


def test_invalidate_peer_runs_while_a_call_to_the_silent_peer_is_outstanding() -> None:
    """A heartbeat to the silent P is outstanding (its timeout is a sixth of a long TTL): ``invalidate_peer`` fails
    the load and drops the link at once, with the heartbeat still unanswered; a load whose claim is outstanding is
    abandoned."""
    c = make_cluster("loopback", load_timeout_s=60.0)
    try:
        g = _grant(c.silent, "s", [1], ttl_s=30.0)  # a heartbeat waits up to 5 s for its answer
        c.cons.ledger.reserve("s", [1])
        c.cons.pull("s", g, address=c.proxy.address)
        assert until(lambda: len(c.held.pending) == 1)
        c.proxy.silence()
        g2 = _grant(c.silent, "s2", [2], ttl_s=30.0)
        c.cons.ledger.reserve("s2", [2])
        c.cons.pull("s2", g2, address=c.proxy.address)  # its claim goes out to the silent P
        client = c.cons.links[c.proxy.address].client
        assert until(lambda: c.proxy.swallowed > 0 and client._lock.locked())  # a request is out, unanswered
        failed = c.cons.invalidate_peer(c.silent.transport.agent, c.silent.transport.epoch, "cable pulled",
                                        timeout_s=30.0)
        assert client._lock.locked()  # the call to the silent P is still outstanding: invalidate did not wait
        assert failed == [g.transfer]
        assert c.held.cancelled == 1
        assert "cable pulled" in c.cons.abandoned.get("s2", "")
        assert c.proxy.address not in c.cons.links
        assert c.cons.wait_idle(5)
    finally:
        c.close()


# -- mutants: each puts back what the property guards against, and the run above must fail -----------------------
def _blocking_heartbeat(self: Consumer, load, now: float) -> None:
    """The heartbeat as it was: each renewal a blocking request on the service thread (timeout TTL/6)."""
    every = beat_every(min(g.ttl_s for _, g, _ in load.parts), self.options.heartbeat_every_s)
    if load.beat(now, every) != "renew":
        return
    for link, grant, part in load.parts:
        sent = time.monotonic()
        try:
            beat = link.client.request(
                Heartbeat(grant.transfer, grant.generation, self.transport.agent, self.ledger.hlc.tick(),
                          consumer=self._consumer_index(link), token=load.tokens.get(part, b"")), timeout_s=every)
        except SideChannelError:
            continue
        if not beat.ok:
            self._settle_by(load, rules.on_renewal_refused(load.mode, beat.detail), f"lease lost: {beat.detail}")
            return
        load.renewals.acknowledged(part, sent, grant.ttl_s)


@pytest.mark.mutants
def test_mutant_a_blocking_heartbeat_lets_a_read_outlive_its_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Consumer, "_heartbeat", _blocking_heartbeat)
    with pytest.raises(AssertionError, match="after P's expiry"):
        check(silent_peer_run("loopback", 2, healthy_loads=1))


@pytest.mark.mutants
def test_mutant_no_per_step_read_bound_lets_a_read_outlive_its_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Consumer, "_cancel_outlived_reads", lambda self, now: None)
    with pytest.raises(AssertionError, match="after P's expiry"):
        check(silent_peer_run("loopback", 1, healthy_loads=1))
