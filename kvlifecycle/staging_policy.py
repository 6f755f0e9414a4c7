"""When P copies a granted request's KV to its host staging pool, how large the pool is, and what a full pool does.

Read once, validated, frozen (the engine's connector builds it from its extra config with :meth:`from_mapping`).
The default stages nothing: staging trades a device -> host copy (and D's slower read from host memory) for GPU
blocks, which pays only when D is slow enough that P runs out of blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvlifecycle.choices import Choice


class StageWhen(Choice):
    """What makes an unclaimed lease worth staging."""

    NEVER = "never"
    AFTER = "after"  # its lease has gone unclaimed for ``stage_after_ms``
    WATERMARK = "watermark"  # P's free KV blocks fell below ``free_block_watermark``: the oldest unclaimed first


class WhenFull(Choice):
    """What a lease due for staging does when the pool has no room for it."""

    WAIT = "wait"  # stays due: staged once slots free up
    KEEP_GPU = "keep_gpu"  # stays on the GPU until D reads it; never staged


def _stage_when(value: object) -> StageWhen:
    return StageWhen.parse(value, "stage_when")


def _when_full(value: object) -> WhenFull:
    return WhenFull.parse(value, "when_full")


def _non_negative(_inst: Any, attribute: attrs.Attribute[Any], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be >= 0, got {value!r}")


@attrs.frozen
class StagingPolicy:
    """The host staging tier's settings (the engine's to set)."""

    when: StageWhen = attrs.field(default=StageWhen.NEVER, converter=_stage_when)
    stage_after_ms: float = attrs.field(default=0.0, converter=float, validator=_non_negative)
    free_block_watermark: int = attrs.field(default=0, converter=int, validator=_non_negative)
    pool_blocks: int = attrs.field(default=0, converter=int, validator=_non_negative)
    when_full: WhenFull = attrs.field(default=WhenFull.WAIT, converter=_when_full)

    def __attrs_post_init__(self) -> None:
        if self.when is not StageWhen.NEVER and self.pool_blocks == 0:
            raise ValueError(f"stage_when {self.when.value!r} needs a host pool: staging_pool_blocks > 0")

    @property
    def enabled(self) -> bool:
        return self.when is not StageWhen.NEVER

    @classmethod
    def from_mapping(cls, config: Mapping[str, Any]) -> StagingPolicy:
        """From an engine's extra config: ``stage_when``, ``stage_after_ms``, ``stage_free_block_watermark``,
        ``staging_pool_blocks``, ``staging_when_full``; other keys are ignored (they belong to the connector)."""
        keys = {"stage_when": "when", "stage_after_ms": "stage_after_ms",
                "stage_free_block_watermark": "free_block_watermark", "staging_pool_blocks": "pool_blocks",
                "staging_when_full": "when_full"}
        return cls(**{field: config[key] for key, field in keys.items() if key in config})


__all__ = ["StageWhen", "StagingPolicy", "WhenFull"]
