"""``SourceLedger.hold``: the prefix sharing both engines' P sides use (fresh blocks allocated, blocks another
request holds shared, a mix split under a companion request), and ``free_held`` freeing both."""

from __future__ import annotations

import numpy as np

from kvlifecycle.ledger import SourceLedger
from kvlifecycle.machines import SourceState
from kvlifecycle.source_ledger import HELD_SUFFIX


def _blocks(*ids: int) -> np.ndarray:
    return np.asarray(ids, dtype=np.int32)


def test_fresh_blocks_are_allocated_with_a_new_epoch() -> None:
    ledger = SourceLedger(8)
    ledger.hold("a", _blocks(0, 1))
    assert not ledger.requests["a"].shared and f"a{HELD_SUFFIX}" not in ledger.requests


def test_blocks_pinned_for_another_requests_lease_are_shared_not_reallocated() -> None:
    ledger = SourceLedger(8)
    ledger.hold("a", _blocks(0, 1))
    ledger.prefill_done("a")
    ledger.grant("a")
    epochs = ledger.epoch[[0, 1]].copy()
    ledger.hold("b", _blocks(0, 1, 2))  # a prefix hit on a's pinned blocks, and one fresh block
    ledger.prefill_done("b")
    assert ledger.requests["b"].shared and f"b{HELD_SUFFIX}" in ledger.requests
    assert (ledger.epoch[[0, 1]] == epochs).all()  # a's read still sees the blocks it was granted
    ledger.grant("b")
    released = [lease.transfer for lease in ledger.leases.values()]
    for transfer in released:
        ledger.cancel(ledger.leases[transfer].request)
    ledger.take_released()
    ledger.free_held("b", cache=True)
    ledger.free_held("a")
    assert "b" not in ledger.requests and f"b{HELD_SUFFIX}" not in ledger.requests
    assert int(ledger.block_states(_blocks(2))[0]) == int(SourceState.PREFIX_CACHED)
