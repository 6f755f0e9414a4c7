"""Bytes from the network before they are trusted: a bounded msgpack pre-scan and rate-limited drop logging.

msgspec decodes and *skips* msgpack values recursively and has no depth limit: a 20 KB value nested 20,000 levels
deep raises ``RecursionError`` (or, under a raised recursion limit, overflows the C stack). :func:`check_msgpack`
walks the structure first with an explicit stack, in one pass over the bytes, and refuses a value nested deeper
than ``max_depth``, truncated, with trailing bytes or using the one byte msgpack never assigns (``0xc1``). A first,
C-speed pass counts the bytes that could open a container: a message with no more of them than ``max_depth``
cannot be nested deeper, and most control messages end there.

:class:`RateLimitedLog` keeps hostile input from turning into a log flood: 10,000 junk frames give a handful of
lines and a count of the rest, never 10,000 lines.
"""

from __future__ import annotations

import logging
import re
import threading
import time

DEFAULT_MAX_DEPTH = 32  # the deepest legitimate message (a handshake's metadata) nests 4 levels

# fixmap, fixarray, array16/32, map16/32: the only bytes that can open a nesting level
_CONTAINER_BYTES = bytes(range(0x80, 0xA0)) + b"\xdc\xdd\xde\xdf"

# Per lead byte: >= 0 a scalar of that many bytes after the lead byte; the negative codes below otherwise.
_INVALID, _FIXMAP, _FIXARRAY, _FIXSTR, _LEN8, _LEN16, _LEN32, _EXT8, _EXT16, _EXT32, _ARR16, _ARR32, _MAP16, _MAP32 = (
    range(-1, -15, -1)
)


def _lead_table() -> tuple[int, ...]:
    table = [0] * 256  # positive and negative fixints, nil, booleans: the lead byte alone
    for b in range(0x80, 0x90):
        table[b] = _FIXMAP
    for b in range(0x90, 0xA0):
        table[b] = _FIXARRAY
    for b in range(0xA0, 0xC0):
        table[b] = _FIXSTR
    table[0xC1] = _INVALID
    table[0xC4], table[0xC5], table[0xC6] = _LEN8, _LEN16, _LEN32  # bin
    table[0xC7], table[0xC8], table[0xC9] = _EXT8, _EXT16, _EXT32
    table[0xCA], table[0xCB] = 4, 8  # float32 / float64
    table[0xCC], table[0xCD], table[0xCE], table[0xCF] = 1, 2, 4, 8  # uint
    table[0xD0], table[0xD1], table[0xD2], table[0xD3] = 1, 2, 4, 8  # int
    table[0xD4], table[0xD5], table[0xD6], table[0xD7], table[0xD8] = 2, 3, 5, 9, 17  # fixext: type byte + data
    table[0xD9], table[0xDA], table[0xDB] = _LEN8, _LEN16, _LEN32  # str
    table[0xDC], table[0xDD], table[0xDE], table[0xDF] = _ARR16, _ARR32, _MAP16, _MAP32
    return tuple(table)


_LEAD = _lead_table()


# One fixed-size scalar (fixints, nil, booleans, ints, floats): a run of N of them is matched in C, not walked item
# by item in Python. Block id lists are such runs, of mixed integer widths.
_SCALAR = (rb"(?:[\x00-\x7f\xc0\xc2\xc3\xe0-\xff]|[\xcc\xd0].|[\xcd\xd1].{2}|[\xce\xd2\xca].{4}"
           rb"|[\xcf\xd3\xcb].{8})")
_SCALAR_RUNS = tuple((n, re.compile(_SCALAR + b"{%d}" % n, re.DOTALL)) for n in (32, 4))
# the typed integers' lead bytes and sizes: a run of one of them has that byte every ``size`` bytes
_SAME_WIDTH = {lead: (bytes([lead]), size) for lead, size in ((0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9))}


class UntrustedInputError(ValueError):
    """Bytes that must not reach a decoder: too deep, truncated, trailing bytes, or not msgpack at all."""


def check_msgpack(raw: bytes, *, max_depth: int = DEFAULT_MAX_DEPTH) -> None:
    """Raise :class:`UntrustedInputError` unless ``raw`` holds exactly one msgpack value nested at most
    ``max_depth`` containers deep. Never recursive; linear in ``len(raw)``; any bytes in, no other exception out."""
    if not isinstance(raw, bytes):
        try:
            raw = bytes(raw)
        except Exception as exc:  # not bytes-like at all
            raise UntrustedInputError(f"not bytes: {type(raw).__name__}") from exc
    if len(raw) - len(raw.translate(None, _CONTAINER_BYTES)) <= max_depth:
        return  # cannot open more than max_depth levels; well-formedness is the decoder's to judge
    _scan(raw, max_depth)


def _skip_scalar_run(raw: bytes, pos: int, remaining: int) -> tuple[int, int]:
    """Past as many of the container's next ``remaining`` items as are fixed-size scalars (at least a few):
    (new position, items left). One integer width for a while is skipped by a strided slice and ``lstrip``, mixed
    widths by a regular expression that counts out a fixed number of scalars; both run in C."""
    end, window = len(raw), 64
    while remaining >= 4 and pos < end:
        same = _SAME_WIDTH.get(raw[pos])
        if same is not None and raw[pos + 8 * same[1] : pos + 8 * same[1] + 1] == same[0]:  # 9th ahead: same width
            leads, width = same
            take = min(remaining, window)
            heads = raw[pos : min(end, pos + take * width) : width]
            items = len(heads) - len(heads.lstrip(leads))
            if pos + items * width > end:  # the last one is cut short: the caller's step finds it
                items -= 1
            if items >= 4:
                pos, remaining = pos + items * width, remaining - items
                window = window * 4 if items == take else 64
                continue
        for n, run in _SCALAR_RUNS:
            if remaining >= n and (found := run.match(raw, pos)) is not None:
                pos, remaining = found.end(), remaining - n
                break
        else:
            break  # not a run of scalars here: the caller takes the next item step by step
    return pos, remaining


def _scan(raw: bytes, max_depth: int) -> None:
    end, pos = len(raw), 0
    open_levels: list[int] = []  # for each open container, the items still to come in the one around it
    remaining = 1  # the top level holds exactly one value
    lead = _LEAD
    while True:
        if remaining == 0:
            if not open_levels:
                break
            remaining = open_levels.pop()
            continue
        if pos >= end:
            raise UntrustedInputError(f"truncated msgpack at byte {pos}")
        kind = lead[raw[pos]]
        if kind >= 0:
            start = pos
            if remaining >= 4:  # e.g. a list of block ids: skip runs of scalars at C speed
                pos, remaining = _skip_scalar_run(raw, pos, remaining)
                if pos > start:
                    continue
            pos += 1 + kind
            remaining -= 1
            continue
        remaining -= 1
        if kind == _FIXSTR:
            pos += 1 + (raw[pos] & 0x1F)
            continue
        if kind in (_LEN8, _LEN16, _LEN32):
            width = 1 if kind == _LEN8 else 2 if kind == _LEN16 else 4
            pos += 1 + width + int.from_bytes(raw[pos + 1 : pos + 1 + width], "big")
            continue
        if kind in (_EXT8, _EXT16, _EXT32):
            width = 1 if kind == _EXT8 else 2 if kind == _EXT16 else 4
            pos += 2 + width + int.from_bytes(raw[pos + 1 : pos + 1 + width], "big")
            continue
        if kind == _INVALID:
            raise UntrustedInputError(f"byte 0x{raw[pos]:02x} at {pos} is not msgpack")
        if kind in (_FIXMAP, _FIXARRAY):
            count, pos = raw[pos] & 0x0F, pos + 1
        else:
            width = 2 if kind in (_ARR16, _MAP16) else 4
            count, pos = int.from_bytes(raw[pos + 1 : pos + 1 + width], "big"), pos + 1 + width
        if kind in (_FIXMAP, _MAP16, _MAP32):
            count *= 2
        if len(open_levels) + 1 > max_depth:
            raise UntrustedInputError(f"msgpack nested deeper than {max_depth} levels")
        if count > end - pos:  # every item takes at least one byte: a count beyond the bytes left is a lie
            raise UntrustedInputError(f"container of {count} items with {end - pos} bytes left")
        if count:
            open_levels.append(remaining)
            remaining = count
    if pos != end:
        raise UntrustedInputError(f"truncated msgpack ({pos} of {end} bytes)" if pos > end else
                                  f"{end - pos} trailing bytes after the msgpack value")


class RateLimitedLog:
    """At most ``burst`` lines per ``every_s`` seconds; what was held back is counted and said in the next line.

    Thread-safe; the clock is ``time.monotonic``."""

    def __init__(self, logger: logging.Logger, *, burst: int = 5, every_s: float = 10.0,
                 level: int = logging.WARNING) -> None:
        self.logger, self.burst, self.every_s, self.level = logger, int(burst), float(every_s), level
        self.suppressed = 0  # lines held back since the last line written
        self.total_suppressed = 0
        self._window_start = -float("inf")
        self._in_window = 0
        self._lock = threading.Lock()

    def __call__(self, fmt: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``fmt % args`` unless this window's burst is spent; returns whether a line was written."""
        now = time.monotonic()
        with self._lock:
            if now - self._window_start >= self.every_s:
                self._window_start, self._in_window = now, 0
            if self._in_window >= self.burst:
                self.suppressed += 1
                self.total_suppressed += 1
                return False
            self._in_window += 1
            held, self.suppressed = self.suppressed, 0
        if held:
            self.logger.log(self.level, fmt + " (%d similar line(s) suppressed)", *args, held, exc_info=exc_info)
        else:
            self.logger.log(self.level, fmt, *args, exc_info=exc_info)
        return True
