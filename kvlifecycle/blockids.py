"""Block ids as a caller gives them, checked before anything narrows them to the ledger's int32.

Why before: ``np.asarray(ids, dtype="<i4")`` first would turn an int64 ``2**32 + 10`` into block 10 and a float 13.9
into block 13, so a check after the conversion passes ids the caller never named. Here the dtype must be an integer
one (floats, bools, strings and objects are refused), the range is checked on the original values, and only then
are the ids narrowed. Every check is one numpy operation over the whole array, not a Python loop per id: the
commands that call this sit on the engine's scheduling path.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvlifecycle.events import BLOCK_DTYPE

MAX_BLOCKS = int(np.iinfo(BLOCK_DTYPE).max)  # a pool larger than this has ids the logged int32 cannot hold
_INTEGER_KINDS = ("i", "u")
# a signed id dtype -> the unsigned one of its width (built once: constructing a dtype costs more than the check)
_UNSIGNED = {np.dtype(f"{order}i{w}"): np.dtype(f"{order}u{w}") for order in "<>" for w in (1, 2, 4, 8)}
_EMPTY = np.empty(0, dtype=BLOCK_DTYPE)


class DuplicateScratch:
    """Scratch arrays for the duplicate check: O(n) in the ids, not O(n log n) as ``np.unique`` is.

    Each id's slot is written with its position; an id given twice reads back a later position at its first place.
    Memory is touched only where ids land (``np.zeros`` maps pages lazily) and positions grow with the longest list
    seen, so a pool of millions of blocks costs what its requests use. Callers serialise use (the ledger's lock)."""

    __slots__ = ("num_blocks", "positions", "slots")

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.slots = np.zeros(num_blocks, dtype=np.int32)
        self.positions = np.arange(0, dtype=np.int32)

    def first_duplicate(self, ids: np.ndarray) -> int:
        """A block id that occurs more than once in ``ids`` (all in range), or -1."""
        n = ids.size
        if n > self.num_blocks:  # more ids than blocks: some id repeats
            return int(np.argmax(np.bincount(ids)))  # the id given most often
        if n > self.positions.size:
            self.positions = np.arange(min(self.num_blocks, max(n, 2 * self.positions.size, 64)), dtype=np.int32)
        expected = self.positions[:n]
        self.slots.put(ids, expected)
        back = self.slots.take(ids)
        if back.tobytes() == expected.tobytes():  # the cheapest equality numpy offers for a few ids
            return -1
        return int(ids[int(np.argmax(back != expected))])


def parse_block_ids(
    block_ids: Any, num_blocks: int, scratch: DuplicateScratch | None = None, *, allow_empty: bool = False
) -> tuple[np.ndarray, str]:
    """``(ids, "")`` with ``ids`` as int32, or ``(empty, reason)`` naming the first problem found. A reason reads
    ``category: detail`` (the ledger counts refusals by category).

    ``scratch``: check for duplicates too (a command that gives a block to a request once per id). An empty list is
    a problem unless ``allow_empty``.
    """
    if isinstance(block_ids, np.ndarray):
        raw = block_ids
    else:
        try:
            raw = np.asarray(block_ids)
        except (TypeError, ValueError, OverflowError) as exc:
            return _EMPTY, f"block ids not integers: {type(exc).__name__} {exc}"
    if raw.ndim != 1:
        return _EMPTY, f"block ids not a 1-D sequence: {raw.ndim}-D"
    if raw.size == 0:
        return (_EMPTY, "") if allow_empty else (_EMPTY, "no block ids")
    if raw.dtype.kind not in _INTEGER_KINDS:
        return _EMPTY, f"block ids not integers: dtype {raw.dtype}"
    # one reduction checks both ends: a negative id read as unsigned of the same width is larger than any pool
    unsigned = raw.view(_UNSIGNED[raw.dtype]) if raw.dtype.kind == "i" else raw
    if int(unsigned.max()) >= num_blocks:
        bad = raw[int(np.argmax(unsigned >= num_blocks))]
        return _EMPTY, f"block ids out of range: {int(bad)} not in [0, {num_blocks})"
    ids = raw if raw.dtype == BLOCK_DTYPE else raw.astype(BLOCK_DTYPE)  # in range: narrowing loses nothing
    if scratch is not None and ids.size > 1:
        duplicate = scratch.first_duplicate(ids)
        if duplicate >= 0:
            return _EMPTY, f"block ids repeat: {duplicate} given more than once"
    return ids, ""
