"""Which layers of which blocks of a layer-wise streaming load have landed, per part (P rank).

A streaming load's blocks fill layer by layer while P still computes: the target ledger records one
:class:`~kvlifecycle.events.TgtLayersLanded` per layer batch and keeps this matrix of ``parts × blocks × layers``
flags beside the load. A part completes only when every flag of its plane is set, so no block becomes
READY_FOR_ATTENTION with a layer missing; a flag set twice (a block sent twice) is refused before it is recorded.
The matrix is small: 8 layers × 250 blocks (4,000 tokens of 16) is 2,000 bytes per part.
"""

from __future__ import annotations

import numpy as np

MAX_LAYERS = 1 << 12  # more model layers than any model has: a bigger number is a caller's bug, not a model


class LayerProgress:
    """The landed flags of one streaming load. ``blocks``: the request's D block ids, in token order."""

    __slots__ = ("_order", "_sorted", "blocks", "landed", "layers", "remaining", "unchecked")

    def __init__(self, blocks: np.ndarray, parts: int, layers: int) -> None:
        self.blocks = blocks
        self.layers = layers
        self._order = np.argsort(blocks, kind="stable")
        self._sorted = blocks[self._order]
        self.landed = np.zeros((parts, blocks.size, layers), dtype=bool)
        self.remaining = np.full(parts, blocks.size * layers, dtype=np.int64)  # flags still unset, per part
        self.unchecked: set[int] = set()  # parts with a batch that landed without a digest check

    def positions(self, block_ids: np.ndarray) -> np.ndarray | None:
        """The positions of ``block_ids`` in the request's blocks; ``None`` if one is not the request's."""
        if not self._sorted.size:
            return None
        at = np.minimum(np.searchsorted(self._sorted, block_ids), self._sorted.size - 1)
        if not np.array_equal(self._sorted[at], block_ids):
            return None
        found: np.ndarray = self._order[at]
        return found

    def problem(self, part: int, first_layer: int, num_layers: int, block_ids: np.ndarray) -> str:
        """Why this batch cannot land (``""``: it can): out of range, not the request's, or landed already."""
        if not 0 <= part < self.landed.shape[0]:
            return f"part {part} not in [0, {self.landed.shape[0]})"
        if num_layers < 1 or first_layer < 0 or first_layer + num_layers > self.layers:
            return f"layers [{first_layer}, {first_layer + num_layers}) not within [0, {self.layers})"
        if not block_ids.size:
            return "no blocks in the batch"
        if np.unique(block_ids).size != block_ids.size:
            return "a block is listed twice in one batch"
        where = self.positions(block_ids)
        if where is None:
            return "a block that is not the request's"
        again = self.landed[part, where, first_layer:first_layer + num_layers]
        if again.any():
            row, col = np.argwhere(again)[0]
            return f"duplicate: layer {first_layer + int(col)} of block {int(block_ids[row])} landed already"
        return ""

    def land(self, part: int, first_layer: int, num_layers: int, block_ids: np.ndarray) -> bool:
        """Set the batch's flags (checked by :meth:`problem` first, or read from a log); True if ``part`` is now
        complete. Raises ``KeyError`` for a block that is not the request's (a log that cannot be folded)."""
        where = self.positions(block_ids)
        if where is None:
            raise KeyError("a landed block that is not the request's")
        plane = self.landed[part, where, first_layer:first_layer + num_layers]
        self.remaining[part] -= plane.size - int(plane.sum())
        self.landed[part, where, first_layer:first_layer + num_layers] = True
        return bool(self.remaining[part] == 0)

    def complete(self, part: int) -> bool:
        return bool(self.remaining[part] == 0)

    def landed_layers(self, part: int) -> int:
        """How many layers have landed for every block of ``part`` (the streamed prefix a reader could use)."""
        full = self.landed[part].all(axis=0)
        return int(full.size if full.all() else np.argmin(full))
