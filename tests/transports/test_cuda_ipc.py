"""The CUDA IPC transport: the conformance suite with VRAM regions (also for NIXL), two-process IPC pull/push,
lifecycle on GPU, the batched kernel's edge cases, and backend selection (the vLLM KV layout and the vLLM
connector's worker side: test_cuda_ipc_vllm.py).

Everything that needs a GPU is skipped with the reason printed (``pytest -rs``) when CUDA is absent; the selection
checks that need no GPU always run.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest
import torch
from kvlifecycle.transports import cuda_ipc
from kvlifecycle.transports.cuda_ipc.ids import block_ids
from kvlifecycle.transports.select import SameNodeSelector

from kvlifecycle.clock import ManualClock
from kvlifecycle.handshake import CompatInfo, MetaReply
from kvlifecycle.ledger import BlockBusyError, SourceLedger
from kvlifecycle.testing.transport_conformance import (
    BLOCK_BYTES,
    BLOCKS,
    REGIONS,
    Fill,
    TransportConformance,
    wait_notes,
    wait_status,
)
from kvlifecycle.transport import (
    KVLayout,
    LayoutWire,
    MemoryKind,
    Notification,
    PeerEpochError,
    PeerMetadata,
    RegistrationError,
    RemoteMismatchError,
    XferStatus,
)

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (the CUDA IPC transport moves VRAM only)"
gpu = pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)
WAIT_S = 30.0


def vram_tensors(fill: str, seed: int = 0, regions: int = REGIONS, blocks: int = BLOCKS,
                 block_bytes: int = BLOCK_BYTES, device: int | None = None) -> list[torch.Tensor]:
    dev = torch.device("cuda", torch.cuda.current_device() if device is None else device)
    gen = torch.Generator(device=dev).manual_seed(seed)
    if fill == "random":
        return [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8, device=dev, generator=gen)
                for _ in range(regions)]
    return [torch.zeros((blocks, block_bytes), dtype=torch.uint8, device=dev) for _ in range(regions)]


def vram_layout(tensors: list[torch.Tensor]) -> KVLayout:
    blocks = tensors[0].shape[0]
    block_bytes = tensors[0][0].numel() * tensors[0].element_size()
    return KVLayout(MemoryKind.VRAM, tensors[0].device.index or 0, blocks, tuple(t.data_ptr() for t in tensors),
                    tuple(block_bytes for _ in tensors))


@contextlib.contextmanager
def vram_pair(make: Callable[[str], Any], name: str, seed: int = 1,
              devices: tuple[int, int] = (0, 0)) -> Iterator[tuple[Any, ...]]:
    """Two endpoints, ``a``'s regions random and ``b``'s zero (on ``devices``), each a peer of the other, closed
    at exit: ``(a, b, ta, tb, a_sees_b, b_sees_a)``."""
    suffix = f"{name}-{time.monotonic_ns()}"
    a, b = make(f"a-{suffix}"), make(f"b-{suffix}")
    try:
        ta, tb = vram_tensors("random", seed, device=devices[0]), vram_tensors("zeros", device=devices[1])
        a.register(vram_layout(ta))
        b.register(vram_layout(tb))
        b_sees_a = b.add_peer(a.local_metadata())
        a_sees_b = a.add_peer(b.local_metadata())
        yield a, b, ta, tb, a_sees_b, b_sees_a
    finally:
        for t in (a, b):
            t.close()


class VramBuffers:
    """The conformance suite's KV regions in VRAM (torch tensors on one device)."""

    def __init__(self, fill: str, seed: int = 0, device: int = 0) -> None:
        self.tensors = vram_tensors(fill, seed, device=device)
        self.layout = vram_layout(self.tensors)

    def blocks(self, region: int, ids: Any) -> np.ndarray:
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.tensors[region].device)
        return self.tensors[region][index].cpu().numpy()


class VramPair:
    """Mixin: the conformance suite's endpoints with their regions in VRAM (``a`` on ``devices[0]``, ``b`` on
    ``devices[1]``) instead of host memory."""

    devices = (0, 0)

    def make_buffers(self, fill: Fill, seed: int = 0, endpoint: int = 0) -> VramBuffers:
        return VramBuffers(fill, seed, device=self.devices[endpoint])

    def device_event(self, buffers: Any) -> object:
        """A CUDA event after everything enqueued so far on the current stream of the buffers' device."""
        device = buffers.tensors[0].device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event


@gpu
@pytest.mark.gpu
class TestCudaIpcConformance(VramPair, TransportConformance):
    def make_transport(self, name: str) -> cuda_ipc.CudaIpcTransport:
        return cuda_ipc.CudaIpcTransport(name)


@gpu
@pytest.mark.gpu
class TestCudaIpcTorchFallbackConformance(VramPair, TransportConformance):
    """The same suite through the torch fallback (what runs where Triton is missing)."""

    def make_transport(self, name: str) -> cuda_ipc.CudaIpcTransport:
        return cuda_ipc.CudaIpcTransport(name, use_triton=False)


TWO_GPUS = HAVE_CUDA and torch.cuda.device_count() >= 2
two_gpus = pytest.mark.skipif(not TWO_GPUS, reason="needs two CUDA devices: torch.cuda.device_count() < 2 (P and D "
                                                   "on different GPUs of one node)")


@gpu
@two_gpus
@pytest.mark.gpu
class TestCudaIpcTwoGpuConformance(VramPair, TransportConformance):
    """Two GPUs: the suite with ``a`` on GPU 0 and ``b`` on GPU 1 of one process: each reaches the other's memory
    through peer access (turned on at ``add_peer``), every copy crossing the link."""

    devices = (0, 1)

    def make_transport(self, name: str) -> cuda_ipc.CudaIpcTransport:
        return cuda_ipc.CudaIpcTransport(name)


def _nixl_or_skip() -> Any:
    try:
        from kvlifecycle.transports.nixl import NixlTransport
    except ImportError as exc:
        pytest.skip(f"needs the real NIXL package (nixl==1.5.1): {exc}")
    return NixlTransport


@gpu
@pytest.mark.gpu
@pytest.mark.nixl
class TestNixlVramConformance(VramPair, TransportConformance):
    """The NIXL transport's conformance suite with VRAM regions (UCX on one GPU)."""

    def make_transport(self, name: str) -> Any:
        return _nixl_or_skip()(name)


# --- the kernel ---------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("group", [1, 2])
@pytest.mark.parametrize("block_bytes", [256, 100, 6, 32768 + 48])
def test_block_copier_odd_sizes_byte_exact(use_triton: bool, group: int, block_bytes: int) -> None:
    from kvlifecycle.transports.cuda_ipc import triton_copy as tc
    from kvlifecycle.transports.cuda_ipc.triton_copy import BlockCopier, RegionSpec

    src = vram_tensors("random", 3, regions=3, blocks=40, block_bytes=block_bytes)
    dst = [torch.full_like(t, 0xA5) for t in src]
    copier = BlockCopier([RegionSpec.of_tensor(t) for t in src], [RegionSpec.of_tensor(t) for t in dst],
                         src[0].device, use_triton=use_triton, region_group=group)
    rng = np.random.default_rng(block_bytes)
    for step in range(4):  # the first launch goes through Triton's JIT, later ones launch the compiled kernel
        for b in dst:
            b.fill_(0xA5)
        n = int(rng.integers(1, 30))
        s = rng.choice(40, n, replace=False).astype(np.int32)
        d = rng.choice(40, n, replace=False).astype(np.int32)
        copier.check_ids(s, d)
        ids = torch.zeros(64, dtype=torch.int32, device="cuda")  # 16-byte aligned halves
        ids[:n], ids[32:32 + n] = torch.from_numpy(s), torch.from_numpy(d)
        if step == 3 and copier.warm:  # ids read by the kernel from pinned host memory, as the transport does
            host = torch.zeros(64, dtype=torch.int32, pin_memory=True)
            host[:n], host[32:32 + n] = torch.from_numpy(s), torch.from_numpy(d)
            stream = torch.cuda.current_stream().cuda_stream
            assert copier.launch_ptrs(stream, host.data_ptr(), host.data_ptr() + 128, n)
        else:
            copier.copy(ids[:n], ids[32:32 + n])
        torch.cuda.synchronize()
        untouched = torch.from_numpy(np.setdiff1d(np.arange(40), d)).long()
        for a, b in zip(src, dst, strict=True):
            assert torch.equal(b[torch.from_numpy(d).long()], a[torch.from_numpy(s).long()])
            assert bool((b[untouched] == 0xA5).all())
    assert copier.backend == ("triton" if use_triton and tc.HAVE_TRITON else "torch")
    if copier.backend == "triton":
        assert copier._compiled is not None  # the direct-launch path was taken (and checked above)


@gpu
@pytest.mark.gpu
def test_block_copier_refuses_out_of_range_ids() -> None:
    from kvlifecycle.transports.cuda_ipc.triton_copy import BlockCopier, RegionSpec

    src, dst = vram_tensors("random", regions=1), vram_tensors("zeros", regions=1)
    copier = BlockCopier([RegionSpec.of_tensor(src[0])], [RegionSpec.of_tensor(dst[0])], src[0].device)
    with pytest.raises(ValueError, match="out of range"):
        copier.check_ids(np.array([0, BLOCKS]), np.array([0, 1]))
    with pytest.raises(ValueError, match="out of range"):
        copier.check_ids(np.array([0]), np.array([-1]))
    with pytest.raises(ValueError, match="unit sizes differ"):
        BlockCopier([RegionSpec.of_tensor(src[0])], [RegionSpec.of_tensor(dst[0][:, :128])], src[0].device)


def test_block_ids_are_checked_at_both_ends_in_one_pass() -> None:
    """post's id check views signed ids as unsigned (one reduction): negatives must still be refused."""
    ok = block_ids(np.array([0, 5, 7], dtype=np.int32), 8, "local")
    assert ok.dtype == np.int32 and ok.tolist() == [0, 5, 7]
    assert block_ids([1, 2], 8, "local").tolist() == [1, 2]
    assert block_ids(np.array([3], dtype=np.uint16), 4, "local").tolist() == [3]
    assert block_ids(np.array([], dtype=np.int64), 4, "local").size == 0
    for bad in (np.array([0, -1], dtype=np.int32), np.array([-(2**62)], dtype=np.int64), [8], [2, 9, 1],
                np.array([4], dtype=np.uint8)):
        with pytest.raises(RemoteMismatchError, match=r"must be in \[0, "):
            block_ids(bad, 4 if isinstance(bad, np.ndarray) and bad.dtype == np.uint8 else 8, "remote")
    with pytest.raises(RemoteMismatchError, match="1-D integer"):
        block_ids(np.array([0.5]), 8, "local")
    with pytest.raises(RemoteMismatchError, match="1-D integer"):
        block_ids(np.zeros((2, 2), dtype=np.int32), 8, "local")


@gpu
@pytest.mark.gpu
def test_lone_and_back_to_back_posts_stage_ids_correctly_and_free_the_ring() -> None:
    """A lone post copies its ids on the transfer's own stream; posts behind running copies use the copy stream.
    Both must land byte-exact, a refused post must leak nothing, and every ring slot is free once all completed."""
    suffix = time.monotonic_ns()
    a, b = cuda_ipc.CudaIpcTransport(f"lone-a-{suffix}"), cuda_ipc.CudaIpcTransport(f"lone-b-{suffix}")
    a._trace = True
    ta, tb = vram_tensors("random", 5), vram_tensors("zeros")
    try:
        a.register(vram_layout(tb))  # a reads into its zeros from b's random blocks
        b.register(vram_layout(ta))
        peer = a.add_peer(b.local_metadata())
        plan = a.prepare(peer)
        rng = np.random.default_rng(3)
        perm = rng.permutation(BLOCKS).astype(np.int32)
        lone_src, lone_dst = perm[:3], rng.permutation(BLOCKS)[:3].astype(np.int32)
        h = a.post("READ", plan, lone_dst, lone_src)
        assert wait_status(a, h) is XferStatus.DONE
        stages = a.stage_times(h)
        assert stages is not None
        assert {"to_launch", "after_launch", "kernel_launch"} <= stages.keys()
        a.release(h)
        with pytest.raises(RemoteMismatchError):
            a.post("READ", plan, [0, BLOCKS], [0, 1])
        # back to back: each post after the first finds a copy in flight (distinct destination blocks)
        dsts = np.setdiff1d(np.arange(BLOCKS), lone_dst).astype(np.int32)[:24].reshape(6, 4)
        srcs = [rng.permutation(BLOCKS)[:4].astype(np.int32) for _ in range(6)]
        handles = [a.post("READ", plan, d, s_) for d, s_ in zip(dsts, srcs, strict=True)]
        assert all(wait_status(a, x) is XferStatus.DONE for x in handles)
        torch.cuda.synchronize()
        for d, s_ in [(lone_dst, lone_src), *zip(dsts, srcs, strict=True)]:
            for r in range(REGIONS):
                assert torch.equal(tb[r][torch.from_numpy(d).cuda().long()], ta[r][torch.from_numpy(s_).cuda().long()])
        for x in handles:
            a.release(x)
        assert a._ring is not None and not a._ring.busy  # every slot back once its copy completed
    finally:
        a.close()
        b.close()


# --- two processes: real CUDA IPC -----------------------------------------------------------------------------------


def _peer_process(conn: Any, seed: int, fill: str, device: int = 0) -> None:
    """The other process: registers VRAM regions (on ``device``), exchanges metadata, then serves commands from the
    pipe."""
    try:
        torch.cuda.set_device(device)
        tensors = vram_tensors(fill, seed, device=device)
        t = cuda_ipc.CudaIpcTransport(f"peer-{os.getpid()}")
        t.register(vram_layout(tensors))
        conn.send(msgspec.msgpack.encode(t.local_metadata()))
        peer = t.add_peer(msgspec.msgpack.decode(conn.recv(), type=PeerMetadata))
        plan = t.prepare(peer)
        while True:
            cmd = conn.recv()
            if cmd[0] == "write":
                _, local, remote, note = cmd
                h = t.post("WRITE", plan, local, remote, notification=Notification(*note))
                conn.send(("written", wait_status(t, h).value))
            elif cmd[0] == "notes":
                conn.send(("notes", [(s, msgspec.structs.astuple(n)) for s, n in wait_notes(t, cmd[1])]))
            elif cmd[0] == "read_then_die":
                _, local, remote = cmd
                t.post("READ", plan, local, remote)
                conn.send(("posted", None))
                os._exit(3)  # die while mapped, with a copy possibly in flight
            elif cmd[0] == "bytes":
                conn.send(("bytes", [x.cpu().numpy().tobytes() for x in tensors]))
            else:
                t.close()
                conn.send(("bye", None))
                return
    except BaseException as exc:  # report, so the test fails with the reason instead of a timeout
        conn.send(("error", repr(exc)))


class PeerProcess:
    def __init__(self, local: cuda_ipc.CudaIpcTransport, seed: int, fill: str, device: int = 0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_process, args=(child, seed, fill, device), daemon=True)
        self.proc.start()
        meta = msgspec.msgpack.decode(self.recv_raw(), type=PeerMetadata)
        self.name = local.add_peer(meta)
        self.meta = meta
        self.conn.send(msgspec.msgpack.encode(local.local_metadata()))

    def recv_raw(self, timeout_s: float = 60.0) -> Any:
        assert self.conn.poll(timeout_s), "peer process did not answer"
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg[0] == "error":
            raise AssertionError(f"peer process failed: {msg[1]}")
        return msg

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv_raw()[1]

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(AssertionError, OSError, EOFError):
                self.ask("stop")
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def local_zero() -> Any:
    t = cuda_ipc.CudaIpcTransport(f"local-{time.monotonic_ns()}")
    tensors = vram_tensors("zeros")
    t.register(vram_layout(tensors))
    yield t, tensors
    t.close()


@gpu
@pytest.mark.gpu
def test_two_process_pull_is_byte_exact_and_notifies(local_zero: Any) -> None:
    t, tensors = local_zero
    peer = PeerProcess(t, seed=21, fill="random")
    try:
        assert t.peer_info(peer.name)["ipc_mappings"] >= 1 and not t.peer_info(peer.name)["same_process"]
        expected = vram_tensors("random", 21)  # same generator, same device: the peer's bytes
        rng = np.random.default_rng(0)
        plan = t.prepare(peer.name)
        note = Notification("req", "xfer-pull", 5, t.epoch, "done", 0)
        for step in range(4):  # the first post compiles; later ones take the direct launch (ids read in place)
            for x in tensors:
                x.zero_()
            remote = rng.choice(BLOCKS, 20, replace=False).astype(np.int32)
            local = rng.choice(BLOCKS, 20, replace=False).astype(np.int32)
            h = t.post("READ", plan, local, remote, notification=note if step == 0 else None)
            assert wait_status(t, h) is XferStatus.DONE, t.error(h)
            li, ri = torch.from_numpy(local).long(), torch.from_numpy(remote).long()
            for r in range(REGIONS):
                assert torch.equal(tensors[r][li], expected[r][ri])
            t.release(h)
        assert peer.ask("notes", 1) == [(t.agent, msgspec.structs.astuple(note))]
        probe = t.probe(peer.name)  # the connect-time payload again, through the IPC mapping, bytes checked
        assert probe.bytes == cuda_ipc.PROBE_BYTES and probe.seconds > 0 and probe.backend.startswith("cuda_ipc")
    finally:
        peer.close()


@gpu
@two_gpus
@pytest.mark.gpu
def test_two_processes_on_two_gpus_pull_and_push_byte_exact(local_zero: Any) -> None:
    """Two GPUs: D here on GPU 0, P in its own process on GPU 1. D pulls P's blocks across the link, P pushes into
    D's, both byte-exact, with the notifications; the mapping is IPC with lazy peer access."""
    t, tensors = local_zero
    peer = PeerProcess(t, seed=23, fill="random", device=1)
    try:
        info = t.peer_info(peer.name)
        assert info["ipc_mappings"] >= 1 and not info["same_process"]
        assert msgspec.msgpack.decode(peer.meta.blob, type=cuda_ipc.CudaIpcBlob).device_id == 1
        expected = vram_tensors("random", 23, device=1)  # the peer's bytes: same seed, same device
        plan = t.prepare(peer.name)
        remote = np.array([5, 0, 31, 17, 9, 22], dtype=np.int32)
        local = np.array([1, 2, 3, 30, 12, 8], dtype=np.int32)
        note = Notification("req", "xfer-2gpu-pull", 3, t.epoch, "done", 0)
        for _ in range(2):  # the first post compiles, the second takes the warm (compiled) path
            for x in tensors:
                x.zero_()
            h = t.post("READ", plan, local, remote, notification=note)
            assert wait_status(t, h) is XferStatus.DONE, t.error(h)
            t.release(h)
        li, ri = torch.from_numpy(local).long(), torch.from_numpy(remote).long()
        for r in range(REGIONS):
            assert torch.equal(tensors[r][li], expected[r][ri.to(expected[r].device)].to(tensors[r].device))
        assert [n for _, n in peer.ask("notes", 2)] == [msgspec.structs.astuple(note)] * 2
        theirs = np.array([4, 6], dtype=np.int32)  # P's blocks it WRITEs into D's blocks 20, 21
        status = peer.ask("write", theirs.tolist(), [20, 21], ("req", "xfer-2gpu-push", 4, 0, "done", 0, b""))
        assert status == XferStatus.DONE.value
        for r in range(REGIONS):
            assert torch.equal(tensors[r][[20, 21]], expected[r][[4, 6]].to(tensors[r].device))
    finally:
        peer.close()


@gpu
@pytest.mark.gpu
def test_two_process_push_is_byte_exact_and_notifies() -> None:
    t = cuda_ipc.CudaIpcTransport(f"src-{time.monotonic_ns()}")
    tensors = vram_tensors("random", 33)
    t.register(vram_layout(tensors))
    peer = PeerProcess(t, seed=0, fill="zeros")
    try:
        local = np.array([3, 1, 4, 15, 9], dtype=np.int32)  # our blocks, overwritten by the push
        theirs = np.array([2, 7, 18, 28, 30], dtype=np.int32)  # the peer's (zero) blocks it WRITEs into ours
        status = peer.ask("write", theirs.tolist(), local.tolist(), ("req", "xfer-push", 9, 0, "done", 0, b""))
        assert status == XferStatus.DONE.value
        for r in range(REGIONS):
            assert int(tensors[r][torch.from_numpy(local).long()].sum()) == 0  # overwritten with the peer's zeros
            others = np.setdiff1d(np.arange(BLOCKS), local)
            assert int(tensors[r][torch.from_numpy(others).long()].sum()) > 0
        got = wait_notes(t, 1)
        assert [(s, n.transfer, n.generation) for s, n in got] == [(peer.name, "xfer-push", 9)]
    finally:
        peer.close()
        t.close()


@gpu
@pytest.mark.gpu
def test_consumer_dying_while_mapped_leaves_p_to_reclaim_by_lease_expiry() -> None:
    """P (this process) grants a lease; D maps P, posts a READ and dies. P's bytes are intact, the lease expires,
    the blocks go back to the allocator, and P's transport keeps working."""
    clock = ManualClock(100.0)
    ledger = SourceLedger(BLOCKS, clock=clock, worker="p0", default_ttl_s=5.0)
    t = cuda_ipc.CudaIpcTransport(f"p-{time.monotonic_ns()}")
    tensors = vram_tensors("random", 44)
    before = [x.clone() for x in tensors]
    t.register(vram_layout(tensors))
    blocks = np.arange(8, dtype=np.int32)
    ledger.allocate("req", blocks)
    ledger.prefill_done("req")
    ledger.grant("req")
    peer = PeerProcess(t, seed=0, fill="zeros")
    try:
        peer.conn.send(("read_then_die", blocks.tolist(), blocks.tolist()))
        peer.recv_raw()
        peer.proc.join(30)
        assert peer.proc.exitcode == 3
        with pytest.raises(BlockBusyError):
            ledger.allocate("again", blocks)  # still pinned: nothing but expiry may release it
        clock.advance(6.0)
        assert ledger.sweep() != []
        assert [r.reason for r in ledger.take_released()] == ["expired"]
        ledger.free("req")
        ledger.allocate("again", blocks)
        torch.cuda.synchronize()
        for a, b in zip(tensors, before, strict=True):
            assert torch.equal(a, b)
        t.remove_peer(peer.name)
    finally:
        peer.close()
        t.close()


# --- lifecycle on GPU: the lease outlives the kernel ----------------------------------------------------------------


class _HeldEvent:
    """Stands in for a copy's completion event that has not fired yet (no timing involved)."""

    def __init__(self, real: Any) -> None:
        self.real, self.fired = real, False

    def query(self) -> bool:
        return self.fired and self.real.query()

    def synchronize(self) -> None:
        self.real.synchronize()


@gpu
@pytest.mark.gpu
def test_lease_is_released_only_after_the_copy_event_completed() -> None:
    clock = ManualClock(0.0)
    ledger = SourceLedger(BLOCKS, clock=clock, worker="p0")
    p = cuda_ipc.CudaIpcTransport(f"p-{time.monotonic_ns()}")
    d = cuda_ipc.CudaIpcTransport(f"d-{time.monotonic_ns()}")
    tp, td = vram_tensors("random", 5), vram_tensors("zeros")
    p.register(vram_layout(tp))
    d.register(vram_layout(td))
    try:
        d_sees_p = d.add_peer(p.local_metadata())
        p.add_peer(d.local_metadata())
        blocks = np.array([1, 2, 3], dtype=np.int32)
        ledger.allocate("req", blocks)
        ledger.prefill_done("req")
        g = ledger.grant("req")
        note = Notification("req", g.transfer, g.generation, d.epoch, "done", 0)
        h = d.post("READ", d.prepare(d_sees_p), blocks, blocks, notification=note)
        held = _HeldEvent(d._inflight[h.id].end)
        d._inflight[h.id].end = held
        torch.cuda.synchronize()  # the kernel itself is finished; only the event we hold says otherwise
        for _ in range(3):
            assert d.poll(h) is XferStatus.PENDING
            assert p.notifications() == []  # no completion notification before the event
        with pytest.raises(BlockBusyError):
            ledger.allocate("other", blocks)
        held.fired = True
        assert wait_status(d, h) is XferStatus.DONE
        got = wait_notes(p, 1)
        assert [n.transfer for _, n in got] == [g.transfer]
        assert ledger.consumer_done(note.transfer, note.generation)
        assert [r.reason for r in ledger.take_released()] == ["completed"]
        ledger.free("req")
        ledger.allocate("other", blocks)
    finally:
        d.close()
        p.close()


# --- epochs, malformed input ------------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
def test_restarted_peer_voids_old_plans_and_maps_the_new_one() -> None:
    a = cuda_ipc.CudaIpcTransport("restarting-peer", epoch=1000)
    b = cuda_ipc.CudaIpcTransport(f"b-{time.monotonic_ns()}")
    ta, tb = vram_tensors("random", 8), vram_tensors("zeros")
    a.register(vram_layout(ta))
    b.register(vram_layout(tb))
    a2 = None
    try:
        plan = b.prepare(b.add_peer(a.local_metadata()))
        a.close()
        a2 = cuda_ipc.CudaIpcTransport("restarting-peer", epoch=2000)
        ta2 = vram_tensors("random", 9)
        a2.register(vram_layout(ta2))
        with pytest.raises(PeerEpochError):
            b.add_peer(msgspec.structs.replace(a2.local_metadata(), epoch=500))  # older than known: refused
        peer = b.add_peer(a2.local_metadata())
        with pytest.raises(PeerEpochError):
            b.post("READ", plan, [0], [0])
        h = b.post("READ", b.prepare(peer), [0, 1], [5, 6])
        assert wait_status(b, h) is XferStatus.DONE
        assert torch.equal(tb[0][:2], ta2[0][5:7])
    finally:
        b.close()
        a.close()
        if a2 is not None:
            a2.close()


@gpu
@pytest.mark.gpu
def test_malformed_side_channel_messages_are_counted_and_dropped(local_zero: Any) -> None:
    import zmq

    t, _ = local_zero
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(t.endpoint)
    try:
        sock.send_multipart([b"not msgpack \xff", b"x"])
        sock.send(b"one frame only")
        sock.send_multipart([msgspec.msgpack.encode(("someone", 1)), b"\x93garbage"])
        deadline = time.monotonic() + WAIT_S
        while t.malformed_notifications < 3 and time.monotonic() < deadline:
            assert t.notifications() == []
            time.sleep(0.001)
        assert t.malformed_notifications == 3
    finally:
        sock.close()


@gpu
@pytest.mark.gpu
def test_register_refuses_dram_and_memory_it_cannot_export() -> None:
    t = cuda_ipc.CudaIpcTransport(f"r-{time.monotonic_ns()}")
    try:
        host = torch.zeros(BLOCKS, BLOCK_BYTES, dtype=torch.uint8)
        with pytest.raises(RegistrationError, match="VRAM"):
            t.register(KVLayout(MemoryKind.DRAM, 0, BLOCKS, (host.data_ptr(),), (BLOCK_BYTES,)))
        with pytest.raises(RegistrationError):
            t.register(KVLayout(MemoryKind.VRAM, 0, BLOCKS, (host.data_ptr(),), (BLOCK_BYTES,)))
        assert t.registered_regions() == 0
    finally:
        t.close()


# --- selection (no GPU needed for the refusals) ---------------------------------------------------------------------


def _meta(host: str, kind: str = "VRAM") -> PeerMetadata:
    blob = cuda_ipc.CudaIpcBlob(host, 1, "GPU-x", 0, "tcp://127.0.0.1:1", [], 0, 0, 0)
    return PeerMetadata("peer", 1, cuda_ipc.NAME, msgspec.msgpack.encode(blob),
                        LayoutWire(kind, 0, 4, [0x1000], [256]))


VRAM_LAYOUT = KVLayout(MemoryKind.VRAM, 0, 4, (0x1000,), (256,))


class _Fallback:
    name = "nixl"


@pytest.mark.parametrize(
    ("local", "remote", "why"),
    [
        (KVLayout(MemoryKind.DRAM, 0, 4, (0x1000,), (256,)), _meta(cuda_ipc.node_identity()), "not VRAM"),
        (VRAM_LAYOUT, None, "offers no cuda_ipc"),
        (VRAM_LAYOUT, _meta(cuda_ipc.node_identity(), kind="DRAM"), "not VRAM"),
        (VRAM_LAYOUT, _meta("another-boot@another-host"), "another node"),
        (VRAM_LAYOUT, msgspec.structs.replace(_meta("h"), blob=b"\xc1junk"), "malformed"),
    ],
)
def test_selection_falls_back_to_nixl_and_says_why(local: KVLayout, remote: PeerMetadata | None, why: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="kvlifecycle.transports.cuda_ipc")
    transport, peer, selection = cuda_ipc.select_same_node(local, None, remote, _Fallback)
    assert isinstance(transport, _Fallback) and peer == ""
    assert selection.backend == "nixl" and why in selection.reason
    assert any("transport selected: nixl" in r.getMessage() and why in r.getMessage() for r in caplog.records)


@gpu
@pytest.mark.gpu
def test_selection_picks_cuda_ipc_on_one_node_and_reports_the_self_test(caplog: pytest.LogCaptureFixture) -> None:
    from kvlifecycle.transports import select

    caplog.set_level("INFO", logger="kvlifecycle.transports.cuda_ipc")
    seen: list[Any] = []
    listener = lambda selection, probe: seen.append((selection, probe))  # noqa: E731
    select.add_listener(listener)
    p = cuda_ipc.CudaIpcTransport(f"sel-p-{time.monotonic_ns()}")
    d = cuda_ipc.CudaIpcTransport(f"sel-d-{time.monotonic_ns()}")
    tp, td = vram_tensors("random", 2), vram_tensors("zeros")
    p.register(vram_layout(tp))
    d.register(vram_layout(td))
    try:
        transport, peer, selection = cuda_ipc.select_same_node(vram_layout(td), d, p.local_metadata(), _Fallback)
        assert transport is d and peer == p.agent and selection.backend == "cuda_ipc"
        assert selection.measured["self_test_gbps"] > 0
        assert any("transport selected: cuda_ipc" in r.getMessage() for r in caplog.records)
        assert [(s.transport, s.locality.value, pr.peer) for s, pr in seen] == [("cuda_ipc", "same_node", p.agent)]
        # a peer whose probe does not hold its epoch's pattern fails the self-test: fall back
        blob = msgspec.msgpack.decode(p.local_metadata().blob, type=cuda_ipc.CudaIpcBlob)
        lying = msgspec.structs.replace(blob, probe_addr=tp[0].data_ptr(), probe_bytes=BLOCK_BYTES)
        bad = msgspec.structs.replace(p.local_metadata(), epoch=p.epoch + 1, blob=msgspec.msgpack.encode(lying))
        d.remove_peer(peer)
        transport, peer, selection = cuda_ipc.select_same_node(vram_layout(td), d, bad, _Fallback)
        assert isinstance(transport, _Fallback) and "self-test failed" in selection.reason
        with pytest.raises(RemoteMismatchError):
            d.add_peer(msgspec.structs.replace(bad, blob=b"\x00"))
    finally:
        select.remove_listener(listener)
        d.close()
        p.close()


# --- the generic handoff picks the fast path (selection) --------------------------------------------------------------

_HANDOFF_COMPAT = dict(model_id="m", dtype="bfloat16", num_layers=REGIONS, num_kv_heads=2, head_size=16, block_size=1,
                       kv_layout="NHD")


def test_meta_reply_fast_meta_is_optional_on_the_wire() -> None:
    """The cuda_ipc metadata rides next to NIXL's in MetaReply; a reply without it (an older P) still decodes,
    and a reply with it decodes on a peer that does not know the field (it is skipped)."""
    compat = CompatInfo(**_HANDOFF_COMPAT)
    nixl_meta = PeerMetadata("p", 1, "nixl", b"x", LayoutWire("VRAM", 0, 4, [0x1000], [256]))

    class OldMetaReply(msgspec.Struct, frozen=True, tag="MetaReply"):
        compat: CompatInfo
        tp_rank: int
        meta: PeerMetadata

    old_bytes = msgspec.msgpack.encode(OldMetaReply(compat, 0, nixl_meta))
    decoded = msgspec.msgpack.decode(old_bytes, type=MetaReply)
    assert decoded.fast_meta is None and decoded.meta == nixl_meta
    new = MetaReply(compat, 0, nixl_meta, _meta(cuda_ipc.node_identity()))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=MetaReply) == new
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldMetaReply).meta == nixl_meta


def _handoff_pair(kind: MemoryKind, fast: bool, selector: Any = None) -> Any:
    """P and D over loopback (the generic transport) with, if ``fast``, a second transport as the fast path:
    CUDA IPC for VRAM, another loopback for DRAM (which selection must refuse). D's path selector: ``selector``, by
    default the transports' SameNodeSelector."""
    from kvlifecycle.transports.loopback import LoopbackTransport

    from kvlifecycle.handoff import Consumer, HandoffOptions, Producer
    from kvlifecycle.ledger import TargetLedger

    suffix = time.monotonic_ns()
    if kind is MemoryKind.VRAM:
        src, dst = vram_tensors("random", 9), vram_tensors("zeros")
    else:
        gen = torch.Generator().manual_seed(9)
        src = [torch.randint(0, 256, (BLOCKS, BLOCK_BYTES), dtype=torch.uint8, generator=gen) for _ in range(REGIONS)]
        dst = [torch.zeros((BLOCKS, BLOCK_BYTES), dtype=torch.uint8) for _ in range(REGIONS)]

    def layout(ts: list[torch.Tensor]) -> KVLayout:
        return KVLayout(kind, 0, BLOCKS, tuple(t.data_ptr() for t in ts), (BLOCK_BYTES,) * REGIONS)

    made: list[Any] = []

    def transports(side: str, ts: list[torch.Tensor]) -> tuple[Any, Any]:
        generic = LoopbackTransport(f"{side}-{suffix}")
        generic.register(layout(ts), tensors=ts if kind is MemoryKind.VRAM else None)
        made.append(generic)
        if not fast:
            return generic, None
        if kind is MemoryKind.VRAM:
            quick: Any = cuda_ipc.CudaIpcTransport(f"{side}-fast-{suffix}")
            quick.register(layout(ts))
        else:
            quick = LoopbackTransport(f"{side}-fast-{suffix}")
            quick.register(layout(ts))
        made.append(quick)
        return generic, quick

    tp, fp = transports("p", src)
    td, fd = transports("d", dst)
    compat = CompatInfo(**_HANDOFF_COMPAT)
    prod = Producer(SourceLedger(BLOCKS, worker="p", default_ttl_s=30.0), tp, compat, fast_transport=fp)
    cons = Consumer(TargetLedger(BLOCKS, worker="d"), td, compat, options=HandoffOptions(heartbeat_every_s=0.01),
                    fast_transport=fd, path_selector=SameNodeSelector() if selector is None else selector)
    return prod, cons, src, dst, made


def _pull_once(prod: Any, cons: Any, src: list[torch.Tensor], dst: list[torch.Tensor]) -> Any:
    link = cons.connect(prod.address)
    prod.ledger.allocate("r", [3, 1, 7])
    prod.ledger.prefill_done("r")
    g = prod.grant("r")
    cons.ledger.reserve("r", [0, 5, 2])
    cons.pull("r", g, address=prod.address)
    assert cons.wait_idle(WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while g.transfer in prod.ledger.leases and time.monotonic() < deadline:
        time.sleep(0.002)
    assert g.transfer not in prod.ledger.leases  # the lease was released (by the copy's notification)
    assert [r.reason for r in prod.ledger.take_released()] == ["completed"]
    assert cons.ledger.stats["loaded"] == 1
    s, d = torch.tensor([3, 1, 7]).long(), torch.tensor([0, 5, 2]).long()
    for r in range(REGIONS):
        assert torch.equal(dst[r][d.to(dst[r].device)].cpu(), src[r][s.to(src[r].device)].cpu())
    return link


def test_handoff_without_a_usable_fast_path_stays_on_the_generic_transport() -> None:
    """DRAM on both sides (no GPU needed): the fast transport is offered but refused, and the pull runs over the
    generic transport with the reason kept on the link."""
    for fast in (False, True):
        prod, cons, src, dst, made = _handoff_pair(MemoryKind.DRAM, fast)
        try:
            link = _pull_once(prod, cons, src, dst)
            assert link.data is None and link.data_peer == ""
            if fast:
                assert link.choice.backend == "loopback" and "not VRAM" in link.choice.reason
            else:
                assert link.choice is None
        finally:
            cons.close()
            prod.close()
            for t in made:
                t.close()


@gpu
@pytest.mark.gpu
def test_handoff_picks_cuda_ipc_for_vram_on_one_node_and_releases_after_the_copy() -> None:
    prod, cons, src, dst, made = _handoff_pair(MemoryKind.VRAM, True)
    try:
        link = _pull_once(prod, cons, src, dst)
        assert link.data is cons.fast_transport and link.choice.backend == "cuda_ipc"
        assert link.data_peer == prod.fast_transport.agent
        assert prod.notifications_seen == 1  # the done notification came through the fast path's side channel
    finally:
        cons.close()
        prod.close()
        for t in made:
            t.close()


@gpu
@pytest.mark.gpu
def test_the_consumers_default_selector_keeps_reads_on_its_transport_even_where_cuda_ipc_qualifies() -> None:
    from kvlifecycle.path_selection import PRIMARY_PATH

    prod, cons, src, dst, made = _handoff_pair(MemoryKind.VRAM, True, selector=PRIMARY_PATH)
    try:
        link = _pull_once(prod, cons, src, dst)
        assert link.data is None and link.choice is None  # the loopback moved it: nothing was selected
        assert cons.fast_transport._peers == {}  # nothing was mapped for it either
    finally:
        cons.close()
        prod.close()
        for t in made:
            t.close()


def _done_once(t: cuda_ipc.CudaIpcTransport, h: Any, timeout_s: float = 10.0) -> None:
    """Poll until the first DONE and stop: no later call that would settle the copy itself."""
    deadline = time.monotonic() + timeout_s
    while t.poll(h) is not XferStatus.DONE:
        assert time.monotonic() < deadline, "copy did not complete"


@gpu
@pytest.mark.gpu
def test_the_settler_notifies_without_another_call_while_watching_and_after_it_slept() -> None:
    with vram_pair(cuda_ipc.CudaIpcTransport, "settler", seed=9) as (a, b, ta, tb, _, b_sees_a):
        plan = b.prepare(b_sees_a)
        first = Notification("r1", "x1", 1, epoch=b.epoch, kind="done")
        _done_once(b, b.post("READ", plan, [3], [4], notification=first))
        assert wait_notes(a, 1) == [(b.agent, first)]  # sent by the settler: b was not called again
        deadline = time.monotonic() + 5.0  # lingers SETTLER_LINGER_S with nothing in flight, then sleeps
        while b._settle_watching:
            assert time.monotonic() < deadline, "the settler never stopped watching"
            time.sleep(0.01)
        second = Notification("r2", "x2", 1, epoch=b.epoch, kind="done")
        _done_once(b, b.post("READ", plan, [5], [6], notification=second))  # this post wakes it again
        assert wait_notes(a, 1) == [(b.agent, second)]
        torch.cuda.synchronize()
        assert torch.equal(tb[0][3], ta[0][4]) and torch.equal(tb[0][5], ta[0][6])
