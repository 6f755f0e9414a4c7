"""The CUDA IPC transport's compiled post (``transports/cuda_ipc/_native_post.c`` + ``native_post.py``).

Without a GPU: the C file builds with the system compiler, its id check refuses what the Python check refuses and
narrows the ids correctly, the kernel binding builds exactly the parameter array Triton's launcher builds (or
refuses the kernel), and a Triton other than the checked versions keeps it off with one warning. On a GPU: the
transport posts through it once warm, byte-exact, and the Python post passes the same conformance suite (both
paths stay covered).
"""

from __future__ import annotations

import ctypes
import logging
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from kvlifecycle.transports import cuda_ipc
from kvlifecycle.transports.cuda_ipc import CudaIpcOptions, native_post
from kvlifecycle.transports.cuda_ipc.ids import block_ids
from test_cuda_ipc import NO_CUDA, VramPair, vram_layout, vram_tensors

from kvlifecycle.testing.transport_conformance import BLOCKS, REGIONS, TransportConformance, wait_notes, wait_status
from kvlifecycle.transport import Notification, RemoteMismatchError, XferStatus

HAVE_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    return native_post.load_library(init_cuda=False)  # builds with cc; the id check needs no driver


def _check(lib: ctypes.CDLL, src: list[int], dst: list[int], src_limit: int, dst_limit: int) -> tuple[int, Any]:
    n = len(src)
    pad = -(-n // 4) * 4
    staging = np.zeros(2 * pad, dtype=np.int64)
    staging[:n], staging[pad:pad + n] = src, dst
    ring = np.full(2 * pad, -7, dtype=np.int32)
    rc = lib.kvl_check_and_narrow(staging.ctypes.data, ring.ctypes.data, n, pad, src_limit, dst_limit)
    return rc, (ring[:n].tolist(), ring[pad:pad + n].tolist())


def test_build_is_cached_by_content(tmp_path: Any) -> None:
    first = native_post.build(out_dir=tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native_post.build(out_dir=tmp_path) == first and first.stat().st_mtime_ns == mtime
    edited = tmp_path / "edited.c"
    edited.write_text(native_post.SOURCE.read_text() + "\n/* edited */\n")
    assert native_post.build(edited, out_dir=tmp_path) != first


def test_a_broken_source_fails_to_build_with_the_compiler_message(tmp_path: Any) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("int kvl_init(void) { return }\n")
    with pytest.raises(OSError, match="failed"):
        native_post.build(bad, out_dir=tmp_path)
    assert not list(tmp_path.glob("*.so"))  # nothing half-written is left to load


def test_id_check_accepts_in_range_ids_and_narrows_them(lib: ctypes.CDLL) -> None:
    rc, (src, dst) = _check(lib, [0, 5, 9], [3, 2, 1], 10, 4)
    assert rc == 0 and src == [0, 5, 9] and dst == [3, 2, 1]


@pytest.mark.parametrize(("src", "dst", "want"), [
    ([0, 10, 1], [0, 1, 2], native_post.ERR_SRC_RANGE),  # source id == limit
    ([0, 1, 2], [0, 4, 1], native_post.ERR_DST_RANGE),  # destination id == limit
    ([-1, 1, 2], [0, 1, 2], native_post.ERR_SRC_RANGE),  # negative: huge when viewed unsigned
    ([0, 1, 2], [0, 1, -5], native_post.ERR_DST_RANGE),
    ([1 << 32, 1, 2], [0, 1, 2], native_post.ERR_SRC_RANGE),  # would wrap to 0 if narrowed before the check
])
def test_id_check_refuses_what_the_python_check_refuses(lib: ctypes.CDLL, src: list[int], dst: list[int],
                                                         want: int) -> None:
    rc, _ = _check(lib, src, dst, 10, 4)
    assert rc == want
    bad, good = ((src, 10), (dst, 4)) if want == native_post.ERR_SRC_RANGE else ((dst, 4), (src, 10))
    block_ids(np.asarray(good[0]), good[1], "good")  # the Python path agrees on both sides
    with pytest.raises(RemoteMismatchError):  # (and raises the message users see)
        block_ids(np.asarray(bad[0]), bad[1], "bad")


def _fake_compiled(signature: dict[str, str], **meta: Any) -> Any:
    base = {"num_ctas": 1, "launch_pdl": False, "launch_cooperative_grid": False, "global_scratch_size": 0,
            "profile_scratch_size": 0, "tensordesc_meta": None, "num_warps": 4, "shared": 128}
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**{**base, **meta}),
                           function=0xF00D)


SIG = {"anchor": "*i64", "src_base": "*i64", "dst_base": "*i64", "src_ids": "*i32", "dst_ids": "*i32",
       "stride": "i64", "split": "constexpr", "count": "i32", "CHUNK": "constexpr"}
ARGS = (0x1000, 0x2000, 0x3000, 0, 0, 1 << 40, 1, -3, 512)


def test_kernel_binding_builds_tritons_parameter_array(lib: ctypes.CDLL) -> None:
    desc = native_post.bind_kernel(_fake_compiled(SIG), ARGS, src_ids_arg=3, dst_ids_arg=4, chunks=8, grid_y=64,
                                   lib=lib)
    assert desc is not None
    # non-constexpr arguments in order, then the global and profile scratch pointers
    assert desc.nparams == 7 + 2
    assert list(desc.slots[:3]) == [0x1000, 0x2000, 0x3000]
    assert (desc.src_ids_param, desc.dst_ids_param) == (3, 4)
    assert desc.slots[5] == 1 << 40
    assert ctypes.c_int32.from_address(ctypes.addressof(desc.slots) + 6 * 8).value == -3  # read as the int32 it is
    assert list(desc.slots[7:9]) == [0, 0]
    assert all(desc.params[i] == ctypes.addressof(desc.slots) + 8 * i for i in range(desc.nparams))
    assert (desc.function, desc.chunks, desc.grid_y, desc.block_x, desc.shared) == (0xF00D, 8, 64, 128, 128)


@pytest.mark.parametrize("change", [
    {"num_ctas": 2}, {"launch_pdl": True}, {"launch_cooperative_grid": True}, {"global_scratch_size": 64},
    {"profile_scratch_size": 8}, {"tensordesc_meta": [{}]},
])
def test_kernel_binding_refuses_launches_tritons_launcher_does_differently(lib: ctypes.CDLL,
                                                                          change: dict[str, Any]) -> None:
    assert native_post.bind_kernel(_fake_compiled(SIG, **change), ARGS, src_ids_arg=3, dst_ids_arg=4, chunks=1,
                                   grid_y=1, lib=lib) is None


@pytest.mark.parametrize("signature", [
    {**SIG, "stride": "fp32"},  # float arguments are packed differently
    {**SIG, "src_ids": "constexpr"},  # nothing to fill per post
    dict(list(SIG.items())[:-1]),  # argument count differs from the signature
])
def test_kernel_binding_refuses_signatures_it_does_not_understand(lib: ctypes.CDLL, signature: dict[str, str]) -> None:
    assert native_post.bind_kernel(_fake_compiled(signature), ARGS, src_ids_arg=3, dst_ids_arg=4, chunks=1,
                                   grid_y=1, lib=lib) is None


INLINE = 4  # pairs in the fake inline kernel below
INLINE_SIG = {"anchor": "*i64", "src_base": "*i64", "dst_base": "*i64",
              **{f"s{i}": "i32" for i in range(INLINE)}, **{f"d{i}": "i32" for i in range(INLINE)},
              "stride": "i64", "CHUNK": "constexpr"}
INLINE_ARGS = (0x1000, 0x2000, 0x3000, *([2] * 2 * INLINE), 1 << 40, 512)


def _inline_desc(lib: ctypes.CDLL) -> Any:
    return native_post.bind_kernel(_fake_compiled(INLINE_SIG), INLINE_ARGS, inline_ids_arg=3, inline_count=INLINE,
                                   chunks=8, grid_y=4, lib=lib)


def test_inline_kernel_binding_marks_where_its_ids_go(lib: ctypes.CDLL) -> None:
    desc = _inline_desc(lib)
    assert desc is not None
    assert (desc.inline_param, desc.inline_count, desc.src_ids_param, desc.dst_ids_param) == (3, INLINE, -1, -1)
    assert desc.nparams == 3 + 2 * INLINE + 1 + 2 and desc.slots[3 + 2 * INLINE] == 1 << 40
    # the ids must be int32 parameters (a Triton that typed them otherwise keeps the staged-ids kernel)
    wide = {**INLINE_SIG, "s1": "i64"}
    assert native_post.bind_kernel(_fake_compiled(wide), INLINE_ARGS, inline_ids_arg=3, inline_count=INLINE,
                                   chunks=8, grid_y=4, lib=lib) is None
    with pytest.raises(ValueError, match="id pointer arguments, or the first inline id"):
        native_post.bind_kernel(_fake_compiled(SIG), ARGS, src_ids_arg=3, dst_ids_arg=4, inline_ids_arg=3,
                                chunks=1, grid_y=1, lib=lib)
    # one post's kernels take their ids the same way
    staged = native_post.bind_kernel(_fake_compiled(SIG), ARGS, src_ids_arg=3, dst_ids_arg=4, chunks=1, grid_y=1,
                                     lib=lib)
    with pytest.raises(ValueError, match="all take their ids inline, or none"):
        native_post.KernelList([desc, staged])
    assert native_post.KernelList([desc, _inline_desc(lib)]).inline_count == INLINE
    assert native_post.KernelList([staged]).inline_count == 0


def _check_inline(lib: ctypes.CDLL, descs: list[Any], src: list[int], dst: list[int], src_limit: int,
                  dst_limit: int) -> int:
    n = len(src)
    pad = -(-n // 4) * 4
    staging = np.zeros(2 * pad, dtype=np.int64)
    staging[:n], staging[pad:pad + n] = src, dst
    kernels = native_post.KernelList(descs)
    return lib.kvl_check_inline(staging.ctypes.data, kernels.address, kernels.count, n, pad, src_limit, dst_limit)


def _inline_ids(desc: Any) -> tuple[list[int], list[int]]:
    ids = [ctypes.c_int32.from_address(ctypes.addressof(desc.slots) + 8 * (3 + i)).value for i in range(2 * INLINE)]
    return ids[:INLINE], ids[INLINE:]


def test_inline_ids_are_checked_then_written_into_every_kernels_parameters(lib: ctypes.CDLL) -> None:
    descs = [_inline_desc(lib), _inline_desc(lib)]
    assert _check_inline(lib, descs, [0, 9, 5], [3, 0, 1], 10, 4) == 0
    for desc in descs:  # read back as the int32 parameters the kernel sees; slot 3 of 4 keeps its old value
        assert _inline_ids(desc) == ([0, 9, 5, 2], [3, 0, 1, 2])
    for src, dst, want in (([0, 10], [0, 1], native_post.ERR_SRC_RANGE), ([0, 1], [-1, 1], native_post.ERR_DST_RANGE),
                           ([1 << 32], [0], native_post.ERR_SRC_RANGE),
                           ([0] * (INLINE + 1), [0] * (INLINE + 1), native_post.ERR_ARGS)):  # more than fit
        assert _check_inline(lib, descs, src, dst, 10, 4) == want
        assert _inline_ids(descs[0]) == ([0, 9, 5, 2], [3, 0, 1, 2])  # refused: nothing written


def test_the_compiled_post_is_an_option_read_from_the_environment_once() -> None:
    assert CudaIpcOptions.from_env({"KVL_NATIVE_POST": "0"}).compiled_post is False
    assert CudaIpcOptions.from_env({}).compiled_post is True
    assert CudaIpcOptions.from_env({"KVL_NATIVE_POST": "0"}, compiled_post=True).compiled_post is True  # given wins
    with pytest.raises(ValueError, match="KVL_NATIVE_POST"):
        CudaIpcOptions.from_env({"KVL_NATIVE_POST": "sometimes"})


def test_a_triton_other_than_the_checked_versions_keeps_the_compiled_post_off_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Triton's launcher is bound by hand (bind_kernel): on a version it was not checked on, load() builds
    nothing, says why in one line, once, and the transport posts through Python."""
    monkeypatch.setattr(native_post, "_loaded", None)
    monkeypatch.setattr(native_post, "_why_not", None)
    monkeypatch.setattr(native_post, "triton_version", lambda: "9.9.0")
    built: list[Any] = []
    monkeypatch.setattr(native_post, "load_library", lambda **kw: built.append(kw))
    with caplog.at_level(logging.WARNING, logger="kvlifecycle.transports.native_post"):
        assert native_post.load() is None
        assert native_post.load() is None
    why = native_post.why_not() or ""
    assert "Triton 9.9.0" in why and all(v in why for v in native_post.CHECKED_TRITON_VERSIONS)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "\n" not in warnings[0] and "posting from Python" in warnings[0]
    assert not built  # never compiled nor loaded


def test_the_checked_triton_versions_pass_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    for version in native_post.CHECKED_TRITON_VERSIONS:
        monkeypatch.setattr(native_post, "triton_version", lambda v=version: v)
        assert native_post.triton_mismatch() is None
    monkeypatch.setattr(native_post, "triton_version", lambda: None)
    assert native_post.triton_mismatch() == "Triton is not installed"


# --- on a GPU ---------------------------------------------------------------------------------------------------------


@gpu
@pytest.mark.gpu
class TestCudaIpcPythonPostConformance(VramPair, TransportConformance):
    """The conformance suite with the compiled post off: the Python path stays correct (and is the fallback)."""

    def make_transport(self, name: str) -> cuda_ipc.CudaIpcTransport:
        t = cuda_ipc.CudaIpcTransport(name, compiled_post=False)
        assert not t.compiled_post
        return t


@gpu
@pytest.mark.gpu
def test_on_an_unchecked_triton_the_transport_posts_from_python_byte_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_post, "_loaded", None)
    monkeypatch.setattr(native_post, "_why_not", None)
    monkeypatch.setattr(native_post, "triton_version", lambda: "0.0.1")
    suffix = time.monotonic_ns()
    a, b = cuda_ipc.CudaIpcTransport(f"old-a-{suffix}"), cuda_ipc.CudaIpcTransport(f"old-b-{suffix}")
    ta, tb = vram_tensors("random", 13), vram_tensors("zeros")
    try:
        a.register(vram_layout(tb))
        b.register(vram_layout(ta))
        assert not a.compiled_post and "Triton 0.0.1" in a.compiled_post_off
        plan = a.prepare(a.add_peer(b.local_metadata()))
        for _ in range(3):  # past the JIT: warm posts stay on the Python path
            h = a.post("READ", plan, np.array([1, 2]), np.array([5, 6]))
            assert wait_status(a, h) is XferStatus.DONE
            a.release(h)
        assert a._plans[plan.key].whole.native_read is None
        torch.cuda.synchronize()
        for r in range(REGIONS):
            assert torch.equal(tb[r][[1, 2]], ta[r][[5, 6]])
    finally:
        a.close()
        b.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("inline", [True, False], ids=["inline-ids", "staged-ids"])
def test_warm_posts_go_through_the_compiled_post_byte_exact_and_refusals_leak_nothing(inline: bool) -> None:
    """Small requests (<= 16 blocks) pass their ids as launch parameters (``inline``), larger ones stage them in
    the ring; with ``inline_ids=False`` every request stages them. Both byte-exact, both refuse bad ids."""
    suffix = time.monotonic_ns()
    a = cuda_ipc.CudaIpcTransport(f"cp-a-{suffix}", inline_ids=inline)
    b = cuda_ipc.CudaIpcTransport(f"cp-b-{suffix}")
    ta, tb = vram_tensors("random", 9), vram_tensors("zeros")
    try:
        a.register(vram_layout(tb))
        b.register(vram_layout(ta))
        assert native_post.triton_mismatch() is None  # this machine's Triton is one the binding was checked on
        assert a.compiled_post, (a.compiled_post_off, native_post.why_not())
        peer = a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        plan = a.prepare(peer)
        rng = np.random.default_rng(4)
        first = a.post("READ", plan, np.array([0], np.int32), np.array([0], np.int32))  # JIT, binds the kernel
        assert wait_status(a, first) is XferStatus.DONE
        a.release(first)
        launch = a._plans[plan.key].whole
        moved = []
        # the C side widens/narrows any integer dtype; 5 and 16 blocks fit the inline kernel, 20 do not
        for i, (dtype, count) in enumerate(((np.int32, 5), (np.int64, 16), (np.uint16, 5), (np.int32, 20))):
            dst = rng.permutation(np.arange(1, BLOCKS))[:count].astype(dtype)
            src = rng.permutation(BLOCKS)[:count].astype(dtype)
            note = Notification(f"r{i}", f"t{i}", 1, a.epoch, "done", 0)
            h = a.post("READ", plan, dst, src, notification=note)
            flight = a._inflight.get(h.id)
            went_inline = inline and count <= 16
            # warm: this post went through the compiled path, with its ids inline or in a ring slot
            assert (launch.inline_read if went_inline else launch.native_read) is not None
            assert flight is None or (flight.slot is None) == went_inline
            assert wait_status(a, h) is XferStatus.DONE
            assert [n.transfer for _, n in wait_notes(b, 1)] == [f"t{i}"]  # sent without a further call
            st = a.stats(h)
            assert st is not None and st.bytes == count * launch.bytes_per_block and st.t_xfer_s > 0
            a.release(h)
            moved.append((dst, src))
            torch.cuda.synchronize()
            d_ids = torch.from_numpy(dst.astype(np.int64)).cuda()
            s_ids = torch.from_numpy(src.astype(np.int64)).cuda()
            for r in range(REGIONS):
                assert torch.equal(tb[r][d_ids], ta[r][s_ids])
        if not inline:
            assert launch.inline_read is None
        for bad_dst, bad_src in (([0, BLOCKS], [0, 1]), ([0, 1], [-1, 2]), ([1] * 15 + [BLOCKS], [2] * 16)):
            with pytest.raises(RemoteMismatchError, match="block ids must be in"):
                a.post("READ", plan, np.array(bad_dst), np.array(bad_src))
            assert not a._inflight  # refused: nothing was enqueued
        # a push through the compiled path (local -> peer), once the write kernel is warm
        warm = a.post("WRITE", plan, np.array([1]), np.array([9]))
        assert wait_status(a, warm) is XferStatus.DONE
        a.release(warm)
        h = a.post("WRITE", plan, np.array([2, 3]), np.array([7, 8]))
        assert (launch.inline_write if inline else launch.native_write) is not None
        assert wait_status(a, h) is XferStatus.DONE
        a.release(h)
        torch.cuda.synchronize()
        for r in range(REGIONS):
            assert torch.equal(ta[r][[7, 8]], tb[r][[2, 3]])
        assert a._ring is not None and not a._ring.busy and not a._settling
    finally:
        a.close()
        b.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [True, False])
def test_post_batch_is_one_launch_with_a_handle_per_request(compiled: bool) -> None:
    suffix = time.monotonic_ns()
    a = cuda_ipc.CudaIpcTransport(f"batch-a-{suffix}", compiled_post=compiled)
    b = cuda_ipc.CudaIpcTransport(f"batch-b-{suffix}")
    ta, tb = vram_tensors("random", 11), vram_tensors("zeros")
    try:
        a.register(vram_layout(tb))
        b.register(vram_layout(ta))
        peer = a.add_peer(b.local_metadata())
        b.add_peer(a.local_metadata())
        plan = a.prepare(peer)
        warm = a.post("READ", plan, [0], [0])  # JIT (and, compiled, binds the kernel)
        assert wait_status(a, warm) is XferStatus.DONE
        a.release(warm)
        rng = np.random.default_rng(8)
        dsts = np.setdiff1d(np.arange(BLOCKS), [0]).astype(np.int32)[:9]
        requests = [(dsts[0:2], rng.permutation(BLOCKS)[:2], Notification("r0", "t0", 1, a.epoch, "done", 0), "t0"),
                    (dsts[2:5], rng.permutation(BLOCKS)[:3].tolist(), None, "t1"),  # lists work too
                    (dsts[5:9], rng.permutation(BLOCKS)[:4], Notification("r2", "t2", 1, a.epoch, "done", 0), "t2")]
        slots_before = dict(a._ring.busy) if a._ring is not None else {}
        handles = a.post_batch("READ", plan, requests)
        assert len(handles) == 3 and len({h.id for h in handles}) == 3
        flights = [a._inflight[h.id] for h in handles if h.id in a._inflight]
        assert len({id(f.end) for f in flights}) <= 1  # one launch: one completion event for all
        assert all(wait_status(a, h) is XferStatus.DONE for h in handles)
        got = sorted(n.transfer for _, n in wait_notes(b, 2))
        assert got == ["t0", "t2"]  # one notification per request that carried one
        bpb = a._plans[plan.key].whole.bytes_per_block
        assert [a.stats(h).bytes for h in handles] == [2 * bpb, 3 * bpb, 4 * bpb]
        for h in handles:
            a.release(h)
        torch.cuda.synchronize()
        for d_ids, s_ids, _, _ in requests:
            d_t, s_t = torch.as_tensor(np.asarray(d_ids), dtype=torch.long), torch.as_tensor(np.asarray(s_ids),
                                                                                            dtype=torch.long)
            for r in range(REGIONS):
                assert torch.equal(tb[r][d_t.cuda()], ta[r][s_t.cuda()])
        assert a._ring is not None and a._ring.busy == slots_before  # the shared slot freed once, by the last
        # the ids are range-checked together; a refused batch names its first bad request and enqueues nothing
        busy = dict(a._ring.busy) if a._ring is not None else {}
        for bad, match in ((([2], [BLOCKS], None, "bad"), "request 1: remote"),
                           ((np.array([-1]), [3], None, "bad"), "request 1: local"),
                           (([2.0], [3], None, "bad"), "request 1: local block ids must be a 1-D integer"),
                           (([2, 3], [3], None, "bad"), "request 1: 2 local blocks vs 1 remote")):
            with pytest.raises(RemoteMismatchError, match=match):
                a.post_batch("READ", plan, [([1], [1], None, "ok"), bad])
            assert not a._inflight and (a._ring is None or a._ring.busy == busy)
        assert a.post_batch("READ", plan, []) == []
        # int and uint id vectors, and an empty request, in one batch: joined as int64, bytes per request
        mixed = [(np.array([1, 2], dtype=np.uint64), np.array([4, 5], dtype=np.int32), None, "m0"),
                 ([], [], None, "m1"),
                 (np.array([3], dtype=np.int16), np.array([6], dtype=np.uint8), None, "m2")]
        handles = a.post_batch("READ", plan, mixed)
        assert all(wait_status(a, h) is XferStatus.DONE for h in handles)
        assert [a.stats(h).bytes for h in handles] == [2 * bpb, 0, bpb]
        for h in handles:
            a.release(h)
        torch.cuda.synchronize()
        for r in range(REGIONS):
            assert torch.equal(tb[r][[1, 2, 3]], ta[r][[4, 5, 6]])
    finally:
        a.close()
        b.close()


def test_post_arguments_written_through_the_numpy_view_land_in_the_c_fields() -> None:
    poster = native_post.PosterDesc()
    args = poster.call_args()
    values = [0x1000, 2, 16, 5, 8, 512, 256, 0x2000, 0x3000, 0x4000, 1]
    for i, v in enumerate(values):
        args[i] = v
    assert [getattr(poster, f) or 0 for f in native_post.PosterDesc.CALL_FIELDS] == values
    assert native_post.PosterDesc.on_copy_stream.offset + 8 == ctypes.sizeof(native_post.PosterDesc)


def test_the_library_keeps_the_gil_across_calls(lib: ctypes.CDLL) -> None:
    # PyDLL: no other Python thread can take the GIL in the middle of a request's post (see native_post.load)
    assert isinstance(lib, ctypes.PyDLL)


def test_the_driver_cost_benchmark_builds_against_the_compiled_post(tmp_path: Any) -> None:
    """bench/driver_costs.c includes _native_post.c and calls kvl_post: it must keep compiling as the post changes."""
    from pathlib import Path

    source = Path(__file__).parents[2] / "bench" / "driver_costs.c"
    lib = ctypes.CDLL(str(native_post.build(source, out_dir=tmp_path)))
    assert lib.kvl_bench and lib.kvl_bench_init and lib.kvl_post_call
