"""Backend selection, plugin verification, and the connect-time probe (real NIXL, DRAM)."""

from __future__ import annotations

import logging
import time

import pytest
from kvlifecycle.transports import select

from kvlifecycle.testing.transport_conformance import BLOCKS, REGIONS, HostBuffers
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
    ta, tb = HostBuffers("random"), HostBuffers("zeros")
    seen: list[tuple[select.Selection, object]] = []
    listener = lambda sel, probe: seen.append((sel, probe))  # noqa: E731
    try:
        a.register(ta.layout)
        b.register(tb.layout)
        peer = b.add_peer(a.local_metadata())
        s = select.choose("DRAM", "DRAM", "same_node", available=b.loaded_backends())
        select.verify_backend(b, s)
        with pytest.raises(BackendUnavailableError):
            select.verify_backend(b, select.Selection("nixl", "GDS", MemoryKind.DRAM, MemoryKind.DRAM,
                                                      Locality.SAME_NODE, "not loaded"))
        select.add_listener(listener)
        with caplog.at_level(logging.WARNING, logger="kvlifecycle.transports.select"):
            result = select.probe_and_report(b, peer, s, floor_gbps=1e9)  # an unreachable floor: must warn
        assert result is not None and result.bytes > 0 and result.backend == "UCX"
        assert any("below the floor" in r.message for r in caplog.records)
        assert seen and seen[-1][1] is result
        assert all(int(tb.blocks(r, range(BLOCKS)).sum()) == 0 for r in range(REGIONS))  # the probe never touches KV
    finally:
        select.remove_listener(listener)
        a.close()
        b.close()


def test_same_node_vram_picks_cuda_ipc_and_everything_else_does_not() -> None:
    s = select.choose("VRAM", "VRAM", "same_node")
    assert (s.transport, s.backend) == ("cuda_ipc", "triton")
    assert select.choose("VRAM", "VRAM", "same_node", cuda_ipc=False).transport == "nixl"
    assert select.choose("VRAM", "DRAM", "same_node").transport == "nixl"
    assert select.choose("VRAM", "VRAM", "remote").transport == "nixl"


def test_the_consumers_path_selectors_keep_the_primary_unless_the_fast_path_qualifies() -> None:
    """The core's default selector picks nothing; the transports' same-node selector selects nothing without a
    registered fast path, and refuses one over DRAM (with the reason kept for the link)."""
    from kvlifecycle.transports.loopback import LoopbackTransport

    from kvlifecycle.path_selection import PRIMARY_PATH, DataPath, PathSelector

    suffix = time.monotonic_ns()
    primary, fast = LoopbackTransport(f"primary-{suffix}"), LoopbackTransport(f"fast-{suffix}")
    buffers = HostBuffers("zeros")
    try:
        assert isinstance(select.SameNodeSelector(), PathSelector) and isinstance(PRIMARY_PATH, PathSelector)
        assert PRIMARY_PATH.select(primary, fast, None) == DataPath(primary)
        assert select.SameNodeSelector().select(primary, None, None) == DataPath(primary)
        assert select.SameNodeSelector().select(primary, fast, None) == DataPath(primary)  # fast not registered
        fast.register(buffers.layout)
        path = select.SameNodeSelector().select(primary, fast, fast.local_metadata())
        assert path.transport is primary and path.peer == ""
        assert path.choice is not None and path.choice.backend == "loopback" and "not VRAM" in path.choice.reason
    finally:
        primary.close()
        fast.close()


def test_the_fast_path_helper_builds_nothing_for_dram_and_one_warning_when_cuda_ipc_cannot_be_built(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The adapters' one helper (vLLM and SGLang): DRAM needs no fast path; VRAM it cannot map (no CUDA here, or
    memory that cannot be exported) is one warning, and NIXL alone moves the bytes."""
    from kvlifecycle.transport import KVLayout

    logger = logging.getLogger("kvlifecycle.test.fast_path")
    caplog.set_level(logging.WARNING, logger=logger.name)
    dram = KVLayout(MemoryKind.DRAM, 0, 4, (0x1000,), (256,))
    assert select.cuda_ipc_fast_path(dram, "a-ipc", logger=logger, who="engine") is None and not caplog.records
    vram = KVLayout(MemoryKind.VRAM, 0, 4, (0x1000,), (256,))  # not a real allocation: never exportable
    assert select.cuda_ipc_fast_path(vram, "a-ipc", logger=logger, who="engine") is None
    assert [r.getMessage().split(":")[0:2] for r in caplog.records] == [["engine", " no CUDA IPC fast path, NIXL only"]]


def test_a_layout_with_a_host_memory_group_is_split_or_left_to_nixl_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """SGLang on a GPU: VRAM pages, host-memory aux rows. The fast path for them is a split transport (CUDA IPC over
    the pages, NIXL over the rows: tests/transports/test_nixl_mixed_kinds.py builds one over real memory). These
    addresses are no allocation (and on CPU there is no CUDA): none is built, one warning says why, the engine keeps
    NIXL, and no part is left open."""
    from kvlifecycle import layout as L

    pages = L.rows_layout("VRAM", 0, [1 << 30, 2 << 30], [4096 * 8] * 2, [4096] * 2)
    rows = L.rows_layout("DRAM", 0, [1 << 20], [64 * 4], [64])
    log = logging.getLogger("test.select")
    with caplog.at_level(logging.WARNING, logger="test.select"):
        assert select.cuda_ipc_fast_path(L.grouped_layout(pages, rows), "a-ipc", logger=log, who="engine") is None
    assert [r.getMessage().split(":")[0:2] for r in caplog.records] == [["engine", " no CUDA IPC fast path, NIXL only"]]
