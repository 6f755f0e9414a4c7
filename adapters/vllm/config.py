"""The adapter's options, read once from ``kv_transfer_config.kv_connector_extra_config``.

Documented in docs/vllm.md. Unknown keys are refused (a typo must not silently fall back to a default), and so is
a value of the wrong type or outside its set, with the option's name: the options are validated where they are
made, whether from vLLM's JSON (:meth:`AdapterConfig.from_extra`) or in code.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from kvlifecycle import envvars
from kvlifecycle import validators as v
from kvlifecycle.choices import Choice, TransferMode
from kvlifecycle.digest import VerifyMode
from kvlifecycle.eventlog import FsyncPolicy
from kvlifecycle.membership.etcd import parse_endpoint
from kvlifecycle.membership.keys import cluster_prefix
from kvlifecycle.staging_policy import StageWhen, StagingPolicy, WhenFull

from .nixl_migration import migrate_extra_config

DEFAULT_SIDE_CHANNEL_PORT = 5700
# the host staging tier's keys, spelled as the core's StagingPolicy.from_mapping reads them (one spelling for every
# engine); they arrive flat in the extra config and are folded into one StagingPolicy
STAGING_KEYS = ("stage_when", "stage_after_ms", "stage_free_block_watermark", "staging_pool_blocks",
                "staging_when_full")
_STAGING_NUMBERS = ("stage_after_ms", "stage_free_block_watermark", "staging_pool_blocks")


class FastPath(Choice):
    """Whether KV in VRAM also registers a CUDA IPC transport, which D picks per P at connect when both are on one
    node (NIXL stays the fallback)."""

    AUTO = "auto"
    OFF = "off"  # NIXL only


def _fsync(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    FsyncPolicy.parse(value)  # 'always', 'never' or '<N>ms': refused here, not when the first log opens


def _backends(value: Any) -> Any:
    """One backend name or a list of them (vLLM's JSON has no tuples); anything else is left for the validator."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def _mode(value: TransferMode | str) -> TransferMode:
    return TransferMode.parse(value, "mode")


def _fast_path(value: FastPath | str) -> FastPath:
    return FastPath.parse(value, "fast_path")


def _verify(value: VerifyMode | str) -> VerifyMode:
    return VerifyMode.parse(value, "verify")


def _endpoints(value: Any) -> Any:
    """``"h1:2379,h2:2379"`` or a list of endpoints; anything else is left for the validator."""
    if isinstance(value, str):
        return tuple(e.strip() for e in value.split(",") if e.strip())
    return tuple(value) if isinstance(value, list) else value


def _endpoint(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    try:
        parse_endpoint(value)
    except ValueError as exc:
        raise ValueError(f"{attribute.name}: {exc}") from exc


def _cluster(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    try:
        cluster_prefix(value)
    except ValueError as exc:
        raise ValueError(f"{attribute.name}: {exc}") from exc


def _host_port(instance: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is None:
        return
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{attribute.name} must be host:port, got {value!r}")


def staging_policy(extra: dict[str, Any]) -> StagingPolicy:
    """The staging keys of ``extra`` as one policy; ``ValueError`` in one line naming the key as the operator wrote
    it (the policy's own checks name its fields, and its converters would take ``true`` as 1)."""
    for key in _STAGING_NUMBERS:
        value = extra.get(key)
        if key not in extra:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"kv_connector_extra_config {key} must be a number, got {value!r}")
        if value < 0:
            raise ValueError(f"kv_connector_extra_config {key} must be >= 0, got {value!r}")
        if key != "stage_after_ms" and not float(value).is_integer():
            raise ValueError(f"kv_connector_extra_config {key} must be a whole number of blocks, got {value!r}")
    parsed = dict(extra)
    if "stage_when" in extra:
        parsed["stage_when"] = StageWhen.parse(extra["stage_when"], "kv_connector_extra_config stage_when")
    if "staging_when_full" in extra:
        parsed["staging_when_full"] = WhenFull.parse(extra["staging_when_full"],
                                                     "kv_connector_extra_config staging_when_full")
    try:
        policy = StagingPolicy.from_mapping(parsed)  # left to refuse: a policy that stages without a pool
    except ValueError as exc:
        raise ValueError(f"kv_connector_extra_config {exc}") from None
    if policy.when is StageWhen.WATERMARK and policy.free_block_watermark == 0:
        raise ValueError("kv_connector_extra_config stage_when 'watermark' needs stage_free_block_watermark > 0 "
                         "(free KV blocks are never below 0: nothing would be staged)")
    return policy


def _staging(value: StagingPolicy | dict[str, Any]) -> StagingPolicy:
    return value if isinstance(value, StagingPolicy) else staging_policy(value)


_str = v.text
_optional_str = v.optional_text
_seconds = v.positive


@attrs.frozen(kw_only=True)
class AdapterConfig:
    mode: TransferMode = attrs.field(default=TransferMode.PULL, converter=_mode)
    """pull: D READs from P; push: P WRITEs into D's reserved blocks."""
    transport: Literal["nixl"] = attrs.field(default="nixl")
    backends: tuple[str, ...] = attrs.field(
        default=("UCX",),
        converter=_backends,
        validator=attrs.validators.deep_iterable(_str, attrs.validators.instance_of(tuple)),
    )
    lease_ttl_s: float = attrs.field(default=30.0, validator=_seconds)
    log_dir: str | None = attrs.field(default=None, validator=_optional_str)
    """Event logs, one directory per ledger; None: no log."""
    fsync: str = attrs.field(default="10ms", validator=[_str, _fsync])
    """Event-log fsync policy: 'always', 'never' or '<N>ms' (see kvlifecycle.eventlog)."""
    side_channel_host: str = attrs.field(default="127.0.0.1", validator=_str)
    side_channel_port: int = attrs.field(default=DEFAULT_SIDE_CHANNEL_PORT, validator=v.port)
    """P's side channel: port + DP index × TP size + TP rank."""
    grant_wait_s: float = attrs.field(default=10.0, validator=_seconds)
    """How long D waits for P to publish a grant."""
    handshake_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    load_timeout_s: float = attrs.field(default=60.0, validator=_seconds)
    secret: str | None = attrs.field(default=None, validator=_optional_str)
    """Optional side-channel HMAC secret, shared by P and D."""
    fast_path: FastPath = attrs.field(default=FastPath.AUTO, converter=_fast_path)
    decode_tp_size: int = attrs.field(default=0, validator=v.integer(0))
    """P: the TP size of the D instances it serves (0: P's own). D TP > P TP: each P rank's lease counts
    D TP / P TP consumers (the D ranks that read slices of its blocks); D refuses a grant counted otherwise."""
    etcd_endpoints: tuple[str, ...] = attrs.field(
        default=(),
        converter=_endpoints,
        validator=attrs.validators.deep_iterable(
            attrs.validators.and_(_str, _endpoint), attrs.validators.instance_of(tuple)),
    )
    """etcd's client endpoints; empty: no membership (the addresses travel in ``kv_transfer_params`` alone)."""
    etcd_cluster: str = attrs.field(default="default", validator=[_str, _cluster])
    etcd_lease_ttl_s: int = attrs.field(default=5, validator=v.integer(2))
    """The etcd lease of each worker's key: a dead worker is unregistered within this."""
    api_address: str | None = attrs.field(default=None, validator=[_optional_str, _host_port])
    """host:port of this instance's OpenAI-compatible server, for ``kvlifecycle proxy --etcd``; vLLM does not tell
    its workers where its API server listens, so the launcher sets it (the ``--host`` and ``--port`` it passes)."""
    verify: VerifyMode = attrs.field(default=VerifyMode.NONE, converter=_verify)
    """Per-block KV digests (none, sample, all): P digests the granted blocks, D checks them where they landed
    before the load completes. DRAM caches only (vLLM on CPU); KV in VRAM refuses anything but none at start-up."""
    drain_timeout_s: float = attrs.field(default=5.0, validator=_seconds)
    """At shutdown, or when ``kvlifecycle drain`` orders it, P marks itself draining and waits this long (at most)
    for its live leases before it leaves."""
    drain_quiet_s: float = attrs.field(default=2.0, validator=_seconds)
    """An ordered drain leaves once P has held no lease for this long: a request still in its prefill when the
    order came holds none until its grant (raise it for prefills longer than this)."""

    staging: StagingPolicy = attrs.field(factory=StagingPolicy, converter=_staging)
    """P's host staging tier (docs/vllm.md, docs/staging.md), from the flat keys ``stage_when`` (never, after,
    watermark), ``stage_after_ms``, ``stage_free_block_watermark``, ``staging_pool_blocks`` and
    ``staging_when_full`` (wait, keep_gpu). Default: nothing is staged."""

    @transport.validator
    def _only_nixl(self, attribute: attrs.Attribute[str], value: str) -> None:
        if value != "nixl":
            raise ValueError(f"transport {value!r} is not supported by the vLLM adapter (nixl only)")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> AdapterConfig:
        """The options from vLLM's ``kv_connector_extra_config``; the side-channel host and port, the log directory
        and the etcd endpoints fall back to ``KVL_SIDE_CHANNEL_HOST`` (else ``VLLM_NIXL_SIDE_CHANNEL_HOST``),
        ``KVL_SIDE_CHANNEL_PORT`` (else ``VLLM_NIXL_SIDE_CHANNEL_PORT``), ``KVL_LOG_DIR`` and
        ``KVL_ETCD_ENDPOINTS`` (see docs/configuration.md)."""
        extra = migrate_extra_config(dict(extra or {}))  # NixlConnector's keys: carried over or refused in words
        known = {f.name for f in attrs.fields(cls)} - {"staging"} | set(STAGING_KEYS)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown} for KVLifecycleConnector; "
                             f"known: {sorted(known)}")
        env_host = envvars.SIDE_CHANNEL_HOST.read()
        if "side_channel_host" not in extra and env_host is not None:
            extra["side_channel_host"] = env_host
        env_port = envvars.SIDE_CHANNEL_PORT.read()
        if "side_channel_port" not in extra and env_port is not None:
            extra["side_channel_port"] = env_port
        env_log_dir = envvars.LOG_DIR.read()
        if "log_dir" not in extra and env_log_dir is not None:
            extra["log_dir"] = str(env_log_dir)
        env_etcd = envvars.ETCD_ENDPOINTS.read()
        if "etcd_endpoints" not in extra and env_etcd is not None:
            extra["etcd_endpoints"] = env_etcd
        staging = {key: extra.pop(key) for key in STAGING_KEYS if key in extra}
        return cls(**extra, staging=staging_policy(staging))

