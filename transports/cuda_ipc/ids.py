"""Block ids on their way to the kernel: checked as integer vectors within range, joined for a batch, and staged in
a pinned host + device ring (one async copy per post, no allocation on the hot path)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from kvlifecycle.transport import PreparedPlan, RemoteMismatchError

from .driver import CudaDriver

ID_RING_INTS = 1 << 18  # 1 MiB of staged block ids: hundreds of requests in flight

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def block_ids(ids: Any, limit: int, what: str) -> np.ndarray:
    """Block ids as a 1-D integer array within [0, limit) (no copy when they already are).

    One reduction checks both ends: viewed as unsigned, a negative id is larger than any limit (the hot path of
    ``post``; min() + max() cost two passes and two Python round trips)."""
    arr = ids if type(ids) is np.ndarray else np.asarray(ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise RemoteMismatchError(f"{what} block ids must be a 1-D integer array")
    if arr.size:
        unsigned = arr.view(_UNSIGNED[arr.dtype.itemsize]) if arr.dtype.kind == "i" else arr
        if int(unsigned.max()) >= limit:
            raise RemoteMismatchError(f"{what} block ids must be in [0, {limit}), got [{arr.min()}, {arr.max()}]")
    return arr


def joined_ids(parts: list[np.ndarray]) -> np.ndarray:
    """The id vectors of a batch as one (int64 when several: an int and a uint vector would join as float)."""
    if len(parts) == 1:
        return parts[0]
    if not parts:
        return np.empty(0, dtype=np.int64)
    # unsafe: a uint64 id above 2**63 turns negative, which the range check (viewed as unsigned) refuses too
    return np.concatenate(parts, dtype=np.int64, casting="unsafe")


def refuse_batch(requests: Sequence[tuple[Any, Any, Any, Any]], plan: PreparedPlan) -> NoReturn:
    """Raise the precise error of the first bad request of a refused ``post_batch``."""
    for i, (local_blocks, remote_blocks, _, _) in enumerate(requests):
        local = block_ids(local_blocks, plan.local_blocks, f"request {i}: local")
        remote = block_ids(remote_blocks, plan.remote_blocks, f"request {i}: remote")
        if local.size != remote.size:
            raise RemoteMismatchError(f"request {i}: {local.size} local blocks vs {remote.size} remote blocks")
    raise RemoteMismatchError("batch refused, yet every request checks out on its own")  # not expected


class IdRing:
    """Pinned host + device staging for block ids: one async copy per post, no allocation on the hot path.

    A slot is reused only after the transfer that used it completed (its copy of the ids ran before its kernel).
    """

    def __init__(self, torch: Any, device: Any, capacity: int, driver: CudaDriver) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=True)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(capacity, dtype=torch.int32, device=device)
        self.host_ptr, self.dev_ptr = self.host.data_ptr(), self.dev.data_ptr()
        # Pinned memory is mapped into the device's address space (UVA): the kernel can read the ids in place.
        self.host_dev_ptr = driver.device_pointer(self.host_ptr)
        self.head = 0
        self.busy: dict[int, int] = {}  # start -> end of slots whose transfer has not completed

    def reserve(self, count: int) -> int | None:
        if count > self.capacity:
            return None
        start = self.head if self.head + count <= self.capacity else 0
        end = start + count
        if self.busy and any(s < end and start < e for s, e in self.busy.items()):
            return None  # still in use: the caller stages this post on its own
        self.busy[start] = end
        self.head = end
        return start

    def free(self, start: int) -> None:
        self.busy.pop(start, None)

