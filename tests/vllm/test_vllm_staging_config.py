"""The host staging options of the vLLM connector, without vLLM (the main venv): ``kv_connector_extra_config``'s
flat staging keys become one :class:`StagingPolicy`, and a bad one is refused at start-up in one line that names
the key as the operator wrote it. Also the worker's staging gauges (what reaches ``/metrics``), over real ledgers on
a manual clock."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from vllm_adapter_modules import load_vllm_adapter_module

from kvlifecycle.clock import ManualClock
from kvlifecycle.ledger import SourceLedger
from kvlifecycle.staging import HostStaging
from kvlifecycle.staging_ledger import StagingLedger
from kvlifecycle.staging_policy import StageWhen, StagingPolicy, WhenFull

config = load_vllm_adapter_module("config")
staging = load_vllm_adapter_module("staging")


def test_no_staging_keys_stage_nothing() -> None:
    assert config.AdapterConfig.from_extra({}).staging == StagingPolicy()
    assert not config.AdapterConfig.from_extra({}).staging.enabled


def test_the_staging_keys_become_one_policy() -> None:
    extra = {"stage_when": "after", "stage_after_ms": 250, "staging_pool_blocks": 64,
             "staging_when_full": "keep_gpu", "lease_ttl_s": 8.0}
    cfg = config.AdapterConfig.from_extra(extra)
    assert cfg.staging == StagingPolicy(StageWhen.AFTER, 250.0, 0, 64, WhenFull.KEEP_GPU)
    assert cfg.lease_ttl_s == 8.0
    watermark = config.AdapterConfig.from_extra({"stage_when": "watermark", "stage_free_block_watermark": 16,
                                                 "staging_pool_blocks": 32.0})
    assert watermark.staging.free_block_watermark == 16 and watermark.staging.pool_blocks == 32


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"stage_when": "soon"}, "stage_when must be 'never', 'after' or 'watermark', got 'soon'"),
        ({"stage_when": "after"}, "needs a host pool: staging_pool_blocks > 0"),
        ({"stage_when": "watermark", "staging_pool_blocks": 8}, "needs stage_free_block_watermark > 0"),
        ({"staging_pool_blocks": True}, "staging_pool_blocks must be a number, got True"),
        ({"staging_pool_blocks": "64"}, "staging_pool_blocks must be a number, got '64'"),
        ({"staging_pool_blocks": 2.5}, "staging_pool_blocks must be a whole number of blocks"),
        ({"stage_after_ms": -1}, "stage_after_ms must be >= 0, got -1"),
        ({"stage_free_block_watermark": -3}, "stage_free_block_watermark must be >= 0"),
        ({"staging_when_full": "drop"}, "staging_when_full must be 'wait' or 'keep_gpu', got 'drop'"),
        ({"free_block_watermark": 4}, "unknown kv_connector_extra_config key"),  # the core's key is stage_...
        ({"staging": {"stage_when": "after"}}, "unknown kv_connector_extra_config key"),  # flat keys only
    ],
)
def test_a_bad_staging_option_is_refused_in_one_line_naming_it(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match="kv_connector_extra_config") as info:
        config.AdapterConfig.from_extra(extra)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_gauges_report_staged_blocks_pinned_block_seconds_and_occupancy_as_deltas() -> None:
    clock = ManualClock()
    source = SourceLedger(16, clock=clock, worker="P", default_ttl_s=30.0)
    pool = StagingLedger(8, clock=clock, source_worker="P")
    host = HostStaging(source, pool, StagingPolicy(when="after", stage_after_ms=100, pool_blocks=8))
    gauges = staging.StagingGauges(source, pool)
    assert gauges.take() == (0, 0.0, 0)  # the occupancy is reported once, then only when it changes
    source.allocate("r", [1, 2, 3])
    source.prefill_done("r")
    grant = source.grant("r")
    clock.advance(0.5)
    staged, pinned, occupancy = gauges.take()
    assert (staged, occupancy) == (0, None) and pinned == pytest.approx(1.5)  # 3 blocks for 0.5 s, still pinned
    plan = host.begin(grant.transfer)
    assert plan is not None and np.array_equal(plan.gpu_blocks, [1, 2, 3])
    assert gauges.take()[2] == 3
    clock.advance(0.5)
    assert host.copy_done(grant.transfer)  # GPU lease released as staged
    staged, pinned, occupancy = gauges.take()
    assert staged == 3 and pinned == pytest.approx(1.5) and occupancy is None
    clock.advance(1.0)
    assert gauges.take() == (0, 0.0, None)  # nothing pinned on the GPU any more
    assert {r.reason for r in source.take_released()} == {"staged"}


def test_a_staged_grant_is_forgotten_only_once_its_copy_ended() -> None:
    clock = ManualClock()
    source = SourceLedger(16, clock=clock, worker="P", default_ttl_s=30.0)
    pool = StagingLedger(8, clock=clock, source_worker="P")
    host = HostStaging(source, pool, StagingPolicy(when="after", pool_blocks=8))
    tier: Any = type("Tier", (), {"staging": host, "copier": None})()
    worker_staging = staging.WorkerStaging(tier, pool, transport=None, memory=None)  # type: ignore[arg-type]
    for request, blocks in (("kept", [1, 2]), ("aborted", [3])):
        source.allocate(request, blocks)
        source.prefill_done(request)
    kept, aborted = source.grant("kept"), source.grant("aborted")
    assert host.begin(kept.transfer) is not None and host.begin(aborted.transfer) is not None
    assert host.copy_done(kept.transfer)
    assert not host.copy_done(aborted.transfer, ok=False, reason="copy failed")  # the GPU lease stays
    ended = worker_staging.take_ended()  # taken before the releases, as the worker does
    worker_staging.handed_over(kept.transfer, "kept")
    assert worker_staging.grants_to_forget(ended) == []  # the aborted copy was never handed over
    assert pool.cancel(kept.transfer)  # the staged copy ends (nobody read it)
    assert worker_staging.grants_to_forget(worker_staging.take_ended()) == ["kept"]
    assert worker_staging.grants_to_forget([kept.transfer]) == []  # once
