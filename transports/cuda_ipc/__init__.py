"""Same-node GPU fast path: a CUDA IPC transport whose transfers are one batched block-copy kernel.

Why it is shaped this way:
- P's (and D's) KV regions are exported **once**, at :meth:`~CudaIpcTransport.register`, as CUDA IPC handles of
  the allocations that hold them (``cuIpcGetMemHandle``; one handle per allocation, however many regions it holds).
  The peer maps them **once**, at :meth:`~CudaIpcTransport.add_peer`, and drops the mapping when the peer's agent
  epoch changes (a restarted peer's old handles are never used, vLLM #49238).
- A transfer is one launch of :mod:`.triton_copy`'s kernel over every (region × block) pair
  on the transport's own stream; nothing is prepared per block (vLLM #55434: 90k–120k descriptors per transfer on
  cuda_ipc, posting 57 % of the transfer time). Its completion handle is a CUDA event: :meth:`poll` asks
  ``event.query()`` and never blocks.
- Pull (``READ``: local ← peer) and push (``WRITE``: peer ← local) both run on the side that posts.
- Notifications (``done`` after a copy, or the caller's own) go over a small ZMQ side channel bound on 127.0.0.1:
  the notification a post carries is sent when :meth:`poll` (or any progress call) first sees the copy's event
  complete, never earlier. The caller releases a source lease only then, so the P allocator cannot hand a block
  out while a kernel still reads it.
- At connect the peer runs a self-test: it copies the exporter's probe buffer (a pattern derived from its agent
  epoch) through the mapping with the same kernel and compares the bytes. :class:`CudaIpcPath` takes a peer only
  when it passes, and the selector falls back to NIXL otherwise.
- A peer in the same process is reached by address (CUDA cannot IPC-open a handle in the exporting process).
- A D process that dies while mapped leaves P's memory untouched; P reclaims its pinned blocks by lease expiry.

Modules, in reading order: :mod:`.options` (every knob, read from the environment once), :mod:`.wire` (what a
peer is told), :mod:`.driver` (the CUDA driver through ctypes), :mod:`.triton_copy` (the kernel),
:mod:`.plans` (regions grouped into launches), :mod:`.ids` (block ids checked and staged), :mod:`.post` (the
compiled and the Python post), :mod:`.native_post` + ``_native_post.c`` (the compiled post itself),
:mod:`.peers` (mapping a peer), :mod:`.notify` (the notification side channel), :mod:`.transport` (the transport)
and :mod:`.selection` (when to use it).
"""

from __future__ import annotations

from typing import Any

from .options import HOST_IDS_DEFAULT, REGION_GROUP_HOST_IDS, CudaIpcOptions
from .selection import Choice, CudaIpcPath, SplitCudaIpcPath, cuda_ipc_possible, select_same_node
from .wire import NAME, PROBE_BYTES, AllocationWire, CudaIpcBlob, node_identity, probe_pattern

__all__ = [
    "HOST_IDS_DEFAULT",
    "NAME",
    "PROBE_BYTES",
    "REGION_GROUP_HOST_IDS",
    "AllocationWire",
    "Choice",
    "CudaDriver",
    "CudaIpcBlob",
    "CudaIpcOptions",
    "CudaIpcPath",
    "CudaIpcTransport",
    "SplitCudaIpcPath",
    "cuda_ipc_possible",
    "node_identity",
    "probe_pattern",
    "select_same_node",
]

# The transport and the driver binding load torch / libcuda only when used: importing the package (for the
# selection policy, the wire format or the options) stays light.
_LAZY = {"CudaIpcTransport": ".transport", "CudaDriver": ".driver"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module, __name__), name)
