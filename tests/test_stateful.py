"""Random interleavings of every command on a P and a D ledger; the invariants hold after each step, a pinned block
is never handed out, a stale token never changes anything, and replay reproduces the live state."""

from __future__ import annotations

import contextlib
import shutil
import tempfile

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlifecycle.clock import HybridLogicalClock, ManualClock
from kvlifecycle.invariants import check_quiescent, check_source, check_target, check_target_events
from kvlifecycle.ledger import BlockBusyError, InvalidBlockIdsError, InvalidTransitionError, open_ledger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.replay import check_pair, replay

N = 12


class Handoffs(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp()
        self.clock = ManualClock(0.0)
        hlc = HybridLogicalClock()
        self.p = open_ledger(
            "source", N, f"{self.dir}/p", clock=self.clock, hlc=hlc, worker="p0", default_ttl_s=5.0, fsync="never"
        )
        self.d = open_ledger(
            "target",
            N,
            f"{self.dir}/d",
            clock=self.clock,
            hlc=hlc,
            worker="d0",
            failure_policy="recompute",
            fsync="never",
        )
        self.grants: dict[str, object] = {}  # request -> grant, including ones long gone (stale tokens)
        self.n = 0

    # -- P side ---------------------------------------------------------------------------------------------
    @rule(size=st.integers(1, 3), data=st.data())
    def allocate(self, size: int, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.integers(0, N - 1), min_size=size, max_size=size, unique=True))
        name = f"r{self.n}"
        self.n += 1
        before = self.p.state[blocks].copy()
        try:
            self.p.allocate(name, blocks)
        except BlockBusyError:
            assert (before != SourceState.FREE).any()
            assert np.array_equal(self.p.state[blocks], before)  # refused: nothing changed
            return
        assert not (before == SourceState.PINNED_FOR_TRANSFER).any()

    @rule(data=st.data())
    def prefill_and_grant(self, data: st.DataObject) -> None:
        ready = [r for r, q in self.p.requests.items() if not q.leases and r not in self.grants]
        if not ready:
            return
        name = data.draw(st.sampled_from(sorted(ready)))
        if (self.p.state[self.p.requests[name].blocks] == SourceState.ALLOCATED).any():
            self.p.prefill_done(name)
        self.grants[name] = self.p.grant(name, consumers=data.draw(st.integers(1, 2)))

    @rule(data=st.data())
    def consumer_done(self, data: st.DataObject) -> None:
        if self.grants:
            name = data.draw(st.sampled_from(sorted(self.grants)))
            g = self.grants[name]
            if g.transfer in self.d.loads:  # D reports done only after its read settled (part_done / fail_load)
                return
            live = g.transfer in self.p.leases
            before = (self.p.state.copy(), self.p.pins.copy())
            ok = self.p.consumer_done(g.transfer, g.generation, data.draw(st.integers(0, 1)))
            if not live:  # a stale token never changes anything
                assert not ok
                assert np.array_equal(before[0], self.p.state) and np.array_equal(before[1], self.p.pins)

    @rule(data=st.data())
    def heartbeat(self, data: st.DataObject) -> None:
        if self.grants:
            g = self.grants[data.draw(st.sampled_from(sorted(self.grants)))]
            self.p.heartbeat(g.transfer, g.generation)

    @rule(data=st.data())
    def cancel_p(self, data: st.DataObject) -> None:
        if self.p.requests:
            self.p.cancel(data.draw(st.sampled_from(sorted(self.p.requests))))

    @rule(seconds=st.floats(0.5, 6.0))
    def time_passes(self, seconds: float) -> None:
        self.clock.advance(seconds)
        # D gives a read up at its bound, before P may expire the lease it reads (a read never outlives its lease)
        for transfer in list(self.d.loads):
            lease = self.p.leases.get(transfer)
            if lease is not None and lease.expires_at <= self.clock.now():
                self.d.fail(transfer, "read bound reached")
        self.p.sweep()

    @rule()
    def free_released(self) -> None:
        for released in self.p.take_released():
            if not self.p.requests[released.request].leases:
                self.p.free(released.request, cache=self.n % 2 == 0)
                self.grants.pop(released.request, None)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        cached = np.flatnonzero((self.p.state == SourceState.PREFIX_CACHED) & (self.p.refs == 0))
        if cached.size:
            self.p.evict([int(data.draw(st.sampled_from(cached.tolist())))])

    # -- D side ---------------------------------------------------------------------------------------------
    @rule(data=st.data())
    def reserve_and_load(self, data: st.DataObject) -> None:
        candidates = [r for r, g in self.grants.items() if g.transfer in self.p.leases and r not in self.d.requests]
        if not candidates:
            return
        name = data.draw(st.sampled_from(sorted(candidates)))
        g = self.grants[name]
        free = np.flatnonzero(self.d.state == TargetState.FREE)
        if free.size < g.block_ids.size:
            return
        self.d.reserve(name, free[: g.block_ids.size])
        if self.p.heartbeat(g.transfer, g.generation):  # claim before reading
            self.d.start_load(name, g.transfer, parts=2, generation=g.generation)
        else:
            self.d.cancel(name)

    @rule(data=st.data(), part=st.integers(0, 2))
    def part_done(self, data: st.DataObject, part: int) -> None:
        if self.d.loads:
            transfer = data.draw(st.sampled_from(sorted(self.d.loads)))
            self.d.part_done(transfer, part)

    @rule(data=st.data())
    def complete_transfer(self, data: st.DataObject) -> None:
        """The common case: every part lands, then every consumer reports to P."""
        if not self.d.loads:
            return
        transfer = data.draw(st.sampled_from(sorted(self.d.loads)))
        load = self.d.loads[transfer]
        for part in range(load.parts):
            self.d.part_done(transfer, part)
        g = self.grants.get(load.request)
        if g is not None:
            for consumer in range(g.consumers):
                self.p.consumer_done(g.transfer, g.generation, consumer)

    @rule(data=st.data())
    def load_failed(self, data: st.DataObject) -> None:
        if self.d.loads:
            self.d.fail(data.draw(st.sampled_from(sorted(self.d.loads))), "injected")

    @rule(data=st.data())
    def cancel_d(self, data: st.DataObject) -> None:
        if self.d.requests:
            self.d.cancel(data.draw(st.sampled_from(sorted(self.d.requests))))

    @rule()
    def finish_ready_d(self) -> None:
        for name, req in list(self.d.requests.items()):
            states = self.d.state[req.blocks]
            if (states == TargetState.READY_FOR_ATTENTION).all():
                self.d.finish(name)
            elif (states == TargetState.RESERVED).all() and req.transfer is None:
                with contextlib.suppress(InvalidTransitionError):
                    self.d.local_fill(name)

    @rule(
        command=st.sampled_from(["allocate", "share", "evict", "reserve"]),
        ids=st.lists(st.integers(-3, N + 2) | st.sampled_from([2**32, 2**32 + 1, -(2**31) - 1]), max_size=4)
        | st.lists(st.floats(0, N), min_size=1, max_size=2),
    )
    def hostile_ids(self, command: str, ids: list) -> None:
        """Ids a buggy or hostile caller could pass: refused (with one Refused event, nothing else changed) exactly
        when they are not each a block of the pool once; valid ones go on to the usual state checks."""
        ledger = self.d if command == "reserve" else self.p
        name = f"r{self.n}"
        self.n += 1
        valid = bool(ids) and all(isinstance(b, int) and 0 <= b < N for b in ids) and len(set(ids)) == len(ids)
        before = (ledger.state.copy(), sum(ledger.refusals.values()))
        try:
            getattr(ledger, command)(*(() if command == "evict" else (name,)), np.array(ids))
        except InvalidBlockIdsError:
            assert not valid
            assert np.array_equal(ledger.state, before[0]) and sum(ledger.refusals.values()) == before[1] + 1
        except (BlockBusyError, InvalidTransitionError):
            assert valid  # well-formed ids, refused for the blocks' states
        else:
            assert valid

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def ledgers_are_consistent(self) -> None:
        assert not check_source(self.p), check_source(self.p)
        assert not check_target(self.d), check_target(self.d)

    @precondition(lambda self: self.n % 7 == 0)
    @invariant()
    def replay_equals_live(self) -> None:
        self.p.log.commit()
        self.d.log.commit()
        for ledger, path in ((self.p, "p"), (self.d, "d")):
            r = replay(f"{self.dir}/{path}")
            assert np.array_equal(r.ledger.state, ledger.state)
            assert np.array_equal(r.ledger.epoch, ledger.epoch)
            assert {n: q.blocks.tolist() for n, q in r.ledger.requests.items()} == {
                n: q.blocks.tolist() for n, q in ledger.requests.items()}  # every block's owner

    def teardown(self) -> None:
        try:
            # drain: settle every load, end every lease, free everything; the counts must reach zero
            for transfer in list(self.d.loads):
                self.d.fail(transfer, "drain")
            for name in list(self.d.requests):
                self.d.cancel(name)
            self.clock.advance(1000.0)
            self.p.sweep()
            for i, name in enumerate(list(self.p.requests)):
                if (self.p.state[self.p.requests[name].blocks] == SourceState.ALLOCATED).any():
                    self.p.cancel(name)
                else:
                    self.p.free(name, cache=i % 2 == 0)  # kept for prefix reuse: evicted below
            cached = np.flatnonzero(self.p.state == SourceState.PREFIX_CACHED)
            if cached.size:
                self.p.evict(cached)
            assert not check_quiescent(self.p) and not check_quiescent(self.d)
            assert (self.p.state == 0).all() and (self.d.state == 0).all()
            self.p.log.close()
            self.d.log.close()
            results = [replay(f"{self.dir}/p"), replay(f"{self.dir}/d")]
            for r, ledger in zip(results, (self.p, self.d), strict=True):  # the fold ends where the live ledger did
                assert np.array_equal(r.ledger.state, ledger.state) and np.array_equal(r.ledger.epoch, ledger.epoch)
            assert not check_target_events(results[1].events)
            assert not check_pair(results)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


Handoffs.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_handoffs = Handoffs.TestCase
