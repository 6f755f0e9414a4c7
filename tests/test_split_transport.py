"""The split transport over real NIXL (UCX, DRAM): one transport made of one part per set of region groups, as
the SGLang fast path makes it on a GPU (CUDA IPC over the VRAM pages, NIXL over the host aux rows; that pairing
runs in tests/transports/test_nixl_mixed_kinds.py). Here both parts are NIXL agents: the pages on one, the aux
rows on the other. What is checked is the split: each part moves its own groups' blocks, and the post settles as
one. Every wait is bounded; nothing asserts on time."""

from __future__ import annotations

import itertools
import random

import msgspec
import numpy as np
import pytest

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from grouped_sides import AUX_REGIONS, COMPAT, KV_REGIONS, PAGE_BYTES, ROW_BYTES, Side, assert_moved, aux_block, wait
from kvlifecycle.transports.nixl import NixlTransport
from kvlifecycle.transports.split import SplitBlob, SplitTransport, part_offers

from kvlifecycle import layout as L
from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
from kvlifecycle.invariants import check_source, check_target
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import TargetState
from kvlifecycle.path_selection import DataPath, PathChoice
from kvlifecycle.testing.transport_conformance import TransportConformance
from kvlifecycle.transport import (
    Notification,
    PeerMetadata,
    RegistrationError,
    RemoteMismatchError,
    TransferFailedError,
    TransportError,
    XferStatus,
    cancels_in_flight,
)

pytestmark = pytest.mark.nixl
_names = itertools.count()


class TestSplitConformance(TransportConformance):
    """One part holding the one group: the split's own bookkeeping (handles, plans, epochs, notifications named
    as the peer is here, teardown) under the whole suite."""

    def make_transport(self, name: str) -> SplitTransport:
        return SplitTransport(name, [(NixlTransport(f"{name}-0", probe_bytes=0), [0])])


def split(name: str) -> SplitTransport:
    """Pages (group 0) on one NIXL agent, aux rows (group 1) on another."""
    return SplitTransport(name, [(NixlTransport(f"{name}-pages", probe_bytes=0), [0]),
                                 (NixlTransport(f"{name}-rows", probe_bytes=0), [1])])


class Counted:
    """A real part that records what was posted on it: (local ids, remote ids, regions) per post."""

    def __init__(self, inner: NixlTransport) -> None:
        self.inner = inner
        self.posts: list[tuple[list[int], list[int], list[int] | None]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def post(self, op, plan, local, remote, *, regions=None, **kwargs):
        self.posts.append((list(map(int, local)), list(map(int, remote)),
                           None if regions is None else list(map(int, regions))))
        return self.inner.post(op, plan, local, remote, regions=regions, **kwargs)


@pytest.fixture
def pair():
    n = next(_names)
    src, dst = Side(1, kinds=True), Side(None, kinds=True)
    a, b = split(f"split-a{n}"), split(f"split-b{n}")
    try:
        a.register(src.layout)
        b.register(dst.layout)
        b_sees_a, a_sees_b = b.add_peer(a.local_metadata()), a.add_peer(b.local_metadata())
        yield a, b, src, dst, a_sees_b, b_sees_a
    finally:
        b.close()
        a.close()


def settle(t: SplitTransport, handle) -> XferStatus:
    assert wait(lambda: t.poll(handle) is not XferStatus.PENDING)
    return t.poll(handle)


def test_each_part_registers_its_own_groups(pair) -> None:
    a, _b, src, _dst, _, _ = pair
    pages, rows = a.parts
    assert pages.layout == L.groups_layout(src.layout, [0]) and pages.layout.num_regions == KV_REGIONS
    assert rows.layout == L.groups_layout(src.layout, [1]) and rows.layout.num_regions == AUX_REGIONS
    assert a.registered_regions() == KV_REGIONS + AUX_REGIONS
    assert part_offers(a.local_metadata()).groups == [[0], [1]]


@pytest.mark.parametrize("op", ["READ", "WRITE"])
def test_one_post_moves_pages_on_one_part_and_the_aux_row_on_the_other(op: str) -> None:
    n = next(_names)
    src, dst = Side(2, kinds=True), Side(None, kinds=True)
    pages_part = Counted(NixlTransport(f"split-cp{n}", probe_bytes=0))
    reader = SplitTransport(f"split-c{n}", [(pages_part, [0]),  # type: ignore[list-item]
                                            (NixlTransport(f"split-cr{n}", probe_bytes=0), [1])])
    other = split(f"split-o{n}")
    try:
        # READ: the reader is D (zeros), pulling from P; WRITE: the poster is P, pushing into D
        ours, theirs = (dst, src) if op == "READ" else (src, dst)
        reader.register(ours.layout)
        other.register(theirs.layout)
        other.add_peer(reader.local_metadata())
        plan = reader.prepare(reader.add_peer(other.local_metadata()))
        before = dst.snapshot()
        local = [3, 9, 0, aux_block(ours.layout, 4)]
        remote = [7, 1, 11, aux_block(theirs.layout, 2)]
        handle = reader.post(op, plan, local, remote, transfer="t")
        assert settle(reader, handle) is XferStatus.DONE, reader.error(handle)
        # the pages part got the pages only (its own ids); the rows part the aux row as row 4 of its layout
        assert pages_part.posts == [([3, 9, 0], [7, 1, 11], None)]
        if op == "READ":
            assert_moved(src, dst, before, ([7, 1, 11], [3, 9, 0]), (2, 4))
        else:
            assert_moved(src, dst, before, ([3, 9, 0], [7, 1, 11]), (4, 2))
        stats = reader.stats(handle)
        assert stats is not None and stats.desc_count == 3 * KV_REGIONS + AUX_REGIONS
        assert stats.bytes == 3 * KV_REGIONS * PAGE_BYTES + AUX_REGIONS * ROW_BYTES
        reader.release(handle)
    finally:
        other.close()
        reader.close()


def test_a_region_subset_moves_those_regions_of_each_group(pair) -> None:
    _a, b, src, dst, _, b_sees_a = pair
    before = dst.snapshot()
    # region 1 of the pages, and the second aux region (layout region KV_REGIONS + 1)
    handle = b.post("READ", b.prepare(b_sees_a), [5, aux_block(dst.layout, 0)], [6, aux_block(src.layout, 3)],
                    regions=[1, KV_REGIONS + 1])
    assert settle(b, handle) is XferStatus.DONE, b.error(handle)
    for r in range(KV_REGIONS):
        expected = before[r].copy()
        if r == 1:
            expected[5] = src.kv[1][6]
        assert np.array_equal(dst.kv[r], expected)
    assert np.array_equal(dst.aux[0], before[KV_REGIONS])
    assert np.array_equal(dst.aux[1][0], src.aux[1][3])


def test_the_notification_reaches_the_peer_once_both_parts_landed(pair) -> None:
    a, b, src, dst, a_sees_b, _ = pair
    before = dst.snapshot()
    note = Notification("req", "xfer", 1, epoch=a.epoch)
    handle = a.post("WRITE", a.prepare(a_sees_b), [1, aux_block(src.layout, 0)], [2, aux_block(dst.layout, 1)],
                    notification=note)
    got: list[tuple[str, Notification]] = []
    # the poster's polls settle the post and send the note (the protocol: once a poll saw it DONE)
    assert wait(lambda: bool(a.poll(handle) is XferStatus.DONE and (got.extend(b.notifications()) or got)))
    # when the note is read, both parts' bytes are there already; it names the sender as b knows it
    assert_moved(src, dst, before, ([1], [2]), (0, 1))
    assert got == [(a.agent, note)]


def test_a_page_paired_with_an_aux_row_is_refused_and_nothing_moves(pair) -> None:
    _a, b, src, dst, _, b_sees_a = pair
    before = dst.snapshot()
    with pytest.raises(RemoteMismatchError, match="cannot pair"):
        b.post("READ", b.prepare(b_sees_a), [0, aux_block(dst.layout, 0)], [aux_block(src.layout, 0), 0])
    assert all(np.array_equal(x, y) for x, y in zip(dst.snapshot(), before, strict=True))


class Failing:
    """A real part whose transfers report FAILED (its bytes may have moved: what counts is the status)."""

    def __init__(self, inner: NixlTransport) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def poll(self, handle):
        return XferStatus.FAILED if self.inner.poll(handle) is not XferStatus.PENDING else XferStatus.PENDING

    def error(self, handle):
        return TransferFailedError("the pages part failed")


class Held:
    """A real part whose transfers stay PENDING until let go; ``cancels``: whether releasing one stops it (NIXL)
    or not (a launched CUDA IPC kernel). Records what was released while pending."""

    def __init__(self, inner: NixlTransport, *, cancels: bool) -> None:
        self.inner = inner
        self.cancels_in_flight = cancels
        self.held = True
        self.released_pending = 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def poll(self, handle):
        return XferStatus.PENDING if self.held else self.inner.poll(handle)

    def release(self, handle):
        self.released_pending += self.held
        self.inner.release(handle)


@pytest.mark.parametrize("cancels", [False, True], ids=["kernel-part", "cancelling-part"])
def test_a_failed_part_fails_the_post_only_once_no_sibling_byte_can_land(cancels: bool) -> None:
    """vLLM #56104: the first error of a request moved by several transfers freed its blocks while a sibling's
    writes were still landing. Here the sibling that cannot be stopped keeps the post PENDING until it ended; one
    that can is released at once. Either way no notification goes out for a failed post."""
    n = next(_names)
    src, dst = Side(3, kinds=True), Side(None, kinds=True)
    rows = Held(NixlTransport(f"split-hr{n}", probe_bytes=0), cancels=cancels)
    writer = SplitTransport(f"split-w{n}", [(Failing(NixlTransport(f"split-fp{n}", probe_bytes=0)), [0]),  # type: ignore[list-item]
                                            (rows, [1])])  # type: ignore[list-item]
    reader = split(f"split-r{n}")
    try:
        assert writer.cancels_in_flight is cancels and cancels_in_flight(writer) is cancels
        writer.register(src.layout)
        reader.register(dst.layout)
        reader.add_peer(writer.local_metadata())
        plan = writer.prepare(writer.add_peer(reader.local_metadata()))
        note = Notification("req", "xfer", 1, epoch=writer.epoch)
        handle = writer.post("WRITE", plan, [1, aux_block(src.layout, 0)], [2, aux_block(dst.layout, 1)],
                             notification=note)
        assert wait(lambda: writer.parts[0].inner.poll(writer._posts[handle.id].handles[0][1])
                    is not XferStatus.PENDING)
        if not cancels:
            for _ in range(20):  # the pages part has failed; the rows part still runs: no end yet
                assert writer.poll(handle) is XferStatus.PENDING
            rows.held = False
        assert settle(writer, handle) is XferStatus.FAILED
        assert str(writer.error(handle)) == "the pages part failed"
        assert rows.released_pending == (1 if cancels else 0)
        assert reader.notifications() == []
    finally:
        rows.held = False
        reader.close()
        writer.close()


def test_a_peer_split_another_way_is_refused() -> None:
    n = next(_names)
    src, dst = Side(4, kinds=True), Side(None, kinds=True)
    ours = split(f"split-m{n}")
    whole = SplitTransport(f"split-x{n}", [(NixlTransport(f"split-x{n}-0", probe_bytes=0), [0, 1])])
    try:
        ours.register(dst.layout)
        whole.register(src.layout)
        with pytest.raises(RemoteMismatchError, match="splits its groups"):
            ours.add_peer(whole.local_metadata())
        with pytest.raises(RemoteMismatchError, match="not split"):
            ours.add_peer(whole.parts[0].local_metadata())  # a plain NIXL offer
    finally:
        whole.close()
        ours.close()


def test_parts_must_cover_every_group_once() -> None:
    n = next(_names)
    side = Side(None, kinds=True)
    t = SplitTransport(f"split-g{n}", [(NixlTransport(f"split-g{n}-0", probe_bytes=0), [0])])
    try:
        with pytest.raises(RegistrationError, match="cover"):
            t.register(side.layout)
    finally:
        t.close()


def test_hostile_metadata_is_refused_with_a_transport_error_and_loses_nothing(pair) -> None:
    """The split's metadata decoder is total: random bytes, a mutated blob, parts whose layouts are not the
    whole's groups: each is refused with a TransportError (RemoteMismatchError), and the valid peer still works."""
    a, b, src, dst, _, b_sees_a = pair
    good = a.local_metadata()
    blob = msgspec.msgpack.decode(good.blob, type=SplitBlob)
    rng = random.Random(5)
    raw = bytearray(good.blob)
    cases: list[PeerMetadata] = [msgspec.structs.replace(good, blob=bytes(rng.randbytes(rng.randint(0, 64))))
                                 for _ in range(200)]
    for _ in range(300):
        mutated = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            mutated[rng.randrange(len(mutated))] = rng.randrange(256)
        cases.append(msgspec.structs.replace(good, blob=bytes(mutated)))
    swapped = SplitBlob(blob.groups, [blob.parts[1], blob.parts[0]])
    cases.append(msgspec.structs.replace(good, blob=msgspec.msgpack.encode(swapped)))
    cases.append(msgspec.structs.replace(good, blob=msgspec.msgpack.encode(SplitBlob(blob.groups, blob.parts[:1]))))
    refused = 0
    for meta in cases:
        try:
            b.add_peer(meta)
        except TransportError:
            refused += 1
    assert refused >= 202  # the hand-made ones and all but the few mutations that left the blob valid
    handle = b.post("READ", b.prepare(b_sees_a), [0], [1])
    assert settle(b, handle) is XferStatus.DONE
    assert np.array_equal(dst.kv[0][0], src.kv[0][1])


class PickFast:
    """A path selector that takes the fast path whenever the peer offers one (the real selector, CUDA IPC's
    checks and self-test on the VRAM part, needs a GPU)."""

    def select(self, primary, fast, offer) -> DataPath:
        if fast is None or offer is None:
            return DataPath(primary)
        return DataPath(fast, fast.add_peer(offer), PathChoice(fast.name, "test: always the fast path"))


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_handoff_moves_a_request_through_the_split_fast_path(mode: str) -> None:
    n = next(_names)
    src, dst = Side(5, kinds=True), Side(None, kinds=True)
    tp, td = NixlTransport(f"split-p{n}", probe_bytes=0), NixlTransport(f"split-d{n}", probe_bytes=0)
    fp, fd = split(f"split-fp{n}"), split(f"split-fd{n}")
    for t, side in ((tp, src), (fp, src), (td, dst), (fd, dst)):
        t.register(side.layout)
    primary_posts: list[str] = []
    for t in (tp, td):
        post = t.post
        t.post = lambda *args, _post=post, **kw: primary_posts.append(kw.get("transfer", "")) or _post(*args, **kw)  # type: ignore[method-assign]
    sl = SourceLedger(src.layout.num_blocks, worker="p", default_ttl_s=30.0)
    tl = TargetLedger(dst.layout.num_blocks, worker="d")
    prod = Producer(sl, tp, COMPAT, fast_transport=fp, path_selector=PickFast())
    cons = Consumer(tl, td, COMPAT, options=HandoffOptions(heartbeat_every_s=0.05, probe=False), fast_transport=fd,
                    path_selector=PickFast())
    try:
        link = cons.connect(prod.address)
        assert link.choice is not None and link.choice.backend == "split"
        p_blocks, d_blocks = [2, 4, 6, aux_block(src.layout, 1)], [10, 0, 5, aux_block(dst.layout, 3)]
        sl.allocate(mode, p_blocks)
        sl.prefill_done(mode)
        grant = prod.grant(mode)
        tl.reserve(mode, d_blocks)
        before = dst.snapshot()
        if mode == "pull":
            cons.pull(mode, grant, address=prod.address)
        else:
            cons.request_push(mode, grant, address=prod.address)
        assert cons.wait_idle(20)
        assert wait(lambda: grant.transfer not in sl.leases)
        assert [r.reason for r in sl.take_released()] == ["completed"]
        assert tl.requests[mode].state == TargetState.READY_FOR_ATTENTION
        assert_moved(src, dst, before, ([2, 4, 6], [10, 0, 5]), (1, 3))
        assert primary_posts == []  # every byte went through the split path
        tl.finish(mode)
    finally:
        cons.close()
        prod.close()
        for t in (fd, fp, td, tp):
            t.close()
    assert check_source(sl) == [] and check_target(tl) == []


def test_the_same_node_selector_keeps_nixl_when_the_fast_part_holds_no_vram(pair) -> None:
    """On this CPU machine the split's first part is DRAM: CUDA IPC's checks refuse it, the link stays on the
    primary transport, and the choice says why."""
    from kvlifecycle.transports.select import SameNodeSelector

    a, b, _, _, _, _ = pair
    path = SameNodeSelector().select(b.parts[0], b, a.local_metadata())
    assert path.transport is b.parts[0] and path.choice is not None
    assert "not VRAM" in path.choice.reason
