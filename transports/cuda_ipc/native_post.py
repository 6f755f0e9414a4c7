"""The compiled post of the CUDA IPC transport (``_native_post.c``): build once, load with ctypes, bind kernels.

:func:`load` compiles the C file with the system C compiler (``$CC`` or ``cc``; no CUDA headers needed) into a
per-user cache, keyed by the source's hash, and loads it. Where that is impossible (no compiler, no libcuda, a
Triton other than :data:`CHECKED_TRITON_VERSIONS`) it returns ``None`` and says why once; the transport then posts
through its Python path, which does the same steps with one ctypes call each. (The transport's ``compiled_post``
option, ``KVL_NATIVE_POST=0``, keeps it from asking at all.)

:func:`bind_kernel` turns a warm Triton ``CompiledKernel`` plus the arguments of one launch into a
:class:`KernelDesc` the C post launches with ``cuLaunchKernel``: the parameter array Triton's own launcher builds
(one pointer per non-constexpr argument, then the global and profile scratch pointers). It returns ``None`` for
anything that launcher would do differently (scratch memory, clusters, PDL, cooperative launch, float or tensor
descriptor arguments), so those keep Triton's launcher.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvlifecycle import envvars

log = logging.getLogger("kvlifecycle.transports.native_post")

SOURCE = Path(__file__).with_name("_native_post.c")
# The Triton versions this binding was checked on: the parameter array of Triton's CUDA launcher and the compiled
# kernel's metadata fields it reads (bind_kernel) are Triton internals, with no promise across versions. On any
# other version the compiled post stays off (one warning) and posts go through the Python path.
CHECKED_TRITON_VERSIONS = ("3.6.0",)
MAX_PARAMS = 48  # KVL_MAX_PARAMS
MAX_KERNELS = 8  # KVL_MAX_KERNELS
ERR_SRC_RANGE, ERR_DST_RANGE, ERR_ARGS = -1, -2, -3
STEPS = {1: "cuMemcpyHtoDAsync(ids)", 2: "cuEventRecord(order)", 3: "cuStreamWaitEvent(order)",
         4: "cuStreamWaitEvent(ids)", 5: "cuEventRecord(start)", 6: "cuLaunchKernel", 7: "cuEventRecord(end)",
         8: "cuEventRecord(ids)"}
_INT_TYPES = {"i1", "i8", "i16", "i32", "i64", "u1", "u8", "u16", "u32", "u64"}


class KernelDesc(ctypes.Structure):
    """``kvl_kernel``: one compiled kernel, its launch shape and its bound parameters (must not move: the C side
    keeps pointers into ``slots``)."""

    _fields_ = [
        ("function", ctypes.c_void_p),
        ("chunks", ctypes.c_uint32),
        ("grid_y", ctypes.c_uint32),
        ("block_x", ctypes.c_uint32),
        ("shared", ctypes.c_uint32),
        ("src_ids_param", ctypes.c_int32),
        ("dst_ids_param", ctypes.c_int32),
        ("nparams", ctypes.c_int32),
        ("inline_param", ctypes.c_int32),
        ("inline_count", ctypes.c_int32),
        ("slots", ctypes.c_uint64 * MAX_PARAMS),
        ("params", ctypes.c_void_p * MAX_PARAMS),
    ]


class PosterDesc(ctypes.Structure):
    """``kvl_poster``: one transport's streams, events and id staging."""

    _fields_ = [
        ("stream", ctypes.c_void_p),
        ("copy_stream", ctypes.c_void_p),
        ("order_event", ctypes.c_void_p),
        ("ids_event", ctypes.c_void_p),
        ("staging", ctypes.c_void_p),
        ("ring_host", ctypes.c_void_p),
        ("ring_dev", ctypes.c_uint64),
        ("error_step", ctypes.c_int32),
        ("trace", ctypes.c_int32),
        ("trace_ns", ctypes.c_int64 * 8),
        # one post's arguments (kvl_post_call): written through :meth:`call_args`, read by the C side
        ("kernels", ctypes.c_void_p),
        ("nkernels", ctypes.c_int64),
        ("slot", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("pad", ctypes.c_int64),
        ("src_limit", ctypes.c_int64),
        ("dst_limit", ctypes.c_int64),
        ("caller", ctypes.c_void_p),
        ("start", ctypes.c_void_p),
        ("end", ctypes.c_void_p),
        ("on_copy_stream", ctypes.c_int64),
    ]

    TRACE_STAGES = ("check_ids", "copy_ids", "order_streams", "start_event", "launch", "end_event")

    CALL_FIELDS = ("kernels", "nkernels", "slot", "n", "pad", "src_limit", "dst_limit", "caller", "start", "end",
                   "on_copy_stream")

    def call_args(self) -> Any:
        """The post's argument fields as one int64 numpy array over this structure's memory (an item write costs
        less than a ctypes field write or a converted call argument). Order: :attr:`CALL_FIELDS`."""
        import numpy as np

        first = getattr(PosterDesc, self.CALL_FIELDS[0]).offset
        # a ctypes Structure exports the buffer protocol; numpy's stubs name only the builtin buffer types
        return np.frombuffer(self, dtype=np.int64, count=len(self.CALL_FIELDS), offset=first)  # type: ignore[call-overload]


class KernelList:
    """The kernels of one launch (one per region group), as the ``kvl_kernel **`` the C post takes."""

    __slots__ = ("address", "array", "count", "descs", "inline_count")

    def __init__(self, descs: list[KernelDesc]) -> None:
        if not 0 < len(descs) <= MAX_KERNELS:
            raise ValueError(f"{len(descs)} kernels per post (1..{MAX_KERNELS})")
        inline = {d.inline_count if d.inline_param >= 0 else 0 for d in descs}
        if len(inline) != 1:
            raise ValueError("a post's kernels all take their ids inline, or none does")
        self.inline_count = inline.pop()  # > 0: ids are launch parameters, at most this many pairs
        self.descs = descs  # keeps the structures alive
        self.array = (ctypes.c_void_p * len(descs))(*(ctypes.addressof(d) for d in descs))
        self.count = len(descs)
        self.address = ctypes.addressof(self.array)


_lock = threading.Lock()
_loaded: Any = None
_why_not: str | None = None


def why_not() -> str | None:
    """Why :func:`load` returned ``None`` (``None`` when it loaded, or was not tried yet)."""
    return _why_not


def _cache_dir() -> Path:
    root = envvars.CACHE_DIR.read() or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                    "kvlifecycle")
    return Path(root) / "native"


def build(source: Path = SOURCE, out_dir: Path | None = None) -> Path:
    """Compile ``source`` into a shared library (cached by content hash) and return its path."""
    text = source.read_bytes()
    cc = os.environ.get("CC") or "cc"
    key = hashlib.sha256(text + cc.encode()).hexdigest()[:16]
    out_dir = out_dir or _cache_dir()
    target = out_dir / f"kvl_native_post_{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        # -fno-strict-aliasing: the parameter slots are read by the driver through void pointers
        cmd = [cc, "-O2", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing", "-o", tmp, str(source), "-ldl"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if res.returncode != 0:
            raise OSError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: concurrent builders never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    lib.kvl_init.argtypes, lib.kvl_init.restype = [], ctypes.c_int
    lib.kvl_kernel_bind.argtypes, lib.kvl_kernel_bind.restype = [vp], None
    lib.kvl_check_and_narrow.argtypes = [vp, vp, i32, i32, i64, i64]
    lib.kvl_check_and_narrow.restype = ctypes.c_int
    # check_inline(staging, kernels, nkernels, n, pad, src_limit, dst_limit)
    lib.kvl_check_inline.argtypes = [vp, vp, i32, i32, i32, i64, i64]
    lib.kvl_check_inline.restype = ctypes.c_int
    # post(poster, kernels, nkernels, slot, n, pad, src_limit, dst_limit, caller, start, end, on_copy_stream)
    lib.kvl_post.argtypes = [vp, vp, i32, i32, i32, i32, i64, i64, vp, vp, vp, i32]
    lib.kvl_post.restype = ctypes.c_int
    lib.kvl_post_call.argtypes, lib.kvl_post_call.restype = [vp], ctypes.c_int


def load_library(*, init_cuda: bool = True) -> ctypes.CDLL:
    """Build (if needed) and load the library; ``init_cuda`` resolves the driver functions (raises without
    libcuda). Without ``init_cuda`` only the pure helpers (:func:`check_and_narrow`) may be called."""
    # PyDLL: the calls keep the GIL. A post never blocks (short of a full launch queue), and a release around it
    # would let any other Python thread (the settler, a log syncer) take the GIL in the middle of a request's
    # latency path: a thread switch costs more than the whole post.
    lib = ctypes.PyDLL(str(build()))
    _declare(lib)
    if init_cuda:
        rc = lib.kvl_init()
        if rc != 0:
            raise OSError(f"kvl_init: libcuda.so.1 {'not loadable' if rc == -1 else 'lacks a driver function'}")
    return lib


def triton_version() -> str | None:
    """The installed Triton's version (``None`` without Triton)."""
    try:
        import triton
    except ImportError:
        return None
    return str(getattr(triton, "__version__", "")) or None


def triton_mismatch() -> str | None:
    """Why the installed Triton rules the compiled post out (``None`` when it is one the binding was checked on)."""
    version = triton_version()
    if version is None:
        return "Triton is not installed"
    if version not in CHECKED_TRITON_VERSIONS:
        checked = ", ".join(CHECKED_TRITON_VERSIONS)
        return f"Triton {version} is not a version its launcher binding was checked on ({checked})"
    return None


def load() -> ctypes.CDLL | None:
    """The compiled post, or ``None`` (see :func:`why_not`); built and loaded once per process."""
    global _loaded, _why_not
    if _loaded is not None or _why_not is not None:
        return _loaded
    with _lock:
        if _loaded is not None or _why_not is not None:
            return _loaded
        mismatch = triton_mismatch()
        if mismatch is not None:
            _why_not = mismatch
            log.warning("cuda_ipc: compiled post off, posting from Python: %s", mismatch)
            return None
        try:
            _loaded = load_library()
        except (OSError, subprocess.SubprocessError) as exc:
            _why_not = str(exc)
            log.warning("cuda_ipc: compiled post unavailable, posting from Python: %s", exc)
        return _loaded


def bind_kernel(compiled: Any, args: tuple[Any, ...], *, chunks: int, grid_y: int, lib: ctypes.CDLL,
                src_ids_arg: int = -1, dst_ids_arg: int = -1, inline_ids_arg: int = -1,
                inline_count: int = 0) -> KernelDesc | None:
    """A :class:`KernelDesc` for ``compiled`` launched with ``args`` (every kernel argument, constexprs included,
    in order), or ``None`` where Triton's launcher must stay. Per post the C side fills either the two id pointers
    (arguments ``src_ids_arg`` and ``dst_ids_arg``) or, for an inline-ids kernel, ``inline_count`` source ids
    from argument ``inline_ids_arg`` on, then as many destination ids (int32 each)."""
    inline = inline_ids_arg >= 0
    if inline == (src_ids_arg >= 0 or dst_ids_arg >= 0) or (not inline and min(src_ids_arg, dst_ids_arg) < 0):
        raise ValueError("bind_kernel: give the two id pointer arguments, or the first inline id argument")
    src = getattr(compiled, "src", None)
    meta = getattr(compiled, "metadata", None)
    signature = getattr(src, "signature", None)
    function = getattr(compiled, "function", None)
    if not isinstance(signature, dict) or meta is None or not function:
        return None
    if (getattr(meta, "num_ctas", 1) != 1 or getattr(meta, "launch_pdl", False)
            or getattr(meta, "launch_cooperative_grid", False) or getattr(meta, "global_scratch_size", 1)
            or getattr(meta, "profile_scratch_size", 1) or getattr(meta, "tensordesc_meta", None)):
        return None
    types = list(signature.values())
    if len(types) != len(args):
        return None
    desc = KernelDesc()
    desc.src_ids_param = desc.dst_ids_param = desc.inline_param = -1
    slot = 0
    for i, (ty, value) in enumerate(zip(types, args, strict=True)):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str) or not (ty.startswith("*") or ty in _INT_TYPES) or slot >= MAX_PARAMS - 2:
            return None
        if i == src_ids_arg:
            desc.src_ids_param = slot
        elif i == dst_ids_arg:
            desc.dst_ids_param = slot
        elif i == inline_ids_arg:
            desc.inline_param = slot
        desc.slots[slot] = int(value) & 0xFFFF_FFFF_FFFF_FFFF  # two's complement, read little-endian
        slot += 1
    if inline:
        # the ids must be 2 * inline_count consecutive int32 parameters (values the compiled post writes)
        if types[inline_ids_arg:inline_ids_arg + 2 * inline_count] != ["i32"] * (2 * inline_count):
            return None
        desc.inline_count = inline_count
    elif types[src_ids_arg] == "constexpr" or types[dst_ids_arg] == "constexpr":
        return None
    desc.slots[slot] = 0  # global scratch (none: checked above)
    desc.slots[slot + 1] = 0  # profile scratch
    desc.nparams = slot + 2
    desc.function = int(function)
    desc.chunks, desc.grid_y = chunks, grid_y
    desc.block_x = 32 * int(meta.num_warps)
    desc.shared = int(meta.shared)
    lib.kvl_kernel_bind(ctypes.addressof(desc))
    return desc
