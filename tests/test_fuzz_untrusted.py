"""The msgpack pre-scan agrees with the decoder on structure and measures depth exactly, for any bytes."""

from __future__ import annotations

import logging

import msgspec
import pytest
from fuzz_msgpack import FUZZ, deep, mutated, values
from hypothesis import given
from hypothesis import strategies as st

from kvlifecycle.untrusted import RateLimitedLog, UntrustedInputError, _scan, check_msgpack


def depth(value: object) -> int:
    if isinstance(value, list | tuple):
        return 1 + max((depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((max(depth(k), depth(v)) for k, v in value.items()), default=0)
    return 0


int_lists = st.lists(st.integers(-(2**63), 2**64 - 1) | st.integers(0, 70_000) | st.none() | st.booleans()
                     | st.floats(allow_nan=False), max_size=300)
structured = values | int_lists | st.lists(int_lists | values, max_size=4)


@FUZZ
@given(value=structured)
def test_depth_is_measured_exactly(value: object) -> None:
    raw = msgspec.msgpack.encode(value)
    d = depth(value)
    check_msgpack(raw, max_depth=d)
    _scan(raw, d)  # the exact walk, not only the fast bound
    if d:
        with pytest.raises(UntrustedInputError):
            _scan(raw, d - 1)


@FUZZ
@given(raw=st.binary(max_size=300) | deep | mutated([msgspec.msgpack.encode(v) for v in
                                                     ([1, 2, [3, {"a": b"x"}]], list(range(250, 400)),
                                                      {"type": "T", "ids": [70_000, 1, 300, -5, 2.5]})]))
def test_any_bytes_scan_or_refuse_and_agree_with_the_decoder(raw: bytes) -> None:
    try:
        _scan(raw, 1_000_000)
        scanned = True
    except UntrustedInputError:
        scanned = False
    try:
        msgspec.msgpack.decode(raw)
        decoded = True
    except (msgspec.DecodeError, RecursionError):
        decoded = False
    except Exception:  # well framed but not representable (an unhashable key, an invalid timestamp ext)
        decoded = None
    if decoded:
        assert scanned  # whatever the decoder takes as one whole value, the scan takes too
    if not scanned:
        with pytest.raises((msgspec.DecodeError, RecursionError)):
            msgspec.msgpack.decode(raw)
    if scanned:  # well formed: the capped check refuses it exactly when it is too deep
        try:
            check_msgpack(raw, max_depth=8)
            passed = True
        except UntrustedInputError:
            passed = False
        assert passed != too_deep(raw, 8)


def too_deep(raw: bytes, limit: int) -> bool:
    try:
        _scan(raw, limit)
    except UntrustedInputError as exc:
        return "deeper" in str(exc)
    return False


def test_rate_limited_log_holds_back_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    limited = RateLimitedLog(logging.getLogger("kvlifecycle.test"), burst=3, every_s=3600)
    with caplog.at_level(logging.WARNING, logger="kvlifecycle.test"):
        written = sum(limited("junk %d", i) for i in range(10_000))
    assert written == 3 and len(caplog.records) == 3 and limited.suppressed == 9_997
