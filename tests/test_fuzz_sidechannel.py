"""Fuzz a live Producer's side channel over real zmq on 127.0.0.1: whatever a peer sends, the server answers it
(a reply or a refusal, never silence), stays alive, and a legitimate request right after succeeds; after the
whole run a real handoff still completes. Also the named repro: a 20,000-level nested message."""

from __future__ import annotations

import contextlib
import time

import msgspec
import numpy as np
import pytest
from fuzz_msgpack import FUZZ, hostile, tagged
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("torch")

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.handoff import (
    REPLY_TYPES,
    Consumer,
    GetGrant,
    HandoffOptions,
    Heartbeat,
    LoadFailed,
    Producer,
    PushRequest,
)
from kvlifecycle.handshake import CompatInfo, GetMeta
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.sidechannel import Ping, SideChannelClient, SideChannelRefused, encode_envelope, encode_frame
from kvlifecycle.transport import KVLayout, LayoutWire, MemoryKind, PeerMetadata

BLOCKS, BYTES = 64, 32
COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=1, num_kv_heads=1, head_size=16, block_size=1,
                    kv_layout="NHD")
KINDS = ["GetMeta", "GetGrant", "Heartbeat", "PushRequest", "LoadFailed", "Ping"]
FIELDS = ["request", "transfer", "generation", "agent", "hlc", "consumer", "token", "reason", "blocks", "epoch",
          "target_request", "part", "compat", "tp_rank", "meta"]


def typed_messages(known: list) -> st.SearchStrategy[bytes]:
    """Messages that decode (right types) but carry hostile values: they reach the Producer's handlers."""
    text = st.text(max_size=40) | st.sampled_from([k for k in known if isinstance(k, str)])
    counter = st.integers(0, 2**63 - 1) | st.sampled_from([k for k in known if isinstance(k, int)])
    token = st.binary(max_size=64)
    ids = st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, BLOCKS + 2), max_size=8)
    layout = st.builds(LayoutWire, st.sampled_from(["DRAM", "VRAM", "nope"]), st.integers(-5, 5),
                       st.integers(-1, 2**40), st.lists(st.integers(0, 2**64 - 1), max_size=4),
                       st.lists(st.integers(-1, 2**41), max_size=4))
    meta = st.builds(PeerMetadata, text, counter, st.sampled_from(["loopback", "nixl", ""]), st.binary(max_size=32),
                     layout, st.integers(0, 2**64 - 1), st.integers(0, 2**41))
    compat = st.builds(CompatInfo, model_id=st.sampled_from(["m", "x" * 300]), dtype=st.sampled_from(["bfloat16", ""]),
                       num_layers=st.integers(-1, 3), num_kv_heads=st.integers(-1, 3), head_size=st.integers(0, 32),
                       block_size=st.integers(-1, 2), kv_layout=st.sampled_from(["NHD", "HND", "???"]),
                       tp_size=st.integers(-1, 4), wire_version=st.integers(0, 3))
    messages = (
        st.builds(GetGrant, text)
        | st.builds(Heartbeat, text, counter, text, counter, counter, token)
        | st.builds(LoadFailed, text, counter, text, counter, token)
        | st.builds(PushRequest, text, counter, text, counter, ids, text, st.integers(-(2**63), 2**63 - 1), token)
        | st.builds(GetMeta, compat, st.integers(0, 9), text, counter, st.none() | meta, st.none() | meta)
    )
    return messages.map(lambda m: msgspec.msgpack.encode(m))


class Pair:
    def __init__(self, name: str) -> None:
        import torch

        self.src = torch.randint(0, 256, (BLOCKS, BYTES), dtype=torch.uint8)
        self.dst = torch.zeros((BLOCKS, BYTES), dtype=torch.uint8)
        self.tp, self.td = LoopbackTransport(f"p-{name}"), LoopbackTransport(f"d-{name}")
        for t, kv in ((self.tp, self.src), (self.td, self.dst)):
            t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (kv.data_ptr(),), (BYTES,)))
        self.prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=60.0), self.tp, COMPAT)
        self.cons = Consumer(TargetLedger(BLOCKS, worker="d"), self.td, COMPAT, options=HandoffOptions(probe=False))
        self.cons.connect(self.prod.address)
        self.legit = SideChannelClient(self.prod.address, REPLY_TYPES, timeout_s=5.0)
        self.rogue = SideChannelClient(self.prod.address, REPLY_TYPES, timeout_s=5.0)
        self.next_block = 0

    def grant(self, request: str):
        block = self.next_block
        self.next_block += 1
        self.prod.ledger.allocate(request, [block])
        self.prod.ledger.prefill_done(request)
        return self.prod.grant(request), block

    def handoff_works(self, request: str) -> None:
        """A grant, a claim, a read and its completion: the whole path through the side channel."""
        g, block = self.grant(request)
        self.cons.ledger.reserve(request, [block])
        self.cons.pull(request, g, address=self.prod.address)
        assert self.cons.wait_idle(10)
        assert TargetState(self.cons.ledger.requests[request].state).name == "READY_FOR_ATTENTION"
        assert np.array_equal(self.dst[block].numpy(), self.src[block].numpy())
        deadline = time.monotonic() + 10
        while g.transfer in self.prod.ledger.leases and time.monotonic() < deadline:
            time.sleep(0.002)
        assert g.transfer not in self.prod.ledger.leases
        self.cons.ledger.finish(request)

    def close(self) -> None:
        for c in (self.legit, self.rogue):
            c.close()
        self.cons.close()
        self.prod.close()
        self.tp.close()
        self.td.close()


@pytest.fixture
def pair(request: pytest.FixtureRequest):
    p = Pair(f"{request.node.name}-{time.monotonic_ns()}")
    yield p
    p.close()


def deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\xc0"


def test_twenty_thousand_levels_deep_does_not_stop_the_producer(pair: Pair) -> None:
    """The reviewer's repro: a message whose unknown field holds a value nested 20,000 levels deep. msgspec skips
    unknown fields recursively and raises RecursionError; decoded first, it killed the serving thread for good."""
    hidden = b"\x82\xa4type\xa4Ping\xa1x" + deep(20_000)  # {"type": "Ping", "x": [[[...]]]}
    with pytest.raises(RecursionError):
        msgspec.msgpack.decode(hidden, type=Ping)  # what the side channel must never hand the decoder
    for frame in (deep(20_000), encode_frame(deep(20_000), 1), encode_frame(hidden, 2)):
        with pytest.raises(SideChannelRefused) as info:
            pair.rogue.request_raw(frame)
        assert info.value.code == "malformed"
    assert pair.prod.server._thread.is_alive()
    pair.handoff_works("after-deep")


def test_fuzzed_frames_never_silence_the_producer(pair: Pair) -> None:
    published, _ = pair.grant("published")
    known = [published.transfer, published.generation, published.request, 0, 1]
    valid = [
        encode_envelope(GetGrant("published")),
        encode_envelope(Heartbeat(published.transfer, published.generation, "d", 5, 0, b"t" * 16)),
        encode_envelope(LoadFailed(published.transfer, published.generation, "why", 3, b"t" * 16)),
        encode_envelope(PushRequest(published.transfer, published.generation, "d", 1, [1, 2], "r", 0)),
        encode_envelope(GetMeta(COMPAT, 0, "someone", 1)),
        encode_envelope(Ping()),
    ]
    typed = typed_messages(known)
    others = hostile(valid, tagged(KINDS, FIELDS, known))
    bodies = st.one_of(typed, others)  # about half of them reach a handler

    @FUZZ
    @given(body=bodies, framed=st.integers(0, 3).map(lambda roll: roll != 2), rid=st.integers(0, 2**64 - 1))
    def one(body: bytes, framed: bool, rid: int) -> None:
        frame = encode_frame(body, rid) if framed else body  # mostly framed: a raw body is refused at the header
        # served (a well-formed message) or refused with a reason; a timeout (silence) fails the test
        with contextlib.suppress(SideChannelRefused):
            pair.rogue.request_raw(frame)
        assert pair.prod.server._thread.is_alive()
        assert pair.legit.request(GetGrant("published")) == published

    one()
    assert pair.prod.server.bad_messages > 0 and pair.prod.server._thread.is_alive()
    pair.handoff_works("after-fuzz")
    print("side channel after the fuzz: served", pair.prod.server.served, "refused", pair.prod.server.refused)
