"""Every name ``bench gpu`` takes from the CUDA IPC transport and its copy kernel, in one place.

The benchmark times the transport from outside and reads a few of its internals to split a request's wall
(the mapped peer regions, the driver binding, the compiled post's stamps): when the transport's modules move or
its internals change, this module is the one to follow them. Imported lazily by the others, as it was before the
benchmark became a package: ``kvlifecycle bench --help`` loads no transport.
"""

from __future__ import annotations

from typing import Any

from kvlifecycle.transports.cuda_ipc import REGION_GROUP_HOST_IDS, CudaIpcTransport
from kvlifecycle.transports.cuda_ipc.triton_copy import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_NUM_WARPS,
    BlockCopier,
    RegionSpec,
    _RawCudaArray,
)

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_NUM_WARPS", "REGION_GROUP_HOST_IDS", "BlockCopier", "CudaIpcTransport",
           "RegionSpec", "compiled_post_bound", "done_at", "driver", "forget_subset_launches", "launched_at",
           "mapped_base_addrs", "raw_cuda_array", "stage_marks", "trace_stages", "transfer_stream"]


def raw_cuda_array(addr: int, shape: tuple[int, ...], strides: tuple[int, ...]) -> Any:
    """A device address as an object torch can view (``__cuda_array_interface__``)."""
    return _RawCudaArray(addr, shape, strides)


def trace_stages(transport: CudaIpcTransport) -> None:
    """Per-stage post times (recorded after the launch, so off the latency path)."""
    transport._trace = True


def mapped_base_addrs(transport: CudaIpcTransport, peer: str) -> Any:
    """P's regions as this process sees them, for the byte check."""
    return transport._peers[peer].mapped.base_addrs


def driver(transport: CudaIpcTransport) -> Any:
    return transport._driver


def compiled_post_bound(transport: CudaIpcTransport, plan: Any) -> bool:
    whole = transport._plans[plan.key].whole
    return whole is not None and whole.native_read is not None


def launched_at(transport: CudaIpcTransport, handle_id: Any, default: float) -> float:
    """When the post launched the copy of ``handle_id`` (``default`` when it did not stamp it)."""
    flight = transport._inflight.get(handle_id)
    return flight.t_launched if flight is not None and flight.t_launched else default


def stage_marks(transport: CudaIpcTransport) -> Any:
    """The compiled post's own stamps of its last call (traced)."""
    return transport._stage_marks


def done_at(transport: CudaIpcTransport, handle_id: Any) -> float:
    """When the transport saw the copy of ``handle_id`` complete."""
    return transport._handles.live[handle_id].t_done


def transfer_stream(transport: CudaIpcTransport) -> Any:
    """The torch stream the transport's copies run on: an event recorded there after a post marks the copy's end."""
    return transport._stream


def forget_subset_launches(transport: CudaIpcTransport, plan: Any) -> None:
    """Drop the launches the plan keeps per region list: the next post of a subset rebuilds its launch (the A/B)."""
    transport._plans[plan.key].launches.clear()
