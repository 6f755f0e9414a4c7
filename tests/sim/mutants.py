"""Mutants of the ledgers and of the runtime (the Consumer, the protocol core) that the simulation must catch: each
is a function that patches one rule away (through pytest's ``monkeypatch``)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.eventlog import EventLog
from kvlifecycle.handoff import Consumer
from kvlifecycle.layer_progress import LayerProgress
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.protocol import PushWrites, RenewalClock
from kvlifecycle.protocol.bounds import READ_DEADLINE_FRACTION, WriteWindow
from kvlifecycle.sim.world import World
from kvlifecycle.staging import CopyPlan, HostStaging
from kvlifecycle.streaming import StreamConsumer, StreamProducer


def epoch_check_skipped(mp: Any) -> None:
    """The allocator may hand out a pinned block: its epoch moves on under a live lease."""
    mp.setattr(SourceLedger, "_check_allocatable", lambda self, command, request, ids: None)


def release_on_expiry_skipped(mp: Any) -> None:
    """``sweep`` releases nothing: a lease nobody completes pins its blocks forever."""
    mp.setattr(SourceLedger, "sweep", lambda self, keep=(): [])


def completion_applied_twice(mp: Any) -> None:
    """D applies each completion twice, and the ledger counts the repeat as progress."""
    original = TargetLedger._on_part_done

    def on_part_done(self: TargetLedger, e: ev.TgtPartDone) -> None:
        load = self.loads[e.transfer]
        if e.part in load.done:  # a repeat: counted as the next missing part
            missing = [p for p in range(load.parts) if p not in load.done]
            e = ev.TgtPartDone(e.hlc, e.at, e.transfer, missing[0] if missing else e.part)
        original(self, e)

    def part_done(self: TargetLedger, transfer: str, part: int = 0) -> bool:
        if transfer not in self.loads:
            return False
        hlc, at = self._stamp()
        self._record(ev.TgtPartDone(hlc, at, transfer, part))
        return True

    def consumer_part_done(self: Consumer, load: Any, part: int, read: Any = None) -> None:
        for _ in range(2):
            if load.transfer in self.ledger.loads:
                self.ledger.part_done(load.transfer, part)
        load.done.add(part)
        if load.complete:
            self._loads.pop(load.transfer, None)

    mp.setattr(TargetLedger, "_on_part_done", on_part_done)
    mp.setattr(TargetLedger, "part_done", part_done)
    mp.setattr(Consumer, "_part_done", consumer_part_done)


def ready_before_last_handle(mp: Any) -> None:
    """The first completed part makes the request READY_FOR_ATTENTION."""
    original = TargetLedger._on_part_done

    def on_part_done(self: TargetLedger, e: ev.TgtPartDone) -> None:
        load = self.loads[e.transfer]
        load.done.update(range(load.parts))
        original(self, e)

    mp.setattr(TargetLedger, "_on_part_done", on_part_done)


def old_epoch_notification_accepted(mp: Any) -> None:
    """A restarted worker keeps its incarnation, so its transfer ids repeat: a notification from the old agent
    epoch names a lease (or load) of the new one and is accepted."""
    mp.setattr(World, "incarnation", lambda self, name, boots: zlib.crc32(name.encode()))


def released_under_its_write(mp: Any) -> None:
    """P's sweep and D's hand-back release a lease whose WRITE is still in flight."""
    mp.setattr(PushWrites, "held", lambda self: set())
    mp.setattr(PushWrites, "hand_back", lambda self, transfer, generation, reason: False)


def settled_writes_forgotten(mp: Any) -> None:
    """P's record of accepted writes forgets every write that settled, its lease still live: a duplicated
    PushRequest that arrives after the first write failed (and before D's hand-back released the lease) is written
    a second time — into blocks D freed or gave back once it heard of the failure (the simulated network's late
    re-delivery of a push request)."""
    mp.setattr(PushWrites, "prune", lambda self, is_live: setattr(
        self, "accepted", {k for k in self.accepted if self.in_flight(k[0], k[1])}))


def push_timeout_fails_the_load(mp: Any) -> None:
    """D takes a PushRequest without an answer for a failure and frees its blocks (P's write may be landing)."""
    import kvlifecycle.protocol.consumer as rules

    mp.setattr(rules, "on_push_unanswered", lambda: "fail")


def released_at_the_first_consumer(mp: Any) -> None:
    """A lease counted for two consumers (two D ranks each reading their head slice of one P rank's blocks) is
    released at the first completion: the other D rank still reads blocks P frees and reuses."""
    original = SourceLedger.consumer_done

    def consumer_done(self: SourceLedger, transfer: str, generation: int, consumer: int = 0) -> bool:
        done = original(self, transfer, generation, consumer)
        lease = self.leases.get(transfer)
        if done and lease is not None and lease.generation == generation:  # one of several: released anyway
            with self._lock:
                self._release(lease, "cancelled" if lease.cancel_deferred else "completed")
        return done

    mp.setattr(SourceLedger, "consumer_done", consumer_done)


def read_outlives_its_lease(mp: Any) -> None:
    """D trusts a read for as long as it runs, however long ago P last renewed its lease."""
    mp.setattr(RenewalClock, "outlived", lambda self, now: False)


def read_deadline_over_the_latest_part(mp: Any) -> None:
    """A load's read bound is taken over its latest-renewed part instead of its earliest: a part whose renewals
    stopped reaching its P rank is read past that lease's bound while a sibling's lease is fresh."""
    mp.setattr(RenewalClock, "deadline", lambda self: max(
        (sent + ttl * READ_DEADLINE_FRACTION for sent, ttl in self.renewed.values()), default=float("inf")))


def consumer_fail_keeps_its_handles(mp: Any) -> None:
    """The real ``Consumer._fail`` forgets its read handles instead of releasing them: a failed load's reads stay
    posted and land after its blocks were freed."""
    original = Consumer._fail

    def fail(self: Consumer, load: Any, reason: str, **how: Any) -> None:
        load.handles.clear()
        original(self, load, reason, **how)

    mp.setattr(Consumer, "_fail", fail)


def stream_ready_after_first_layer_batch(mp: Any) -> None:
    """A streaming load's part counts as complete once its first layer batch landed: its blocks become
    READY_FOR_ATTENTION with layers (and, chunked, blocks) still missing."""
    mp.setattr(LayerProgress, "complete", lambda self, part: bool(self.landed[part].any()))


def stream_released_under_its_writes(mp: Any) -> None:
    """P's engine releases a streamed request's blocks at once, not once its layer writes settled."""
    original = StreamProducer.release

    def release(self: StreamProducer, request: str, then: Callable[[], None]) -> None:
        then()
        original(self, request, lambda: None)

    mp.setattr(StreamProducer, "release", release)


def stream_written_past_its_window(mp: Any) -> None:
    """P's write window never closes: a stream D timed out is still written, into blocks D freed."""
    mp.setattr(WriteWindow, "closed", lambda self, now: False)


def retry_appends_after_a_partial_frame(mp: Any) -> None:
    """A write that failed part way is not cut back: the retry appends the whole batch after the partial frame."""
    mp.setattr(EventLog, "_cut_back", lambda self, fd, size: None)


def released_before_the_staging_copy(mp: Any) -> None:
    """P hands a lease's GPU blocks over (released as ``staged``, the engine frees and reuses them) as soon as its
    copy to host starts, not once it completed: the copy reads blocks that hold another request's bytes."""
    begin = HostStaging.begin

    def begin_and_hand_over(self: HostStaging, transfer: str) -> CopyPlan | None:
        plan = begin(self, transfer)
        lease = self.source.leases.get(transfer)
        if plan is not None and lease is not None:
            self.source.hand_over_staged(transfer, lease.generation)
        return plan

    def copy_done(self: HostStaging, transfer: str, ok: bool = True, reason: str = "") -> bool:
        if transfer not in self.pool.requests:
            return False
        if not ok:
            return not self.pool.abort(transfer, reason or "copy failed")
        return self.pool.copy_completed(transfer)

    mp.setattr(HostStaging, "begin", begin_and_hand_over)
    mp.setattr(HostStaging, "copy_done", copy_done)


def digest_mismatch_ignored(mp: Any) -> None:
    """D computes its digests of what landed but lets every part through: a corrupted block (a flipped byte, a block
    in the wrong slot, a head slice in the wrong heads) becomes READY_FOR_ATTENTION."""
    import kvlifecycle.handoff.consumer as consumer

    mp.setattr(consumer, "mismatched", lambda expected, found: np.empty(0, dtype=np.int64))


MUTANTS: dict[str, Callable[[Any], None]] = {
    "epoch check skipped": epoch_check_skipped,
    "release on lease expiry skipped": release_on_expiry_skipped,
    "completion applied twice": completion_applied_twice,
    "READY before the last handle finished": ready_before_last_handle,
    "notification accepted from an old agent epoch": old_epoch_notification_accepted,
    "a lease released under its write": released_under_its_write,
    "settled writes forgotten": settled_writes_forgotten,
    "a push timeout fails the load": push_timeout_fails_the_load,
    "a read outlives its lease": read_outlives_its_lease,
    "a lease released at the first of two consumers' completions": released_at_the_first_consumer,
    "the read deadline over the latest part": read_deadline_over_the_latest_part,
    "Consumer._fail keeps its handles": consumer_fail_keeps_its_handles,
    "a stream READY after its first layer batch": stream_ready_after_first_layer_batch,
    "a stream's source released under its writes": stream_released_under_its_writes,
    "a stream written past its window": stream_written_past_its_window,
    "retry appends after a partial frame": retry_appends_after_a_partial_frame,
    "GPU blocks released before the staging copy completed": released_before_the_staging_copy,
    "digest mismatch ignored": digest_mismatch_ignored,
}


def uncancellable_copy_released_as_cancelled(mp: Any) -> None:
    """The handoff takes every transport for one that cancels a released copy: a failing load, a cancelled push or
    a closed stream window releases a running CUDA IPC copy and frees its blocks while the kernel still writes."""
    import kvlifecycle.handoff.consumer as consumer
    import kvlifecycle.handoff.producer as producer
    import kvlifecycle.streaming.producer as stream_producer

    for module in (consumer, producer, stream_producer):
        mp.setattr(module, "cancels_in_flight", lambda transport: True)


MUTANTS["an uncancellable copy treated as cancelled at release"] = uncancellable_copy_released_as_cancelled


def lost_writer_failed_at_once(mp: Any) -> None:
    """``invalidate_peer`` takes a P the control plane declared lost for dead: its push loads fail, and D frees
    or recomputes their blocks, at once, while the P (alive, cut off from etcd only) still writes into them."""
    from kvlifecycle.protocol import WriteBound

    mp.setattr(WriteBound, "deadline", lambda self: -float("inf"))


def lost_streams_ended_at_once(mp: Any) -> None:
    """A layer-wise stream of a P declared lost ends at once (its load fails, its blocks freed), while the P, alive,
    still writes its layers within its window."""
    mp.setattr(StreamConsumer, "peer_lost", _peer_lost_ignoring_may_write)


_real_peer_lost = StreamConsumer.peer_lost


def _peer_lost_ignoring_may_write(self: StreamConsumer, agent: str, reason: str, *,
                                  before_epoch: int | None = None, may_write: bool = False) -> int:
    return _real_peer_lost(self, agent, reason, before_epoch=before_epoch)


MUTANTS["a P declared lost taken for dead under its push"] = lost_writer_failed_at_once
MUTANTS["a P declared lost taken for dead under its stream"] = lost_streams_ended_at_once
