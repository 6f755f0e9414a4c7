"""The CUDA IPC transport's options: one frozen, validated object, read from the environment in one place
(:meth:`CudaIpcOptions.from_env`) and passed down; no class of the transport reads the environment.

| variable | option | default |
| --- | --- | --- |
| ``KVL_CUDA_IPC_HOST_IDS`` | ``host_ids``: the kernel reads block ids from pinned host memory | 0 |
| ``KVL_CUDA_IPC_REGION_GROUP`` | ``region_group``: regions one program copies | 8 with host ids, else 1 |
| ``KVL_CUDA_IPC_INLINE_IDS`` | ``inline_ids``: small requests pass their ids as launch parameters | 1 |
| ``KVL_CUDA_IPC_TRACE`` | ``trace``: per-stage host times of each post (``stage_times``) | 0 |
| ``KVL_NATIVE_POST`` | ``compiled_post``: post through ``_native_post.c`` where it builds | 1 |
| ``KVL_TRITON_FAST_LAUNCH`` | ``fast_launch``: launch the warm kernel without Triton's JIT | 1 |
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Measured on an H200 (docs/gpu.md): a kernel reading the ids from pinned host memory over PCIe ran at 0.74x of
# the ceiling (512 MiB) against 0.93x with the ids copied to the device first, so the copy stays the default.
HOST_IDS_DEFAULT = False
REGION_GROUP_HOST_IDS = 8  # with ids in host memory, each program reads them once for 8 regions

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    raw = environ.get(name, "").strip().lower()
    if not raw:
        return None
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r}: expected 0 or 1")


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None


@dataclass(frozen=True, slots=True)
class CudaIpcOptions:
    """How a :class:`~kvlifecycle.transports.cuda_ipc.CudaIpcTransport` stages ids, launches and reports.

    ``None`` for a copier knob (``chunk_bytes``, ``num_warps``, ``use_triton``) keeps the kernel's own default;
    ``region_group=None`` means :data:`REGION_GROUP_HOST_IDS` with host ids, else 1."""

    self_test: bool = True  # copy the peer's probe through the mapping at connect, bytes checked
    bind_host: str = "127.0.0.1"  # the notification side channel's address
    host_ids: bool = HOST_IDS_DEFAULT
    region_group: int | None = None
    inline_ids: bool = True
    trace: bool = False
    compiled_post: bool = True
    fast_launch: bool = True
    chunk_bytes: int | None = None
    num_warps: int | None = None
    use_triton: bool | None = None

    def __post_init__(self) -> None:
        for name in ("region_group", "chunk_bytes", "num_warps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"CudaIpcOptions.{name} must be a positive integer, got {value!r}")
        for name in ("self_test", "host_ids", "inline_ids", "trace", "compiled_post", "fast_launch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"CudaIpcOptions.{name} must be a bool, got {getattr(self, name)!r}")
        if self.use_triton is not None and not isinstance(self.use_triton, bool):
            raise TypeError(f"CudaIpcOptions.use_triton must be a bool or None, got {self.use_triton!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> CudaIpcOptions:
        """The options from the environment (``os.environ`` unless given), the keyword arguments over them; a value
        that is not 0/1 (or an integer, for the region group) is refused with the variable's name."""
        env = os.environ if environ is None else environ
        read = {
            "host_ids": _flag(env, "KVL_CUDA_IPC_HOST_IDS"),
            "region_group": _int(env, "KVL_CUDA_IPC_REGION_GROUP"),
            "inline_ids": _flag(env, "KVL_CUDA_IPC_INLINE_IDS"),
            "trace": _flag(env, "KVL_CUDA_IPC_TRACE"),
            "compiled_post": _flag(env, "KVL_NATIVE_POST"),
            "fast_launch": _flag(env, "KVL_TRITON_FAST_LAUNCH"),
        }
        values: dict[str, Any] = {k: v for k, v in read.items() if v is not None}  # field name -> value
        values.update({k: v for k, v in given.items() if v is not None})
        return cls(**values)

    def replace(self, **changes: Any) -> CudaIpcOptions:
        """A copy with ``changes`` (``None`` values are ignored: they mean "keep")."""
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None})

    @property
    def effective_region_group(self) -> int:
        if self.region_group is not None:
            return self.region_group
        return REGION_GROUP_HOST_IDS if self.host_ids else 1

    def copier_kwargs(self) -> dict[str, Any]:
        """What every :class:`~kvlifecycle.transports.cuda_ipc.triton_copy.BlockCopier` of the transport is built
        with."""
        out: dict[str, Any] = {"region_group": self.effective_region_group, "inline_ids": self.inline_ids,
                               "fast_launch": self.fast_launch, "compiled_post": self.compiled_post}
        for name in ("chunk_bytes", "num_warps", "use_triton"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        return out
