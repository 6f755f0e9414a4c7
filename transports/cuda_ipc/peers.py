"""Connecting to a peer: map its exported allocations into this process once (IPC-open, or by address for a peer
in this process), translate its regions, copy its probe through the mapping; and unmap it again."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvlifecycle.transport import KVLayout, PeerMetadata, RemoteMismatchError, TransferFailedError, TransportError

from .driver import CudaDriver
from .triton_copy import BlockCopier, RegionSpec
from .wire import CudaIpcBlob

log = logging.getLogger("kvlifecycle.transports.cuda_ipc")


@dataclass(slots=True)
class Peer:
    """A mapped peer: its layout as it sees it and as this process reaches it, what to close, its probe."""

    name: str
    epoch: int
    layout: KVLayout  # as the peer sees it
    mapped: KVLayout  # the same regions at addresses this process can use
    opened: list[int]  # IPC mappings to close
    dealer: Any  # ZMQ socket to the peer's side channel
    same_process: bool
    probe: tuple[int, int, int]  # the peer's probe buffer (local address, bytes, pattern seed)
    self_test_s: float = 0.0
    self_test_gbps: float = 0.0


def map_peer(driver: CudaDriver, torch: Any, device: Any, context: Callable[[], Any], meta: PeerMetadata,
             blob: CudaIpcBlob, remote: KVLayout) -> Peer:
    """Translate the peer's addresses into this process: IPC-open each allocation once."""
    same_process = blob.pid == os.getpid()
    opened: list[int] = []
    table: list[tuple[int, int, int]] = []  # (remote base, size, local base)
    with torch.cuda.device(device):
        if same_process and blob.device_id != device.index:
            # One process, two GPUs: its own pointers, reachable once peer access is on (else refused here,
            # where selection falls back, rather than as an illegal address inside the self-test's kernel).
            try:
                with context():  # a service thread (a connector's) may have no context current
                    driver.enable_peer_access(device.index, blob.device_id)
            except TransportError as exc:
                raise RemoteMismatchError(f"{meta.agent}: cannot reach GPU {blob.device_id}: {exc}") from exc
        try:
            with context():  # cuIpcOpenMemHandle needs a current context: the connector's thread may have none
                for alloc in blob.allocations:
                    local = alloc.base if same_process else driver.open(alloc.handle)
                    if not same_process:
                        opened.append(local)
                    table.append((alloc.base, alloc.size, local))
        except TransportError as exc:
            for ptr in opened:
                driver.close(ptr)
            raise RemoteMismatchError(f"{meta.agent}: cannot map its memory: {exc}") from exc

    def translate(addr: int, nbytes: int) -> int:
        for base, size, local in table:
            if base <= addr and addr + nbytes <= base + size:
                return local + (addr - base)
        raise RemoteMismatchError(f"{meta.agent}: region {addr:#x}+{nbytes} is in no exported allocation")

    try:
        mapped = KVLayout(remote.kind, device.index, remote.num_blocks,
                          tuple(translate(a, n) for a, n in zip(remote.base_addrs, remote.region_bytes,
                                                                strict=True)),
                          remote.block_bytes)
        probe = translate(blob.probe_addr, blob.probe_bytes)
    except RemoteMismatchError:
        for ptr in opened:
            driver.close(ptr)
        raise
    return Peer(meta.agent, meta.epoch, remote, mapped, opened, None, same_process,
                 (probe, blob.probe_bytes, blob.probe_seed))


def probe_copy(torch: Any, device: Any, stream: Any, peer: Peer, copier_kwargs: dict[str, Any],
               timeout_s: float = 5.0) -> tuple[float, np.ndarray]:
    """One timed copy of the peer's probe into local scratch; returns (seconds, the bytes read)."""
    addr, nbytes, _seed = peer.probe
    scratch = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    copier = BlockCopier([RegionSpec(addr, nbytes, 1, nbytes)], [RegionSpec(scratch.data_ptr(), nbytes, 1, nbytes)],
                         device, **copier_kwargs)
    ids = torch.zeros(1, dtype=torch.int32, device=device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        copier.copy(ids, ids)  # compile / warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        scratch.zero_()
        start.record()
        copier.copy(ids, ids)
        end.record()
    deadline = time.monotonic() + timeout_s
    while not end.query():
        if time.monotonic() > deadline:
            raise TransferFailedError(f"{peer.name}: probe copy did not finish in {timeout_s} s")
        time.sleep(1e-4)
    return start.elapsed_time(end) / 1e3, scratch.cpu().numpy()


def unmap_peer(driver: CudaDriver, torch: Any, device: Any, peer: Peer) -> None:
    """Close the peer's IPC mappings and its notification socket."""
    with torch.cuda.device(device):
        for ptr in peer.opened:
            try:
                driver.close(ptr)
            except TransportError as exc:
                log.warning("cuda_ipc: unmapping %s: %s", peer.name, exc)
    peer.opened = []
    if peer.dealer is not None:
        peer.dealer.close(0)
        peer.dealer = None
