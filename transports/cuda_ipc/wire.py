"""What a CUDA IPC endpoint tells its peer (the ``blob`` of its :class:`~kvlifecycle.transport.PeerMetadata`), the
side channel's notification header, and the two facts a peer checks before mapping: the node identity and the
probe pattern."""

from __future__ import annotations

import socket

import msgspec
import numpy as np

NAME = "cuda_ipc"
PROBE_BYTES = 1 << 16


class AllocationWire(msgspec.Struct, frozen=True, array_like=True):
    handle: bytes
    base: int
    size: int


class CudaIpcBlob(msgspec.Struct, frozen=True):
    """This transport's part of :class:`PeerMetadata` (``blob``)."""

    host: str  # node identity: boot id + hostname; IPC only between equal hosts
    pid: int
    device_uuid: str
    device_id: int
    endpoint: str  # the side channel (ZMQ ROUTER) for notifications
    allocations: list[AllocationWire]
    probe_addr: int
    probe_bytes: int
    probe_seed: int  # the probe holds probe_pattern(probe_seed)


blob_encoder = msgspec.msgpack.Encoder()
blob_decoder = msgspec.msgpack.Decoder(CudaIpcBlob)
header_decoder = msgspec.msgpack.Decoder(tuple[str, int])


def node_identity() -> str:
    """Boot id + hostname: two processes with the same value share a kernel, hence GPUs and IPC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{boot}@{socket.gethostname()}"


def probe_pattern(epoch: int, nbytes: int = PROBE_BYTES) -> np.ndarray:
    """Bytes the exporter writes into its probe buffer; the peer recomputes them to check what it read."""
    seed = np.uint64(epoch & 0xFFFFFFFF)
    idx = np.arange(nbytes, dtype=np.uint64)
    return ((idx * np.uint64(2654435761) + seed) >> np.uint64(7)).astype(np.uint8)


