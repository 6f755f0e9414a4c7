"""Hypothesis strategies for hostile msgpack: structured values (nested lists and maps, ext, bin, the integer
extremes), values nested far deeper than any decoder should follow, raw bytes, and mutations of valid frames."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from hypothesis import settings
from hypothesis import strategies as st

# Bounded per run, random across runs; a failure prints the reproduce blob (print_blob) to pin it down.
FUZZ = settings(max_examples=200, deadline=None, derandomize=False, print_blob=True)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.sampled_from([0, -1, 2**31, 2**32 + 10, 2**63 - 1, 2**63, 2**64 - 1, -(2**63)])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.binary(max_size=64)
    | st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=32))
)

values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=6) | st.dictionaries(st.text(max_size=12) | st.integers(-3, 3), kids,
                                                             max_size=6),
    max_leaves=40,
)

# [[[...]]], {k: {k: ...}}, array16-framed: beyond every depth cap, up to 30,000 levels
deep = st.builds(
    lambda levels, lead: lead * levels + b"\xc0",
    st.integers(min_value=30, max_value=30_000),
    st.sampled_from([b"\x91", b"\x81\xa1k", b"\xdc\x00\x01", b"\x92\x01"]),
)


def tagged(kinds: Sequence[str], fields: Sequence[str], known: Sequence[object] = ()) -> st.SearchStrategy[bytes]:
    """Maps shaped like the tagged messages (a ``type`` tag and familiar field names) with hostile values."""
    field_values = values | st.sampled_from(list(known)) if known else values
    return st.builds(
        lambda kind, body: msgspec.msgpack.encode({"type": kind, **body}),
        st.sampled_from([*kinds, "Nope", ""]),
        st.dictionaries(st.sampled_from(list(fields)), field_values, max_size=len(fields)),
    )


@st.composite
def mutated(draw: st.DrawFn, valid: Sequence[bytes]) -> bytes:
    """A valid frame with a few bytes flipped, cut, inserted, repeated or overwritten."""
    raw = bytearray(draw(st.sampled_from(list(valid))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "repeat", "overwrite"]))
        at = draw(st.integers(0, max(len(raw) - 1, 0)))
        if op == "flip" and raw:
            raw[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del raw[at:]
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "repeat":
            raw[at:at] = raw[at : at + draw(st.integers(1, 32))] * draw(st.integers(1, 50))
        elif raw:
            raw[at] = draw(st.integers(0, 255))
    return bytes(raw)


def hostile(valid: Sequence[bytes], structured: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Everything at once: raw bytes, msgpack values, deep values, message-shaped values, mutated frames."""
    return (
        st.binary(max_size=512)
        | values.map(msgspec.msgpack.encode)
        | deep
        | structured
        | mutated(valid)
    )
