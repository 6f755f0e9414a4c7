"""Which of P's blocks fill which of D's: the pairing both sides compute from a grant and D's reservation, with
block-size changes and a D that already holds a prefix."""

from __future__ import annotations

import numpy as np

__all__ = ["BlockMappingError", "map_blocks"]


class BlockMappingError(ValueError):
    """D's blocks cannot all be filled from the grant: some would be marked ready without their bytes."""


def map_blocks(target: np.ndarray, source: np.ndarray, target_split: int = 1,
               source_split: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Pair D's (target) blocks with P's (source) blocks, unit for unit: with a block-size change the bigger side's
    blocks are cut into sub-blocks in token order; when P granted more than D reserved (D already holds a prefix),
    D's blocks take P's **tail**. Refuses (:class:`BlockMappingError`) when a D block would receive nothing: it
    would become READY_FOR_ATTENTION without its bytes."""
    blocks = target.size
    if target_split > 1:  # D blocks are bigger: D sub-blocks in token order, one per P block
        target = (target[:, None] * target_split + np.arange(target_split)[None, :]).reshape(-1)[: source.size]
    if source_split > 1:  # P blocks are bigger: P sub-blocks in token order, one per D block
        source = (source[:, None] * source_split + np.arange(source_split)[None, :]).reshape(-1)[: target.size]
    n = min(target.size, source.size)
    if blocks and n < (blocks - 1) * target_split + 1:
        raise BlockMappingError(f"{blocks} target blocks but the grant fills only {n} unit(s) of "
                                f"{target_split} per block: the rest would be marked ready without bytes")
    return target[:n], source[-n:] if source.size > n else source
