"""Per-block digests on layer-wise streams (loopback, one process): under ``verify`` P sends each layer batch's
digest in its notification and D checks what landed before the layers count, so a byte changed on the way, or a
batch written into the wrong blocks, fails the load before any block becomes READY_FOR_ATTENTION. The same check
over real NIXL: ``tests/transports/test_streaming_digests_nixl.py``. Every wait is bounded."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

from kvlifecycle.transports.digest_host import HostDigester
from kvlifecycle.transports.loopback import LoopbackTransport
from waiting import until

from kvlifecycle import events as ev
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.handshake import CompatInfo
from kvlifecycle.invariants import check_source, check_target, check_target_events
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.story import digest_words
from kvlifecycle.streaming import StreamConsumer, StreamOptions, StreamProducer
from kvlifecycle.streaming.wire import NOTE_LAYERS, LayerBatch, decode_batch, encode_batch
from kvlifecycle.transport import KVLayout, MemoryKind, Notification

BLOCKS, LAYERS, BYTES = 16, 3, 64
READY = 3  # TargetBlockState.READY_FOR_ATTENTION
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=LAYERS, num_kv_heads=2, head_size=16, block_size=1,
                    kv_layout="NHD")


class OnLayerNote:
    """D's transport, except that ``act`` runs once, on the first ``layers`` notification of layer ``layer``,
    before D's service thread takes it: the bytes the write landed are changed, or the note itself."""

    def __init__(self, inner: LoopbackTransport, layer: int, act: Callable[[Notification], Notification]) -> None:
        self._inner, self._layer, self._act, self.fired = inner, layer, act, False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def notifications(self) -> list[tuple[str, Notification]]:
        out = []
        for sender, note in self._inner.notifications():
            if not self.fired and note.kind == NOTE_LAYERS and decode_batch(note.payload)[1].first_layer == self._layer:
                self.fired = True
                note = self._act(note)
            out.append((sender, note))
        return out


class Pair:
    """P and D over loopback, each side's verify as given, D's transport wrapped by ``wrap``."""

    def __init__(self, name: str, *, verify_p: str = "all", verify_d: str = "all",
                 wrap: Callable[[LoopbackTransport, list[Any]], Any] | None = None) -> None:
        import torch

        self.src = [torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
        self.dst = [torch.zeros((BLOCKS, BYTES), dtype=torch.uint8) for _ in range(LAYERS)]
        self.tp, self.td = LoopbackTransport(f"p-{name}"), LoopbackTransport(f"d-{name}")
        layouts = []
        for t, kv in ((self.tp, self.src), (self.td, self.dst)):
            layouts.append(KVLayout(MemoryKind.DRAM, 0, BLOCKS, tuple(x.data_ptr() for x in kv), (BYTES,) * LAYERS))
            t.register(layouts[-1])
        self.events: list[ev.Event] = []
        self.sl = SourceLedger(BLOCKS, worker="p")
        self.tl = TargetLedger(BLOCKS, worker="d", failure_policy="fail")
        self.tl.listeners.append(self.events.append)
        self.prod = Producer(self.sl, self.tp, COMPAT, options=HandoffOptions(verify=verify_p),
                             digester=HostDigester(layouts[0]))
        d_transport = wrap(self.td, self.dst) if wrap is not None else self.td
        self.cons = Consumer(self.tl, d_transport, COMPAT, options=HandoffOptions(verify=verify_d),
                             digester=HostDigester(layouts[1]))
        self.cons.connect(self.prod.address)
        options = StreamOptions(stream_timeout_s=10.0)
        self.sp = StreamProducer(self.prod, layers=LAYERS, options=options)
        self.sc = StreamConsumer(self.cons, options=options)

    def stream(self, src: list[int], dst: list[int]) -> None:
        self.sp.ledger.allocate("r", src)
        self.sc.ledger.reserve("r", dst)
        assert self.sc.request_stream("r", self.prod.address, layers=LAYERS)
        assert self.sp.begin("r")
        for layer in range(LAYERS):
            self.sp.layer_done("r", layer, src)
        assert until(lambda: self.sc.pending() == 0)

    def close(self) -> None:
        self.sp.ledger.prefill_done("r")
        self.sp.release("r", lambda: self.sp.ledger.free("r"))
        assert until(lambda: self.sp.pending() == 0)
        for part in (self.sc, self.sp, self.cons, self.prod, self.tp, self.td):
            part.close()
        assert check_source(self.sl) == [] and check_target(self.tl) == [] and check_target_events(self.events) == []


@pytest.fixture
def make_pair(request: pytest.FixtureRequest):
    def make(**kwargs: Any) -> Pair:
        return Pair(f"{request.node.name}-{time.monotonic_ns()}", **kwargs)

    return make


def test_every_layer_batch_is_checked_and_the_stream_lands(make_pair) -> None:
    pair = make_pair()
    pair.stream([1, 2, 3], [7, 8, 9])
    assert pair.sc.counts["completed"] == 1 and (pair.tl.state[[7, 8, 9]] == READY).all()
    assert pair.sc.counts["verified_batches"] == LAYERS and pair.sc.counts["unverified_batches"] == 0
    landed = [e for e in pair.events if isinstance(e, ev.TgtLayersLanded)]
    assert len(landed) == LAYERS and all(e.verified for e in landed)
    done = [e for e in pair.events if isinstance(e, ev.TgtPartDone)]
    assert [e.verified for e in done] == [3] and pair.tl.stats["verified_blocks"] == 3  # the log says it was checked
    pair.tl.finish("r")
    pair.close()


def _flip_landed_byte(dst: list[Any], layer: int, block: int) -> Callable[[Notification], Notification]:
    def act(note: Notification) -> Notification:
        dst[layer][block, 5] ^= 0x41  # after the write landed, before D takes its note
        return note

    return act


def _mismatch_refused(pair: Pair, blocks: list[int]) -> None:
    mismatches = [e for e in pair.events if isinstance(e, ev.TgtDigestMismatch)]
    assert len(mismatches) == 1 and np.frombuffer(mismatches[0].blocks, dtype=np.int32).tolist() == blocks
    assert pair.sc.counts["digest_mismatches"] == 1 and pair.sc.counts["failed"] == 1
    after = pair.events[pair.events.index(mismatches[0]):]
    assert not any(isinstance(e, ev.TgtLayersLanded) for e in after)  # no layer counts after it: never READY
    assert sum(isinstance(e, ev.TgtLayersLanded) for e in pair.events) < LAYERS
    assert any(isinstance(e, ev.TgtLoadFailed) and "digest mismatch" in e.reason for e in pair.events)


def test_a_byte_changed_on_the_way_fails_the_stream_before_attention(make_pair) -> None:
    pair = make_pair(wrap=lambda td, dst: OnLayerNote(td, 1, _flip_landed_byte(dst, 1, 8)))
    pair.stream([1, 2, 3], [7, 8, 9])
    _mismatch_refused(pair, [7, 8, 9])
    (mismatch,) = [e for e in pair.events if isinstance(e, ev.TgtDigestMismatch)]
    assert (mismatch.first_layer, mismatch.num_layers) == (1, 1)
    assert digest_words(mismatch).startswith("part 0: layers 1-1 of blocks 7-9 (a stream's batch)")
    assert "r" not in pair.tl.requests  # policy fail: the blocks are freed, once P's writes settled
    pair.close()


def test_a_batch_said_to_land_in_other_blocks_fails_the_stream(make_pair) -> None:
    """The note names positions [0, 2) for a write that landed in all three: D reads blocks 7 and 8 only, whose
    batch digest is not the one P sent for three blocks (a write mapped to the wrong slots)."""

    def shift(note: Notification) -> Notification:
        token, batch = note.payload[:16], decode_batch(note.payload)[1]
        moved = LayerBatch(batch.first_layer, batch.num_layers, 0, 2, batch.digest)
        return Notification(note.request, note.transfer, note.generation, note.epoch, note.kind, note.part,
                            encode_batch(token, moved), hlc=note.hlc)

    pair = make_pair(wrap=lambda td, _dst: OnLayerNote(td, 0, shift))
    pair.stream([1, 2, 3], [7, 8, 9])
    _mismatch_refused(pair, [7, 8])
    pair.close()


@pytest.mark.mutants
def test_mutant_verification_off_on_d_lets_the_changed_byte_reach_attention(make_pair) -> None:
    pair = make_pair(verify_d="none", wrap=lambda td, dst: OnLayerNote(td, 1, _flip_landed_byte(dst, 1, 8)))
    pair.stream([1, 2, 3], [7, 8, 9])
    assert pair.sc.counts["completed"] == 1 and (pair.tl.state[[7, 8, 9]] == READY).all()
    assert not np.array_equal(pair.dst[1][[7, 8, 9]].numpy(), pair.src[1][[1, 2, 3]].numpy())  # wrong bytes, READY
    pair.tl.finish("r")
    pair.close()


def test_a_p_that_does_not_verify_sends_no_digest_and_d_loads_unchecked(make_pair) -> None:
    pair = make_pair(verify_p="none")
    pair.stream([1, 2, 3], [7, 8, 9])
    assert pair.sc.counts["completed"] == 1
    assert pair.sc.counts["unverified_batches"] == LAYERS and pair.sc.counts["verified_batches"] == 0
    assert [e.verified for e in pair.events if isinstance(e, ev.TgtPartDone)] == [0]  # the log says: unchecked
    pair.tl.finish("r")
    pair.close()


def test_an_older_layer_batch_without_a_digest_decodes_and_a_digest_is_bounded() -> None:
    import msgspec

    token = b"t" * 16
    old = token + msgspec.msgpack.encode([0, 1, 0, 3])  # the four fields before the digest
    assert decode_batch(old)[1] == LayerBatch(0, 1, 0, 3)
    with pytest.raises(ValueError):
        decode_batch(token + msgspec.msgpack.encode([0, 1, 0, 3, -1]))
    assert decode_batch(encode_batch(token, LayerBatch(0, 1, 0, 3, (1 << 64) - 1)))[1].digest == (1 << 64) - 1
