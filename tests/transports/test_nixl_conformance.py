"""The packaged conformance suite against real NIXL (UCX, DRAM), two agents in one process."""

from __future__ import annotations

import pytest

from kvlifecycle.testing.transport_conformance import TransportConformance

# a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")

from kvlifecycle.transports.nixl import NixlTransport

pytestmark = pytest.mark.nixl


class TestNixlConformance(TransportConformance):
    def make_transport(self, name: str) -> NixlTransport:
        return NixlTransport(name)

    def test_strided_lists_were_taken(self, pair) -> None:
        """This NIXL prepares the compressed (strided) lists: no silent fallback to one descriptor per block."""
        a, b, _, _, a_sees_b, b_sees_a = pair
        a.prepare(a_sees_b)
        b.prepare(b_sees_a)
        assert a._strided_ok and b._strided_ok


class TestNixlConformancePerBlockDescriptors(TransportConformance):
    """The same suite with one descriptor per (region, block): the form NIXL builds without strided lists."""

    def make_transport(self, name: str) -> NixlTransport:
        return NixlTransport(name, strided_descriptors=False)


def test_strided_lists_expand_to_exactly_the_per_block_descriptors() -> None:
    import numpy as np

    from kvlifecycle import layout as L
    from kvlifecycle.transport import WHOLE_BLOCK, BlockView, KVLayout, MemoryKind

    kv = KVLayout(MemoryKind.DRAM, 0, 5, (4096, 1 << 20, 1 << 24), (512, 512, 1024))
    for view in (WHOLE_BLOCK, BlockView(offset=256, length=256)):
        strided = L.block_descs_strided(kv, view)
        expanded = np.concatenate(
            [
                np.stack(
                    [
                        addr + stride * np.arange(count, dtype=np.uint64),
                        np.full(count, length, dtype=np.uint64),
                        np.full(count, dev, dtype=np.uint64),
                    ],
                    axis=1,
                )
                for addr, length, dev, stride, count in strided
            ]
        )
        assert np.array_equal(expanded, L.block_descs(kv, view))
    assert L.block_descs_strided(kv, BlockView(offset=0, length=128, split=2)) is None  # no strided form
