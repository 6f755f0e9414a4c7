"""Backend selection, plugin verification, and the connect-time probe (real NIXL, DRAM)."""

from __future__ import annotations

import logging
import time

import pytest
from kvlifecycle.transports import select
from transport_conformance import kv_tensors, layout_of

from kvlifecycle.transport import BackendUnavailableError, Locality, MemoryKind


def test_same_process_picks_loopback() -> None:
    s = select.choose("DRAM", "VRAM", "same_process")
    assert (s.transport, s.backend) == ("loopback", None)


def test_nixl_backend_follows_preference_and_availability() -> None:
    s = select.choose(MemoryKind.VRAM, MemoryKind.VRAM, Locality.REMOTE, prefer=("LIBFABRIC", "UCX"),
                      available=["UCX", "POSIX"])
    assert (s.transport, s.backend) == ("nixl", "UCX")
    with pytest.raises(BackendUnavailableError):
        select.choose("DRAM", "DRAM", "same_node", prefer=("LIBFABRIC",), available=["UCX"])


@pytest.mark.nixl
def test_verify_and_probe_with_real_nixl(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("nixl._api")
    from kvlifecycle.transports.nixl import NixlTransport

    suffix = time.monotonic_ns()
    a, b = NixlTransport(f"sel-a-{suffix}"), NixlTransport(f"sel-b-{suffix}")
    ta, tb = kv_tensors("random"), kv_tensors("zeros")
    try:
        a.register(layout_of(ta))
        b.register(layout_of(tb))
        peer = b.add_peer(a.local_metadata())
        s = select.choose("DRAM", "DRAM", "same_node", available=b.loaded_backends())
        select.verify_backend(b, s)
        with pytest.raises(BackendUnavailableError):
            select.verify_backend(b, select.Selection("nixl", "GDS", MemoryKind.DRAM, MemoryKind.DRAM,
                                                      Locality.SAME_NODE, "not loaded"))
        seen = []
        select.add_listener(lambda sel, probe: seen.append((sel, probe)))
        with caplog.at_level(logging.WARNING, logger="kvlifecycle.transports.select"):
            result = select.probe_and_report(b, peer, s, floor_gbps=1e9)  # an unreachable floor: must warn
        assert result is not None and result.bytes > 0 and result.backend == "UCX"
        assert any("below the floor" in r.message for r in caplog.records)
        assert seen and seen[-1][1] is result
        assert all(int(t.sum()) == 0 for t in tb)  # the probe never touches KV blocks
    finally:
        select._listeners.clear()
        a.close()
        b.close()


def test_same_node_vram_picks_cuda_ipc_and_everything_else_does_not() -> None:
    s = select.choose("VRAM", "VRAM", "same_node")
    assert (s.transport, s.backend) == ("cuda_ipc", "triton")
    assert select.choose("VRAM", "VRAM", "same_node", cuda_ipc=False).transport == "nixl"
    assert select.choose("VRAM", "DRAM", "same_node").transport == "nixl"
    assert select.choose("VRAM", "VRAM", "remote").transport == "nixl"
