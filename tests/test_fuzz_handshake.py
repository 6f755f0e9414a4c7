"""Fuzz the handshake decoder: any bytes give a checked GetMeta / MetaReply or a MalformedHandshakeError. What it
accepts is usable: the layout exists, and negotiating with it gives a plan or a CompatMismatchError, nothing
else. A legitimate reply decodes right after."""

from __future__ import annotations

import msgspec
from fuzz_msgpack import FUZZ, hostile, tagged
from hypothesis import given
from hypothesis import strategies as st

from kvlifecycle.handshake import (
    CompatInfo,
    CompatMismatchError,
    GetMeta,
    MalformedHandshakeError,
    MetaReply,
    decode_handshake,
    negotiate,
)
from kvlifecycle.transport import LayoutWire, PeerMetadata

COMPAT = CompatInfo(model_id="m", dtype="bfloat16", num_layers=4, num_kv_heads=8, head_size=64, block_size=16,
                    kv_layout="HND", tp_size=2)
META = PeerMetadata("p", 5, "nixl", b"blob", LayoutWire("DRAM", 0, 16, [4096, 8192], [256, 256]))
LEGIT = MetaReply(COMPAT, 1, META)
GROUPED = PeerMetadata("p", 5, "nixl", b"blob", LayoutWire("DRAM", 0, 19, [4096, 8192, 1 << 20], [256, 256, 40],
                                                            [(2, 16), (1, 3)]))  # KV pages, then aux rows
VALID = [msgspec.msgpack.encode(LEGIT), msgspec.msgpack.encode(GetMeta(COMPAT, 0, "d", 3, META)),
         msgspec.msgpack.encode(MetaReply(COMPAT, 0, GROUPED)),
         msgspec.msgpack.encode(MetaReply(COMPAT, 0, META, None, META))]  # with P's host staging pool



def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """Usually a valid value, sometimes a hostile one: enough messages pass decoding to reach the checks after it."""
    return st.integers(0, 9).flatmap(lambda roll: bad if roll == 5 else good)  # not an end: hypothesis likes those


count = mostly(st.integers(1, 8), st.sampled_from([-1, 0, 2**20 + 1, 2**63 - 1]))
compat = st.builds(CompatInfo, model_id=mostly(st.just("m"), st.just("x" * 257)),
                   dtype=mostly(st.just("bfloat16"), st.just("f")), num_layers=mostly(st.just(4), count),
                   num_kv_heads=mostly(st.just(8), count), head_size=mostly(st.just(64), count),
                   block_size=mostly(st.sampled_from([8, 16, 32]), count),
                   kv_layout=mostly(st.sampled_from(["NHD", "HND"]), st.sampled_from(["nhd", ""])), tp_size=count,
                   wire_version=mostly(st.just(COMPAT.wire_version), st.integers(0, 3)))
addr = mostly(st.integers(0, 2**48), st.sampled_from([-1, 2**64 - 1]))
size = mostly(st.integers(1, 4096), st.sampled_from([-1, 0, 2**41]))
# region groups: (regions, blocks) pairs that usually cover the layout (two groups of 2 regions, 32 + 32 blocks
# when num_blocks is 64), sometimes not, sometimes with counts no layout has
group = st.tuples(mostly(st.integers(1, 4), st.sampled_from([0, -1, 2**40])),
                  mostly(st.sampled_from([1, 32, 63]), st.sampled_from([0, -1, 2**40])))
groups = st.sampled_from([[], [(2, 32), (2, 32)], [(4, 63), (0, 1)]]) | st.lists(group, max_size=3)
layout = st.builds(LayoutWire, mostly(st.sampled_from(["DRAM", "VRAM"]), st.just("HBM")), st.integers(-1, 8),
                   mostly(st.integers(1, 64), st.sampled_from([-1, 0, 2**33])), st.lists(addr, max_size=4),
                   st.lists(size, max_size=4), groups)
meta = st.builds(PeerMetadata, st.text(max_size=20), mostly(st.integers(0, 99), st.just(-1)),
                 st.sampled_from(["nixl", "x"]), st.binary(max_size=16), layout, addr, size)
rank = mostly(st.integers(0, 8), st.sampled_from([-1, 2**20 + 1]))
typed = (st.builds(MetaReply, compat, rank, meta, st.none() | meta, st.none() | meta)
         | st.builds(GetMeta, compat, rank, mostly(st.text(max_size=20), st.just("a" * 300)),
                     mostly(st.integers(0, 99), st.just(-1)), st.none() | meta, st.none() | meta)
         ).map(msgspec.msgpack.encode)
FIELDS = ["compat", "tp_rank", "meta", "fast_meta", "host_meta", "agent", "epoch"]


@FUZZ
@given(raw=st.one_of(typed, hostile(VALID, tagged(["MetaReply", "GetMeta"], FIELDS))))
def test_handshake_decoder_is_total(raw: bytes) -> None:
    try:
        msg = decode_handshake(raw)
    except MalformedHandshakeError:
        pass
    else:
        assert isinstance(msg, MetaReply | GetMeta)
        # both messages carry a fast path's metadata, optionally; P's reply its host staging pool's too
        for m in (msg.meta, msg.fast_meta, getattr(msg, "host_meta", None)):
            if m is not None:
                accepted = m.layout.to_layout()
                assert accepted.num_regions == len(m.layout.base_addrs)
                # the groups of an accepted layout cover it: every region has a group, every block a region
                assert len(accepted.region_blocks) == accepted.num_regions
                assert sum(g.num_blocks for g in accepted.region_groups) == accepted.num_blocks
        try:
            plan = negotiate(COMPAT, msg.compat, d_rank=0)
        except CompatMismatchError as exc:
            assert exc.fields  # a refusal always names what differs
        else:
            assert plan.parts >= 1 and plan.reads
    assert decode_handshake(VALID[0]) == LEGIT
