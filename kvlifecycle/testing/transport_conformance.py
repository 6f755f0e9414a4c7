"""The conformance suite every transport must pass (as eventsourcing ships its recorder test cases).

Subclass :class:`TransportConformance`, implement :meth:`~TransportConformance.make_transport`, and name the
subclass ``Test...``; pytest runs every test of the suite against it::

    from kvlifecycle.testing.transport_conformance import TransportConformance

    class TestMyTransport(TransportConformance):
        def make_transport(self, name):
            return MyTransport(name)

The KV regions are host memory (numpy, :class:`HostBuffers`) unless the subclass overrides
:meth:`~TransportConformance.make_buffers` (VRAM through torch, say): importing the suite imports no torch. Every
wait is bounded; nothing asserts on time.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Iterator, Sequence
from typing import Literal, Protocol

import msgspec
import numpy as np
import pytest

from kvlifecycle.transport import (
    BlockView,
    DeviceOrderedPost,
    HandleReleasedError,
    KVLayout,
    MemoryKind,
    Notification,
    PeerEpochError,
    RemoteMismatchError,
    TransferHandle,
    Transport,
    TransportError,
    XferStatus,
    orders_on_device,
)

REGIONS, BLOCKS, BLOCK_BYTES = 4, 32, 256
WAIT_S = 30.0

Fill = Literal["random", "zeros"]


def wait_status(transport: Transport, handle: TransferHandle, timeout_s: float = WAIT_S) -> XferStatus:
    """Poll ``handle`` until it leaves PENDING (bounded: raises after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = transport.poll(handle)
        if status is not XferStatus.PENDING:
            return status
        time.sleep(0.0005)
    raise AssertionError(f"transfer still pending after {timeout_s}s")


def wait_notes(transport: Transport, count: int, timeout_s: float = WAIT_S) -> list[tuple[str, Notification]]:
    """Drain notifications until ``count`` arrived or ``timeout_s`` passed; returns what arrived."""
    got: list[tuple[str, Notification]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += transport.notifications()
        if len(got) < count:
            time.sleep(0.0005)
    return got


class KVBuffers(Protocol):
    """An endpoint's KV regions: ``layout`` describes them, :meth:`blocks` reads them back."""

    layout: KVLayout

    def blocks(self, region: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """A host copy of blocks ``ids`` of ``region``, as uint8 ``[len(ids), block_bytes]``."""
        ...


class HostBuffers:
    """KV regions in host memory (DRAM), numpy arrays of ``blocks`` x ``block_bytes``: random bytes from ``seed``,
    or zeros."""

    def __init__(self, fill: Fill, seed: int = 0, regions: int = REGIONS, blocks: int = BLOCKS,
                 block_bytes: int = BLOCK_BYTES) -> None:
        rng = np.random.default_rng(seed)
        shape = (blocks, block_bytes)
        self.arrays: list[np.ndarray] = [
            rng.integers(0, 256, shape, dtype=np.uint8) if fill == "random" else np.zeros(shape, np.uint8)
            for _ in range(regions)
        ]
        self.layout = KVLayout(MemoryKind.DRAM, 0, blocks, tuple(a.ctypes.data for a in self.arrays),
                               tuple(block_bytes for _ in self.arrays), owner=self.arrays)

    def blocks(self, region: int, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        copied: np.ndarray = self.arrays[region][np.asarray(ids, dtype=np.int64)].copy()
        return copied


# what the ``pair`` fixture yields: a, b, a's buffers, b's buffers, a's name for b, b's name for a
Pair = tuple[Transport, Transport, KVBuffers, KVBuffers, str, str]


class TransportConformance(abc.ABC):
    """Base class: a pair of endpoints ``a`` (random bytes) and ``b`` (zeros) that know each other.

    The ``pair`` fixture yields ``(a, b, buffers of a, buffers of b, a's name for b, b's name for a)``."""

    @abc.abstractmethod
    def make_transport(self, name: str) -> Transport:
        """A fresh, unregistered endpoint named ``name`` (names are unique per test)."""

    def make_buffers(self, fill: Fill, seed: int = 0, endpoint: int = 0) -> KVBuffers:
        """The KV regions of endpoint ``endpoint`` (0: ``a``, 1: ``b``), :data:`REGIONS` x :data:`BLOCKS` blocks
        of :data:`BLOCK_BYTES`. Host memory unless overridden."""
        return HostBuffers(fill, seed)

    def register(self, transport: Transport, buffers: KVBuffers) -> None:
        """Register ``buffers`` with ``transport`` (override where a transport needs more than the layout)."""
        transport.register(buffers.layout)

    def device_event(self, buffers: KVBuffers) -> object:
        """For a transport that orders on the device (:class:`~kvlifecycle.transport.DeviceOrderedPost`): an event
        of the kind its ``post_after`` takes, after every write to ``buffers`` enqueued so far (a CUDA event on the
        current stream, say). Override it there; other transports never reach it."""
        raise NotImplementedError(f"{type(self).__name__}: the transport orders on the device; "
                                  "override device_event")

    @pytest.fixture
    def pair(self, request: pytest.FixtureRequest) -> Iterator[Pair]:
        suffix = f"{request.node.name}-{time.monotonic_ns()}"
        a, b = self.make_transport(f"a-{suffix}"), self.make_transport(f"b-{suffix}")
        try:
            ta, tb = self.make_buffers("random", 1, 0), self.make_buffers("zeros", 0, 1)
            self.register(a, ta)
            self.register(b, tb)
            b_sees_a = b.add_peer(a.local_metadata())
            a_sees_b = a.add_peer(b.local_metadata())
            yield a, b, ta, tb, a_sees_b, b_sees_a
        finally:
            for t in (a, b):
                t.close()

    # -- byte-exact moves -------------------------------------------------------------------------------------------
    @pytest.mark.parametrize("seed", [0, 1, 2])
    def test_read_random_subset_byte_exact(self, pair: Pair, seed: int) -> None:
        _a, b, ta, tb, _, b_sees_a = pair
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, BLOCKS))
        remote = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        local = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        plan = b.prepare(b_sees_a)
        h = b.post("READ", plan, local, remote, transfer=f"r{seed}")
        assert wait_status(b, h) is XferStatus.DONE, b.error(h)
        untouched = np.setdiff1d(np.arange(BLOCKS), local)
        for r in range(REGIONS):
            assert np.array_equal(tb.blocks(r, local), ta.blocks(r, remote))
            assert int(tb.blocks(r, untouched).sum()) == 0
        stats = b.stats(h)
        assert stats is not None and stats.bytes == n * REGIONS * BLOCK_BYTES
        b.release(h)

    @pytest.mark.parametrize("seed", [3, 4])
    def test_write_random_subset_byte_exact(self, pair: Pair, seed: int) -> None:
        a, _b, ta, tb, a_sees_b, _ = pair
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, BLOCKS))
        local = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        remote = rng.choice(BLOCKS, n, replace=False).astype(np.int32)
        plan = a.prepare(a_sees_b)
        h = a.post("WRITE", plan, local, remote)
        assert wait_status(a, h) is XferStatus.DONE, a.error(h)
        for r in range(REGIONS):
            assert np.array_equal(tb.blocks(r, remote), ta.blocks(r, local))
        a.release(h)

    def test_post_after_a_device_event_is_byte_exact_and_notifies(self, pair: Pair) -> None:
        a, b, ta, tb, a_sees_b, _ = pair
        if not isinstance(a, DeviceOrderedPost):  # its callers wait on the host before posting: it must say so
            assert not orders_on_device(a) and not orders_on_device(b)
            return
        local, remote = np.array([4, 9, 30], dtype=np.int32), np.array([1, 22, 13], dtype=np.int32)
        plan = a.prepare(a_sees_b)
        note = Notification("req-after", "xfer-after", 1, epoch=a.epoch, kind="done")
        h = a.post_after(self.device_event(ta), "WRITE", plan, local, remote, regions=[0, 2], notification=note)
        assert wait_status(a, h) is XferStatus.DONE, a.error(h)
        for r in range(REGIONS):
            expected = ta.blocks(r, local) if r in (0, 2) else np.zeros_like(ta.blocks(r, local))
            assert np.array_equal(tb.blocks(r, remote), expected)
        assert wait_notes(b, 1) == [(a.agent, note)]
        a.release(h)

    def test_post_after_something_it_cannot_order_after_is_refused(self, pair: Pair) -> None:
        a, _b, _, _, a_sees_b, _ = pair
        if not isinstance(a, DeviceOrderedPost):  # nothing to refuse: the post it has orders after nothing
            assert not hasattr(a, "post_after")
            return
        with pytest.raises(TransportError):
            a.post_after(object(), "WRITE", a.prepare(a_sees_b), [0], [0])

    def test_region_subset_moves_only_those_regions(self, pair: Pair) -> None:
        _a, b, ta, tb, _, b_sees_a = pair
        ids = np.array([0, 5, 31], dtype=np.int32)
        h = b.post("READ", b.prepare(b_sees_a), ids, ids, regions=[1, 3])
        assert wait_status(b, h) is XferStatus.DONE
        assert np.array_equal(tb.blocks(1, ids), ta.blocks(1, ids))
        assert np.array_equal(tb.blocks(3, ids), ta.blocks(3, ids))
        every = np.arange(BLOCKS)
        assert int(tb.blocks(0, every).sum()) == 0 and int(tb.blocks(2, every).sum()) == 0
        b.release(h)

    def test_sliced_view_reads_one_rank_of_heads(self, pair: Pair) -> None:
        """Heterogeneous TP: read the second half of each remote block into the first half of local blocks."""
        _a, b, ta, tb, _, b_sees_a = pair
        half = BLOCK_BYTES // 2
        plan = b.prepare(b_sees_a, local_view=BlockView(0, half), remote_view=BlockView(half, half))
        ids = np.array([2, 7], dtype=np.int32)
        h = b.post("READ", plan, ids, ids[::-1].copy())
        assert wait_status(b, h) is XferStatus.DONE
        every = np.arange(BLOCKS)
        for r in range(REGIONS):
            got, src = tb.blocks(r, [2, 7]), ta.blocks(r, [7, 2])
            assert np.array_equal(got[:, :half], src[:, half:])
            assert int(tb.blocks(r, every)[:, half:].sum()) == 0

    # -- notifications ----------------------------------------------------------------------------------------------
    def test_notification_rides_with_the_transfer(self, pair: Pair) -> None:
        a, b, _, _, _, b_sees_a = pair
        note = Notification("req-1", "xfer-1", 7, epoch=b.epoch, kind="done", part=1)
        h = b.post("READ", b.prepare(b_sees_a), [1], [1], notification=note)
        assert wait_status(b, h) is XferStatus.DONE
        got = wait_notes(a, 1)
        assert got == [(b.agent, note)]

    def test_standalone_notification(self, pair: Pair) -> None:
        a, b, _, _, a_sees_b, _ = pair
        note = Notification("req-2", "xfer-2", 3, kind="failed", payload=b"why")
        a.send_notification(a_sees_b, note)
        assert wait_notes(b, 1) == [(a.agent, note)]

    # -- errors -----------------------------------------------------------------------------------------------------
    def test_released_handle_raises(self, pair: Pair) -> None:
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

    def test_mismatched_block_lists_refused(self, pair: Pair) -> None:
        _, b, _, _, _, b_sees_a = pair
        plan = b.prepare(b_sees_a)
        with pytest.raises(RemoteMismatchError):
            b.post("READ", plan, [0, 1], [0])
        with pytest.raises(RemoteMismatchError):
            b.post("READ", plan, [BLOCKS], [0])
        with pytest.raises(RemoteMismatchError):
            b.prepare(b_sees_a, remote_view=BlockView(0, BLOCK_BYTES // 2))

    def test_removed_peer_voids_its_plans(self, pair: Pair) -> None:
        a, b, _, _, _, b_sees_a = pair
        plan = b.prepare(b_sees_a)
        b.remove_peer(b_sees_a)
        with pytest.raises(PeerEpochError):
            b.post("READ", plan, [0], [0])
        # and the peer can be added back and used again
        peer = b.add_peer(a.local_metadata())
        h = b.post("READ", b.prepare(peer), [0], [0])
        assert wait_status(b, h) is XferStatus.DONE

    def test_peer_with_a_new_epoch_replaces_the_old_one(self, pair: Pair) -> None:
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
        assert all(np.array_equal(tb.blocks(r, [5]), ta.blocks(r, [6])) for r in range(REGIONS))

    # -- teardown ---------------------------------------------------------------------------------------------------
    def test_clean_teardown_leaves_nothing_registered(self) -> None:
        t = self.make_transport(f"solo-{time.monotonic_ns()}")
        buffers = self.make_buffers("zeros")
        self.register(t, buffers)
        assert t.registered_regions() == REGIONS
        t.close()
        assert t.registered_regions() == 0
        t.close()  # idempotent
        with pytest.raises(TransportError):
            t.post("READ", None, [0], [0])  # type: ignore[arg-type]  # no plan: the closed transport must refuse
