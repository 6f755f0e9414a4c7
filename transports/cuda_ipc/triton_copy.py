"""One batched block-copy kernel: copy the same blocks of many KV regions in one launch.

A KV cache is a set of *regions* (for vLLM: the K and the V half of every layer), each a contiguous array of
``num_blocks`` blocks of ``block_bytes`` bytes. A request's handoff copies block ``src_ids[i]`` of every source region
to block ``dst_ids[i]`` of the matching destination region. Issuing that as one copy per (region, block) pair means
``regions × blocks`` descriptors (vLLM #55434: 90k–120k per transfer, posting 57 % of the transfer time); here it
is one kernel launch whatever the count, each program copying one chunk of one block of one region.

Regions may live in different allocations, even in another process's memory mapped through CUDA IPC: the kernel
addresses every region as an element offset from one *anchor* tensor (any tensor on the device), so a launch needs
no pointer casts and Triton still sees aligned, contiguous accesses (16-byte loads and stores).

Without Triton (or on a device it cannot compile for) :class:`BlockCopier` falls back to ``index_select`` +
``index_copy_`` per region, which is correct but several times slower.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kvlifecycle.transports.triton_copy")

try:  # Triton is optional: the torch fallback below keeps the transport correct without it.
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_TRITON = False  # and no name `triton` or `tl`: everything that uses them is defined under HAVE_TRITON

# Bytes one program copies per step; a 32 KiB block is one step. Tuned on an H200 (docs/gpu.md).
DEFAULT_CHUNK_BYTES = 4096
DEFAULT_NUM_WARPS = 4
DEFAULT_REGION_GROUP = 1
DEFAULT_CACHE = 1
INLINE_IDS = 16  # block-id pairs _block_copy_inline_kernel takes as parameters (small requests)


if HAVE_TRITON:

    @triton.jit
    def _copy_pair(
        anchor_ptr, src_base_ptr, dst_base_ptr, src_block, dst_block, chunk, first,
        src_stride, dst_stride, src_split, dst_split, src_sub_stride, dst_sub_stride, block_elems, num_regions,
        CHUNK: tl.constexpr, ALIGN: tl.constexpr, EVEN: tl.constexpr, GROUP: tl.constexpr, CACHE: tl.constexpr,
    ):
        """One program's work: chunk ``chunk`` of unit ``src_block`` -> ``dst_block`` in GROUP regions from
        ``first`` (shared by both kernels below; Triton inlines it)."""
        src_off = (src_block // src_split) * src_stride + (src_block % src_split) * src_sub_stride + chunk * CHUNK
        dst_off = (dst_block // dst_split) * dst_stride + (dst_block % dst_split) * dst_sub_stride + chunk * CHUNK
        offs = tl.arange(0, CHUNK)
        for i in tl.static_range(GROUP):
            region = first + i
            if region < num_regions:
                src_start = tl.multiple_of(tl.load(src_base_ptr + region) + src_off, ALIGN)
                dst_start = tl.multiple_of(tl.load(dst_base_ptr + region) + dst_off, ALIGN)
                if EVEN:
                    if CACHE == 1:
                        data = tl.load(anchor_ptr + src_start + offs, cache_modifier=".cg")
                    else:
                        data = tl.load(anchor_ptr + src_start + offs)
                    if CACHE == 0:
                        tl.store(anchor_ptr + dst_start + offs, data)
                    else:
                        tl.store(anchor_ptr + dst_start + offs, data, cache_modifier=".cs")
                else:
                    mask = chunk * CHUNK + offs < block_elems
                    data = tl.load(anchor_ptr + src_start + offs, mask=mask, cache_modifier=".cg")
                    tl.store(anchor_ptr + dst_start + offs, data, mask=mask, cache_modifier=".cs")

    @triton.jit
    def _block_copy_kernel(
        anchor_ptr,  # any tensor on the device; every region is an element offset from it
        src_base_ptr,  # int64[R]: element offset of source region r from the anchor
        dst_base_ptr,  # int64[R]: element offset of destination region r from the anchor
        src_ids_ptr,  # int32[N]: source block ids (device memory, or pinned host memory the device can read)
        dst_ids_ptr,  # int32[N]: destination block ids
        src_stride,  # elements between consecutive blocks of a source region
        dst_stride,  # elements between consecutive blocks of a destination region
        src_split,  # sub-blocks per source block (a view that cuts blocks into equal parts; 1 = whole blocks)
        dst_split,
        src_sub_stride,  # elements between consecutive sub-blocks of one block
        dst_sub_stride,
        block_elems,  # elements copied per (sub-)block
        num_regions,
        CHUNKS: tl.constexpr,  # programs per block along axis 0
        CHUNK: tl.constexpr,  # elements per program (a power of two)
        ALIGN: tl.constexpr,  # every base, stride and chunk start is a multiple of ALIGN elements
        EVEN: tl.constexpr,  # block_elems == CHUNKS * CHUNK: no mask needed
        GROUP: tl.constexpr,  # regions per program: the block ids are read once for GROUP regions
        CACHE: tl.constexpr = 1,  # 0: default caching, 1: .cg loads / .cs stores (streaming), 2: .cs stores only
    ):
        pid = tl.program_id(0)
        pair = pid // CHUNKS
        src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
        dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
        _copy_pair(anchor_ptr, src_base_ptr, dst_base_ptr, src_block, dst_block, pid % CHUNKS,
                   tl.program_id(1) * GROUP, src_stride, dst_stride, src_split, dst_split, src_sub_stride,
                   dst_sub_stride, block_elems, num_regions, CHUNK, ALIGN, EVEN, GROUP, CACHE)

    @triton.jit
    def _pick16(i, v0, v1, v2, v3, v4, v5, v6, v7, v8, v9, v10, v11, v12, v13, v14, v15):
        """``(v0, ..., v15)[i]`` for a uniform ``i``: a four-level select tree."""
        a0 = tl.where((i & 1) == 0, v0, v1)
        a1 = tl.where((i & 1) == 0, v2, v3)
        a2 = tl.where((i & 1) == 0, v4, v5)
        a3 = tl.where((i & 1) == 0, v6, v7)
        a4 = tl.where((i & 1) == 0, v8, v9)
        a5 = tl.where((i & 1) == 0, v10, v11)
        a6 = tl.where((i & 1) == 0, v12, v13)
        a7 = tl.where((i & 1) == 0, v14, v15)
        b0 = tl.where((i & 2) == 0, a0, a1)
        b1 = tl.where((i & 2) == 0, a2, a3)
        b2 = tl.where((i & 2) == 0, a4, a5)
        b3 = tl.where((i & 2) == 0, a6, a7)
        c0 = tl.where((i & 4) == 0, b0, b1)
        c1 = tl.where((i & 4) == 0, b2, b3)
        return tl.where((i & 8) == 0, c0, c1)

    # The same copy with up to INLINE_IDS block-id pairs passed as kernel parameters (s_i -> d_i): no id copy to
    # the device before the kernel, which for a small request is a driver call and a DMA the kernel waits for.
    # Never specialised on the ids' values (one compiled kernel whatever they are). Its INLINE_IDS source and
    # destination id parameters are spelt out (Triton takes no arrays as parameters).
    @triton.jit(do_not_specialize=[f"{side}{i}" for side in "sd" for i in range(INLINE_IDS)])
    def _block_copy_inline_kernel(
        anchor_ptr, src_base_ptr, dst_base_ptr,
        s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15,
        d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15,
        src_stride, dst_stride, src_split, dst_split, src_sub_stride, dst_sub_stride, block_elems, num_regions,
        CHUNKS: tl.constexpr, CHUNK: tl.constexpr, ALIGN: tl.constexpr, EVEN: tl.constexpr, GROUP: tl.constexpr,
        CACHE: tl.constexpr = 1,
    ):
        pid = tl.program_id(0)
        pair = pid // CHUNKS
        src_block = _pick16(pair, s0, s1, s2, s3, s4, s5, s6, s7, s8, s9, s10, s11, s12, s13, s14, s15)
        dst_block = _pick16(pair, d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15)
        _copy_pair(anchor_ptr, src_base_ptr, dst_base_ptr, src_block.to(tl.int64), dst_block.to(tl.int64),
                   pid % CHUNKS, tl.program_id(1) * GROUP, src_stride, dst_stride, src_split, dst_split,
                   src_sub_stride, dst_sub_stride, block_elems, num_regions, CHUNK, ALIGN, EVEN, GROUP, CACHE)


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """One region as the kernel sees it: ``blocks`` copy units of ``unit_bytes`` each.

    Unit ``i`` starts at ``base + (i // split) * stride + (i % split) * sub_stride``; ``split == 1`` is the plain
    ``[num_blocks, ...]`` layout (``stride`` bytes between blocks), ``split > 1`` cuts each block into equal parts
    (P block size != D block size).
    """

    base: int
    stride: int
    blocks: int
    unit_bytes: int
    split: int = 1
    sub_stride: int = 0

    def __post_init__(self) -> None:
        if self.blocks <= 0 or self.unit_bytes <= 0 or self.split <= 0:
            raise ValueError(f"a region needs positive blocks, unit bytes and split: {self}")

    @classmethod
    def of_tensor(cls, region: torch.Tensor) -> RegionSpec:
        """A region laid out as ``[num_blocks, ...]`` with each block contiguous (blocks at any stride)."""
        if region.dim() < 1 or region.shape[0] == 0:
            raise ValueError("a region needs a non-empty leading block dimension")
        if not region[0].is_contiguous():
            raise ValueError(f"each block must be contiguous (shape {tuple(region.shape)}, stride {region.stride()})")
        size = region.element_size()
        unit = (region.numel() // region.shape[0]) * size
        return cls(region.data_ptr(), region.stride(0) * size, region.shape[0], unit)


class _RawCudaArray:
    """Raw device memory as a uint8 ``[blocks, stride]``-strided array, for torch (``__cuda_array_interface__``)."""

    def __init__(self, base: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "|u1", "data": (base, False), "strides": strides, "version": 3,
            "stream": None,  # no synchronisation: the caller orders the copy on its own stream
        }


def _launch_hooks_unset() -> bool:
    """Direct launches skip Triton's launch hooks: only take that path when none are installed."""
    try:
        from triton import knobs

        hooks = (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    except (ImportError, AttributeError):
        return False
    # Triton 3.6 keeps hooks in (possibly empty) HookChain objects; older versions use None.
    return all(h is None or not getattr(h, "calls", [h]) for h in hooks)


def _raw_launcher(compiled: Any) -> tuple[Any, tuple[Any, ...]]:
    """Triton 3.6's CUDA launcher object wraps a C ``launch`` that takes (grid, stream, function, cooperative, pdl,
    global scratch, profile scratch, metadata, launch metadata, hooks, args). Calling it directly skips a Python
    frame and two scratch allocations, only when the kernel needs no scratch. Other versions: None (use ``run``)."""
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    if (run is None or launch is None or bool(getattr(run, "global_scratch_size", 1))
            or bool(getattr(run, "profile_scratch_size", 1))
            or not hasattr(run, "launch_cooperative_grid") or not hasattr(run, "launch_pdl")):
        return None, ()
    return launch, (run.launch_cooperative_grid, run.launch_pdl, None, None)


def _word_bytes(*values: int) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides every address and size."""
    for word in (8, 4, 2):
        if all(v % word == 0 for v in values):
            return word
    return 1


def _chunk_elems(unit_elems: int, chunk_bytes: int, word: int) -> int:
    """Power-of-two elements per program: at most ``chunk_bytes`` and at most the unit rounded up."""
    want = max(1, chunk_bytes // word)
    chunk = 1
    while chunk < want and chunk < unit_elems:
        chunk *= 2
    return chunk


class BlockCopier:
    """Copies blocks between two fixed, equally long lists of regions; built once per (source, destination) pair.

    Region ``r`` of ``src`` is copied to region ``r`` of ``dst``. Addresses may be local allocations or another
    process's memory mapped through CUDA IPC; all must be reachable from ``device``. Every region must have the
    same unit size, stride and split on its side (one launch; a layout with mixed block sizes uses one copier
    per group). The copier keeps per-region offsets on the device, so :meth:`copy` uploads only the block ids.
    """

    def __init__(
        self,
        src: list[RegionSpec],
        dst: list[RegionSpec],
        device: torch.device | int,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
        region_group: int = DEFAULT_REGION_GROUP,
        cache: int = DEFAULT_CACHE,
        use_triton: bool | None = None,
        fast_launch: bool = True,
        inline_ids: bool = True,
        compiled_post: bool = True,
    ) -> None:
        import torch

        if not src or len(src) != len(dst):
            raise ValueError(f"{len(src)} source regions but {len(dst)} destination regions")
        for side, specs in (("source", src), ("destination", dst)):
            shapes = {(s.stride, s.unit_bytes, s.split, s.sub_stride) for s in specs}
            if len(shapes) != 1:
                raise ValueError(f"{side} regions differ in (stride, unit bytes, split, sub stride): {shapes}")
        if src[0].unit_bytes != dst[0].unit_bytes:
            raise ValueError(f"unit sizes differ: source {src[0].unit_bytes} B, destination {dst[0].unit_bytes} B")
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        self.src, self.dst = list(src), list(dst)
        self.regions = len(src)
        self.unit_bytes = src[0].unit_bytes
        self.src_blocks = min(s.blocks for s in src)
        self.dst_blocks = min(s.blocks for s in dst)
        self._anchor = torch.empty(64, dtype=torch.uint8, device=self.device)
        anchor = self._anchor.data_ptr()
        s0, d0 = src[0], dst[0]
        word = _word_bytes(anchor, self.unit_bytes, s0.stride, d0.stride, s0.sub_stride, d0.sub_stride,
                           *(s.base for s in src), *(d.base for d in dst))
        self.word = word
        dtype = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        self._anchor_typed = self._anchor.view(dtype)
        self._src_base = torch.tensor([(s.base - anchor) // word for s in src], dtype=torch.int64, device=self.device)
        self._dst_base = torch.tensor([(d.base - anchor) // word for d in dst], dtype=torch.int64, device=self.device)
        self.unit_elems = self.unit_bytes // word
        self.chunk = _chunk_elems(self.unit_elems, chunk_bytes, word)
        self.chunks = -(-self.unit_elems // self.chunk)
        # 16-byte accesses need every start to be a multiple of 16 bytes; otherwise promise only the word.
        starts = (anchor, s0.stride, d0.stride, s0.sub_stride, d0.sub_stride, self.chunk * word,
                  *(s.base for s in src), *(d.base for d in dst))
        self.align = max(1, 16 // word) if all(v % 16 == 0 for v in starts) else 1
        self.num_warps = num_warps
        want = HAVE_TRITON if use_triton is None else use_triton
        self.use_triton = bool(want and HAVE_TRITON)
        self._views: list[tuple[Any, Any]] | None = None
        s0, d0, w = src[0], dst[0], word
        self._scalars = (s0.stride // w, d0.stride // w, s0.split, d0.split, s0.sub_stride // w, d0.sub_stride // w,
                         self.unit_elems, self.regions)
        self.region_group = max(1, min(int(region_group), self.regions))
        self.region_programs = -(-self.regions // self.region_group)
        self.cache = int(cache)
        self._constexprs = (self.chunks, self.chunk, self.align, self.unit_elems == self.chunks * self.chunk,
                            self.region_group, self.cache)
        # After the first launch through Triton's JIT, launch the compiled kernel directly: the JIT's per-call
        # binding and cache lookup cost more than the copy for small requests. Only when the id pointers are
        # 16-byte aligned (the one argument property that could change the specialisation between calls).
        self.fast_launch = fast_launch
        self.compiled_post = compiled_post  # bind the warm kernels for the compiled post (native_post)
        self._compiled: Any = None
        self._raw_launch: Any = None
        self._raw_flags: tuple[Any, ...] = ()
        self._bound: tuple[Any, tuple[Any, ...], tuple[Any, ...]] | None = None
        self.native: Any = None  # native_post.KernelDesc once warm, where the compiled post can launch it
        self.native_inline: Any = None  # the same for _block_copy_inline_kernel (requests of <= INLINE_IDS blocks)
        self.inline_ids = inline_ids
        self._anchor_ptr = self._anchor_typed.data_ptr()
        self._src_base_ptr, self._dst_base_ptr = self._src_base.data_ptr(), self._dst_base.data_ptr()

    @property
    def backend(self) -> str:
        return "triton" if self.use_triton else "torch"

    def check_ids(self, src_ids: Any, dst_ids: Any) -> None:
        """Refuse ids outside either side's regions before they reach the kernel (host arrays, e.g. numpy)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source block ids but {len(dst_ids)} destination block ids")
        if len(src_ids) and (int(src_ids.min()) < 0 or int(src_ids.max()) >= self.src_blocks):
            raise ValueError(f"source block id out of range [0, {self.src_blocks})")
        if len(dst_ids) and (int(dst_ids.min()) < 0 or int(dst_ids.max()) >= self.dst_blocks):
            raise ValueError(f"destination block id out of range [0, {self.dst_blocks})")

    def copy(self, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Enqueue the copy on the current stream. ``src_ids``/``dst_ids``: int32 tensors on the device,
        already checked with :meth:`check_ids` (the kernel trusts them)."""
        n = int(src_ids.numel())
        if n != int(dst_ids.numel()):
            raise ValueError(f"{n} source block ids but {int(dst_ids.numel())} destination block ids")
        if n == 0:
            return
        if self.use_triton:
            grid = (n * self.chunks, self.region_programs, 1)
            aligned = src_ids.data_ptr() % 16 == 0 and dst_ids.data_ptr() % 16 == 0
            compiled = self._compiled
            if compiled is not None and aligned:
                import torch

                self._direct(compiled, grid, torch.cuda.current_stream(self.device).cuda_stream, src_ids, dst_ids)
                return
            chunks, chunk, align, even, group, cache = self._constexprs
            kernel = _block_copy_kernel[grid](
                self._anchor_typed, self._src_base, self._dst_base, src_ids, dst_ids, *self._scalars,
                CHUNKS=chunks, CHUNK=chunk, ALIGN=align, EVEN=even, GROUP=group, CACHE=cache,
                num_warps=self.num_warps,
            )
            if self.fast_launch and aligned and compiled is None and _launch_hooks_unset():
                self._compiled = kernel
                self._raw_launch, self._raw_flags = _raw_launcher(kernel)
                self._bind()
            return
        src_long, dst_long = src_ids.long(), dst_ids.long()
        for src_view, dst_view in self._torch_views():
            dst_view.index_copy_(0, dst_long, src_view.index_select(0, src_long))

    def launch(self, stream: Any, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
        """Enqueue the copy on ``stream`` (a ``torch.cuda.Stream``); once warm, without touching torch's current
        stream (the hot path of a transport's ``post``)."""
        n = int(src_ids.numel())
        compiled = self._compiled
        if (self.use_triton and compiled is not None and n == int(dst_ids.numel()) and n
                and src_ids.data_ptr() % 16 == 0 and dst_ids.data_ptr() % 16 == 0):
            self._direct(compiled, (n * self.chunks, self.region_programs, 1), stream.cuda_stream, src_ids, dst_ids)
            return
        import torch

        with torch.cuda.stream(stream):
            self.copy(src_ids, dst_ids)

    @property
    def warm(self) -> bool:
        """True once :meth:`launch_ptrs` can launch (the kernel went through Triton's JIT once)."""
        return self._compiled is not None

    def launch_ptrs(self, stream: int, src_ids_ptr: int, dst_ids_ptr: int, n: int) -> bool:
        """The hot path: launch the warm compiled kernel on a raw stream handle with raw int32 id pointers (both
        16-byte aligned, on the device). Returns False (nothing launched) until a first :meth:`launch` has gone
        through Triton's JIT, or where the direct launch is off; the caller then uses :meth:`launch`."""
        bound = self._bound
        if bound is None or not n or src_ids_ptr % 16 or dst_ids_ptr % 16:
            return False
        # Everything but the grid, the stream and the two id pointers was bound once (_bind): one call, no
        # per-launch tuple building beyond the argument list itself.
        fn, head, tail = bound
        fn(n * self.chunks, self.region_programs, 1, stream, *head, src_ids_ptr, dst_ids_ptr, *tail)
        return True

    def _bind(self) -> None:
        """Pre-bind the warm kernel's launch: (launcher, arguments before the id pointers, arguments after)."""
        compiled = self._compiled
        if compiled is None:
            self._bound = self.native = None
            return
        bases = (self._anchor_ptr, self._src_base_ptr, self._dst_base_ptr)
        tail = (*self._scalars, *self._constexprs)
        if self._raw_launch is not None:
            head = (compiled.function, *self._raw_flags, compiled.packed_metadata, None, None, None, *bases)
            self._bound = (self._raw_launch, head, tail)
            # The compiled post (_native_post.c) launches this kernel itself with the same parameters.
            from . import native_post

            lib = native_post.load() if self.compiled_post else None
            if lib is not None:
                self.native = native_post.bind_kernel(
                    compiled, (*bases, 0, 0, *tail), src_ids_arg=3, dst_ids_arg=4, chunks=self.chunks,
                    grid_y=self.region_programs, lib=lib)
                self.native_inline = self._bind_inline(lib) if self.inline_ids else None
        else:
            head = (compiled.function, compiled.packed_metadata, None, None, None, *bases)
            self._bound = (compiled.run, head, tail)

    def _bind_inline(self, lib: Any) -> Any:
        """Compile (no launch) the inline-ids kernel with this copier's shape and bind it for the compiled post;
        ``None`` where that fails (small requests then stage their ids like any other)."""
        from . import native_post

        chunks, chunk, align, even, group, cache = self._constexprs
        ids = (2,) * (2 * INLINE_IDS)  # any int32 values: the kernel is never specialised on them
        try:
            compiled = _block_copy_inline_kernel.warmup(
                self._anchor_typed, self._src_base, self._dst_base, *ids, *self._scalars,
                CHUNKS=chunks, CHUNK=chunk, ALIGN=align, EVEN=even, GROUP=group, CACHE=cache,
                num_warps=self.num_warps, grid=(1,))
            if getattr(compiled, "function", None) is None and hasattr(compiled, "_init_handles"):
                compiled._init_handles()  # warmup() compiles but loads the module only at a first launch
        except Exception as exc:  # a Triton that cannot build or load it: the staged-ids kernel still serves
            log.warning("block copy: no inline-ids kernel (%s: %s)", type(exc).__name__, exc)
            return None
        args = (self._anchor_ptr, self._src_base_ptr, self._dst_base_ptr, *ids, *self._scalars, *self._constexprs)
        return native_post.bind_kernel(compiled, args, inline_ids_arg=3, inline_count=INLINE_IDS,
                                       chunks=self.chunks, grid_y=self.region_programs, lib=lib)

    def _direct(self, compiled: Any, grid: tuple[int, int, int], stream: int, src_ids: Any, dst_ids: Any) -> None:
        # Pointers as plain ints: the launcher takes them as they are (no per-launch pointer attribute query).
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     self._anchor_ptr, self._src_base_ptr, self._dst_base_ptr, src_ids.data_ptr(), dst_ids.data_ptr(),
                     *self._scalars, *self._constexprs)

    def _torch_views(self) -> list[tuple[Any, Any]]:
        """``[units, unit_bytes]`` uint8 views of every region for the torch fallback (built on first use)."""
        if self._views is None:
            self._views = [(self._view(s), self._view(d)) for s, d in zip(self.src, self.dst, strict=True)]
        return self._views

    def _view(self, spec: RegionSpec) -> Any:
        import torch

        if spec.split == 1:
            raw = _RawCudaArray(spec.base, (spec.blocks, spec.unit_bytes), (spec.stride, 1))
            return torch.as_tensor(raw, device=self.device)
        raw = _RawCudaArray(spec.base, (spec.blocks, spec.split, spec.unit_bytes), (spec.stride, spec.sub_stride, 1))
        view = torch.as_tensor(raw, device=self.device)
        # Units are (block, sub) pairs; flatten them when the strides allow, else fail loudly.
        return view.view(spec.blocks * spec.split, spec.unit_bytes)
