"""The public value and configuration types refuse a bad field where they are made, naming it, and the closed
sets refuse a misspelt member; the documented spellings keep working."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
from vllm_adapter_modules import load_vllm_adapter_module

from kvlifecycle.choices import LoadFailurePolicy, Side, TransferMode
from kvlifecycle.eventlog import FsyncMode, FsyncPolicy
from kvlifecycle.handoff import HandoffOptions
from kvlifecycle.ledger import SourceLedger, TargetLedger, open_ledger
from kvlifecycle.transport import BlockView, KVLayout, LayoutWire, MemoryKind

ROOT = Path(__file__).resolve().parents[1]


config = load_vllm_adapter_module("config")
LAYOUT = {"kind": MemoryKind.DRAM, "device_id": 0, "num_blocks": 4, "base_addrs": (4096, 8192),
          "block_bytes": (256, 256)}


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"num_blocks": -4}, ValueError, "num_blocks must be >= 1, got -4"),
        ({"num_blocks": 0}, ValueError, "num_blocks must be >= 1"),
        ({"num_blocks": 4.0}, TypeError, "num_blocks must be an integer"),
        ({"device_id": -1}, ValueError, "device_id must be >= 0"),
        ({"base_addrs": (4096, 8192.5)}, TypeError, r"base_addrs\[1\] must be an integer"),
        ({"block_bytes": (256, 0)}, ValueError, r"block_bytes\[1\] must be >= 1"),
        ({"block_bytes": (256,)}, ValueError, "one entry per region"),
        ({"base_addrs": (), "block_bytes": ()}, ValueError, "base_addrs needs one entry per region"),
        ({"kind": "HBM"}, ValueError, "HBM"),
    ],
)
def test_a_bad_layout_is_refused_naming_the_field(change: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        KVLayout(**{**LAYOUT, **change})


def test_a_layout_takes_lists_numpy_integers_and_spellings_and_stays_frozen() -> None:
    layout = KVLayout("DRAM", np.int64(0), np.int32(4), [4096, np.uint64(8192)], np.array([256, 256]))
    assert layout.kind is MemoryKind.DRAM and layout.base_addrs == (4096, 8192) and layout.num_regions == 2
    assert all(type(x) is int for x in (layout.device_id, layout.num_blocks, *layout.base_addrs, *layout.block_bytes))
    assert LayoutWire.of(layout).to_layout() == layout  # plain ints: msgspec encodes them
    assert layout == KVLayout(**LAYOUT) and hash(layout) == hash(KVLayout(**LAYOUT))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        layout.num_blocks = 8  # type: ignore[misc]
    assert not hasattr(layout, "__dict__")  # slotted


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"offset": -1}, "offset must be >= 0"),
        ({"length": -8}, "length must be >= 0"),
        ({"split": 0}, "split must be >= 1"),
    ],
)
def test_a_bad_block_view_is_refused_naming_the_field(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BlockView(**fields)


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"load_timeout_s": "60"}, TypeError, "load_timeout_s must be a number"),
        ({"service_poll_s": 0}, ValueError, "service_poll_s must be positive"),
        ({"heartbeat_every_s": -1.0}, ValueError, "heartbeat_every_s must be positive"),
        ({"port": 70000}, ValueError, "port must be a port number"),
        ({"secret": "s3cret"}, TypeError, "secret"),
        ({"probe": "yes"}, TypeError, "probe"),
        ({"on_connect": 3}, TypeError, "on_connect"),
    ],
)
def test_bad_handoff_options_are_refused_naming_the_field(fields: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        HandoffOptions(**fields)


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"lease_ttl_s": "30"}, TypeError, "lease_ttl_s must be a number, got '30'"),
        ({"lease_ttl_s": 0}, ValueError, "lease_ttl_s must be positive"),
        ({"side_channel_port": "5700"}, ValueError, "side_channel_port must be a port number"),
        ({"backends": 3}, TypeError, "backends"),
        ({"secret": 1234}, TypeError, "secret"),
        ({"mode": "pul"}, ValueError, "mode must be 'pull' or 'push', got 'pul'"),
        ({"fast_path": "cuda_ipc"}, ValueError, "fast_path must be 'auto' or 'off'"),
        ({"fsync": "sometimes"}, ValueError, "fsync policy must be"),
        ({"transport": "mooncake"}, ValueError, "nixl only"),
        ({"lease_tll_s": 3.0}, ValueError, "unknown kv_connector_extra_config key"),
        ({"etcd_endpoints": 2379}, TypeError, "etcd_endpoints"),
        ({"etcd_endpoints": "etcd-host"}, ValueError, "etcd_endpoints: etcd endpoint 'etcd-host' is not host:port"),
        ({"etcd_cluster": "a/b"}, ValueError, "etcd_cluster: cluster 'a/b'"),
        ({"etcd_cluster": 3}, TypeError, "etcd_cluster"),
        ({"etcd_lease_ttl_s": 1}, ValueError, "etcd_lease_ttl_s must be >= 2"),
        ({"etcd_lease_ttl_s": 5.0}, TypeError, "etcd_lease_ttl_s must be an integer"),
        ({"api_address": "10.0.0.1"}, ValueError, "api_address must be host:port"),
        ({"api_address": 8100}, TypeError, "api_address"),
        ({"drain_timeout_s": 0}, ValueError, "drain_timeout_s must be positive"),
        ({"verify": "every"}, ValueError, "verify must be"),
    ],
)
def test_a_bad_adapter_option_is_refused_naming_it(extra: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        config.AdapterConfig.from_extra(extra)


def test_adapter_options_parse_their_documented_spellings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_SIDE_CHANNEL_PORT", raising=False)
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "6200")
    cfg = config.AdapterConfig.from_extra({"mode": "push", "backends": "UCX", "fast_path": "off"})
    assert cfg.mode is TransferMode.PUSH and cfg.mode == "push"
    assert cfg.backends == ("UCX",) and cfg.fast_path is config.FastPath.OFF and cfg.side_channel_port == 6200
    assert config.AdapterConfig.from_extra({"backends": ["UCX", "GDS"]}).backends == ("UCX", "GDS")
    assert cfg.verify == "none" and config.AdapterConfig.from_extra({"verify": "all"}).verify == "all"


def test_the_etcd_endpoints_come_from_the_environment_when_the_option_is_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVL_ETCD_ENDPOINTS", raising=False)
    assert config.AdapterConfig.from_extra({}).etcd_endpoints == ()  # no etcd: no membership
    monkeypatch.setenv("KVL_ETCD_ENDPOINTS", "10.0.0.5:2379, 10.0.0.6:2379")
    assert config.AdapterConfig.from_extra({}).etcd_endpoints == ("10.0.0.5:2379", "10.0.0.6:2379")
    assert config.AdapterConfig.from_extra({"etcd_endpoints": ["h:1"]}).etcd_endpoints == ("h:1",)


def test_open_ledger_refuses_a_misspelt_side() -> None:
    with pytest.raises(ValueError, match="side must be 'source' or 'target', got 'sourc'"):
        open_ledger("sourc", 8)  # type: ignore[arg-type]
    assert isinstance(open_ledger("source", 8), SourceLedger)
    assert isinstance(open_ledger(Side.TARGET, 8), TargetLedger)


def test_the_failure_policy_and_transfer_mode_are_closed_sets() -> None:
    with pytest.raises(ValueError, match="failure_policy must be 'fail' or 'recompute', got 'recomptue'"):
        TargetLedger(8, failure_policy="recomptue")  # type: ignore[arg-type]
    d = TargetLedger(8, failure_policy="recompute")
    assert d.failure_policy is LoadFailurePolicy.RECOMPUTE and d.header()["failure_policy"] == "recompute"
    d.reserve("r", [0])
    with pytest.raises(ValueError, match="mode must be 'pull' or 'push', got 'psuh'"):
        d.start_load("r", "t", mode="psuh")  # type: ignore[arg-type]
    d.start_load("r", "t", mode="push")


@pytest.mark.parametrize("text", ["sometimes", "fastms", "0ms", "-5ms", ""])
def test_a_bad_fsync_policy_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="fsync policy must be"):
        FsyncPolicy.parse(text)


def test_fsync_policy_spellings_and_fields() -> None:
    assert FsyncPolicy.parse("25ms") == FsyncPolicy(FsyncMode.INTERVAL, 25.0) == FsyncPolicy("interval", 25)
    assert FsyncPolicy.parse("always").mode is FsyncMode.ALWAYS
    with pytest.raises(ValueError, match="fsync mode must be 'always', 'interval' or 'never', got 'alwyas'"):
        FsyncPolicy("alwyas")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="interval_ms must be positive"):
        FsyncPolicy(FsyncMode.INTERVAL, 0.0)
