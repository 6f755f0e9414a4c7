"""Fixtures for the multi-host tests: hosts as network namespaces, a real etcd, workers inside the hosts.

They need root (namespaces), ``ip``, the ``etcd`` binary (scripts/setup-etcd.sh) and the etcd client
(``kvlifecycle[etcd]``). Without one of them they skip, unless KVL_REQUIRE_ALL=1 (CI), where they fail. Leftovers of
an earlier run that died (namespaces named ``kvl-<its pid>-...``) are swept first; everything made here is
removed at the end, also when a test fails.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import etcd_harness as eh
import netns_harness as nh
import pytest


def _require(reason: str | None) -> None:
    if reason is None:
        return
    if os.environ.get("KVL_REQUIRE_ALL") == "1":
        pytest.fail(f"{reason} [KVL_REQUIRE_ALL=1: not skipping]")
    pytest.skip(reason)


def require_multihost() -> None:
    _require(nh.unavailable_reason())
    _require(None if eh.etcd_binary() else "the etcd binary is missing: run scripts/setup-etcd.sh")
    _require(None if importlib.util.find_spec("pyetcd") else "the etcd client is missing: pip install -e '.[etcd]'")


@pytest.fixture(scope="session")
def swept() -> list[str]:
    require_multihost()
    return nh.sweep_leftovers() + eh.sweep_leftovers()


@pytest.fixture
def local_etcd(tmp_path: Path, swept: list[str]) -> Iterator[eh.EtcdServer]:
    """etcd on 127.0.0.1 (random ports), for the membership tests that need no second host."""
    server = eh.EtcdServer(tmp_path / "etcd", client_port=eh.free_port(), peer_port=eh.free_port())
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def cluster(swept: list[str]) -> Iterator[nh.Cluster]:
    with nh.cluster() as c:
        yield c
