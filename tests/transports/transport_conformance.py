"""The conformance suite every transport must pass (in the spirit of eventsourcing's recorder test cases).

Subclass :class:`TransportConformance`, implement ``make_transport(name)``, and name the subclass ``Test...``.
Every wait is bounded; nothing asserts on time.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from kvlifecycle.transport import (
    BlockView,
    HandleReleasedError,
    KVLayout,
    MemoryKind,
    Notification,
    PeerEpochError,
    RemoteMismatchError,
    TransportError,
    XferStatus,
)

REGIONS, BLOCKS, BLOCK_BYTES = 4, 32, 256
WAIT_S = 30.0


def same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """``torch.equal`` across devices: the endpoints' regions may sit on two GPUs (or in DRAM)."""
    return torch.equal(x, y.to(x.device))


def wait_status(transport: Any, handle: Any, timeout_s: float = WAIT_S) -> XferStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = transport.poll(handle)
        if status is not XferStatus.PENDING:
            return status
        time.sleep(0.0005)
    raise AssertionError(f"transfer still pending after {timeout_s}s")


def wait_notes(transport: Any, count: int, timeout_s: float = WAIT_S) -> list[tuple[str, Notification]]:
    got: list[tuple[str, Notification]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += transport.notifications()
        if len(got) < count:
            time.sleep(0.0005)
    return got


def kv_tensors(fill: str, seed: int = 0, regions: int = REGIONS, blocks: int = BLOCKS,
               block_bytes: int = BLOCK_BYTES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    if fill == "random":
        return [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, generator=gen) for _ in range(regions)]
    return [torch.zeros((blocks, block_bytes), dtype=torch.uint8) for _ in range(regions)]


def layout_of(tensors: list[torch.Tensor]) -> KVLayout:
    blocks, block_bytes = tensors[0].shape
    return KVLayout(MemoryKind.DRAM, 0, blocks, tuple(t.data_ptr() for t in tensors),
                    tuple(block_bytes for _ in tensors))


class TransportConformance:
    """Base class: a pair of endpoints ``a`` (random bytes) and ``b`` (zeros) that know each other."""

    def make_transport(self, name: str) -> Any:
        raise NotImplementedError

    @pytest.fixture
    def pair(self, request: pytest.FixtureRequest) -> Any:
        suffix = f"{request.node.name}-{time.monotonic_ns()}"
        a, b = self.make_transport(f"a-{suffix}"), self.make_transport(f"b-{suffix}")
        ta, tb = kv_tensors("random", 1), kv_tensors("zeros")
        a.register(layout_of(ta))
        b.register(layout_of(tb))
        b_sees_a = b.add_peer(a.local_metadata())
        a_sees_b = a.add_peer(b.local_metadata())
        yield a, b, ta, tb, a_sees_b, b_sees_a
        for t in (a, b):
            t.close()

    # -- byte-exact moves -------------------------------------------------------------------------------------------
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_read_random_subset_byte_exact(self, pair: Any, seed: int) -> None:
        _a, b, ta, tb, _, b_sees_a = pair
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, BLOCKS))
        remote = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        local = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        plan = b.prepare(b_sees_a)
        h = b.post("READ", plan, local, remote, transfer=f"r{seed}")
        assert wait_status(b, h) is XferStatus.DONE, b.error(h)
        for r in range(REGIONS):
            assert same_bytes(tb[r][torch.from_numpy(local).long()], ta[r][torch.from_numpy(remote).long()])
            untouched = np.setdiff1d(np.arange(BLOCKS), local)
            assert int(tb[r][torch.from_numpy(untouched).long()].sum()) == 0
        stats = b.stats(h)
        assert stats is not None and stats.bytes == n * REGIONS * BLOCK_BYTES
        b.release(h)

    @pytest.mark.parametrize("seed", [3, 4])
    def test_write_random_subset_byte_exact(self, pair: Any, seed: int) -> None:
        a, _b, ta, tb, a_sees_b, _ = pair
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, BLOCKS))
        local = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        remote = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        plan = a.prepare(a_sees_b)
        h = a.post("WRITE", plan, local, remote)
        assert wait_status(a, h) is XferStatus.DONE, a.error(h)
        for r in range(REGIONS):
            assert same_bytes(tb[r][torch.from_numpy(remote).long()], ta[r][torch.from_numpy(local).long()])
        a.release(h)

    def test_region_subset_moves_only_those_regions(self, pair: Any) -> None:
        _a, b, ta, tb, _, b_sees_a = pair
        ids = np.array([0, 5, 31], dtype=np.int32)
        h = b.post("READ", b.prepare(b_sees_a), ids, ids, regions=[1, 3])
        assert wait_status(b, h) is XferStatus.DONE
        idx = torch.from_numpy(ids).long()
        assert same_bytes(tb[1][idx], ta[1][idx]) and same_bytes(tb[3][idx], ta[3][idx])
        assert int(tb[0].sum()) == 0 and int(tb[2].sum()) == 0
        b.release(h)

    def test_sliced_view_reads_one_rank_of_heads(self, pair: Any) -> None:
        """Heterogeneous TP: read the second half of each remote block into the first half of local blocks."""
        _a, b, ta, tb, _, b_sees_a = pair
        half = BLOCK_BYTES // 2
        plan = b.prepare(b_sees_a, local_view=BlockView(0, half), remote_view=BlockView(half, half))
        ids = np.array([2, 7], dtype=np.int32)
        h = b.post("READ", plan, ids, ids[::-1].copy())
        assert wait_status(b, h) is XferStatus.DONE
        for r in range(REGIONS):
            assert same_bytes(tb[r][2, :half], ta[r][7, half:]) and same_bytes(tb[r][7, :half], ta[r][2, half:])
            assert int(tb[r][:, half:].sum()) == 0

    # -- notifications ----------------------------------------------------------------------------------------------
    def test_notification_rides_with_the_transfer(self, pair: Any) -> None:
        a, b, _, _, _, b_sees_a = pair
        note = Notification("req-1", "xfer-1", 7, epoch=b.epoch, kind="done", part=1)
        h = b.post("READ", b.prepare(b_sees_a), [1], [1], notification=note)
        assert wait_status(b, h) is XferStatus.DONE
        got = wait_notes(a, 1)
        assert got == [(b.agent, note)]

    def test_standalone_notification(self, pair: Any) -> None:
        a, b, _, _, a_sees_b, _ = pair
        note = Notification("req-2", "xfer-2", 3, kind="failed", payload=b"why")
        a.send_notification(a_sees_b, note)
        assert wait_notes(b, 1) == [(a.agent, note)]

    # -- errors -----------------------------------------------------------------------------------------------------
    def test_released_handle_raises(self, pair: Any) -> None:
        _, b, _, _, _, b_sees_a = pair
        h = b.post("READ", b.prepare(b_sees_a), [0], [0])
        wait_status(b, h)
        b.release(h)
        with pytest.raises(HandleReleasedError):
            b.poll(h)
        with pytest.raises(HandleReleasedError):
            b.stats(h)
        with pytest.raises(HandleReleasedError):
            b.release(h)

    def test_mismatched_block_lists_refused(self, pair: Any) -> None:
        _, b, _, _, _, b_sees_a = pair
        plan = b.prepare(b_sees_a)
        with pytest.raises(RemoteMismatchError):
            b.post("READ", plan, [0, 1], [0])
        with pytest.raises(RemoteMismatchError):
            b.post("READ", plan, [BLOCKS], [0])
        with pytest.raises(RemoteMismatchError):
            b.prepare(b_sees_a, remote_view=BlockView(0, BLOCK_BYTES // 2))

    def test_removed_peer_voids_its_plans(self, pair: Any) -> None:
        a, b, _, _, _, b_sees_a = pair
        plan = b.prepare(b_sees_a)
        b.remove_peer(b_sees_a)
        with pytest.raises(PeerEpochError):
            b.post("READ", plan, [0], [0])
        # and the peer can be added back and used again
        peer = b.add_peer(a.local_metadata())
        h = b.post("READ", b.prepare(peer), [0], [0])
        assert wait_status(b, h) is XferStatus.DONE

    def test_peer_with_a_new_epoch_replaces_the_old_one(self, pair: Any) -> None:
        """A restarted peer (same agent name, newer epoch): old plans are void, the agent is re-added, and older
        metadata is refused (vLLM #49238: remove the remote agent before loading its new metadata)."""
        a, b, ta, tb, _, b_sees_a = pair
        old_plan = b.prepare(b_sees_a)
        meta = a.local_metadata()
        assert b.add_peer(msgspec.structs.replace(meta, epoch=meta.epoch + 1)) == b_sees_a
        with pytest.raises(PeerEpochError):
            b.post("READ", old_plan, [0], [0])
        with pytest.raises(PeerEpochError):
            b.add_peer(meta)  # the old epoch is stale now
        h = b.post("READ", b.prepare(b_sees_a), [5], [6])
        assert wait_status(b, h) is XferStatus.DONE
        assert all(same_bytes(tb[r][5], ta[r][6]) for r in range(REGIONS))

    # -- teardown ---------------------------------------------------------------------------------------------------
    def test_clean_teardown_leaves_nothing_registered(self) -> None:
        t = self.make_transport(f"solo-{time.monotonic_ns()}")
        tensors = kv_tensors("zeros")
        t.register(layout_of(tensors))
        assert t.registered_regions() == REGIONS
        t.close()
        assert t.registered_regions() == 0
        t.close()  # idempotent
        with pytest.raises(TransportError):
            t.post("READ", None, [0], [0])  # type: ignore[arg-type]
