"""The connector's transfer statistics through vLLM's KV-connector stats interface, so that they appear in a
server's ``/metrics`` beside vLLM's own (as NixlConnector's ``vllm:nixl_xfer_time_seconds`` do).

Each worker (every TP rank) fills a :class:`KVLifecycleStats` from its ledgers' events (the ledger already records
every transfer's post and transfer time, bytes and descriptors, every lease's end and every refusal); vLLM takes it
each step (``get_kv_connector_stats``), aggregates the ranks' data, ships it to the API server and hands it to
:class:`KVLifecyclePromMetrics`. The data is plain lists (vLLM serializes it between processes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from kvlifecycle import events as ev

HISTOGRAMS = ("transfer_duration", "post_duration", "bytes_transferred", "num_descriptors")
COUNTERS = ("num_failed_transfers", "num_expired_leases", "num_refusals", "num_verified_blocks",
            "num_digest_mismatches", "num_staged_blocks", "pinned_block_seconds")
# gauges: (TP rank, value) samples, the last per rank is the rank's value; the metric is their sum over ranks
GAUGES = ("staging_pool_occupancy",)


@dataclass
class KVLifecycleStats(KVConnectorStats):
    """One interval's observations: a value per transfer for each histogram key, for each counter an increment
    per event (1, or the blocks an event names for the digest counters)."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, list[Any]] = {key: [] for key in HISTOGRAMS + COUNTERS + GAUGES}

    def observe_staging(self, staged_blocks: int, pinned_block_seconds: float, occupancy: int | None, *,
                        rank: int = 0) -> None:
        """P's host staging numbers since the last sample (:class:`~.staging.StagingGauges`): blocks staged, GPU
        pinned-block-seconds, and the pool's occupancy when it changed. Zeros are left out, so that an idle P
        reports nothing."""
        if staged_blocks:
            self.data["num_staged_blocks"].append(staged_blocks)
        if pinned_block_seconds > 0:
            self.data["pinned_block_seconds"].append(pinned_block_seconds)
        if occupancy is not None:
            self.data["staging_pool_occupancy"].append([rank, occupancy])

    def observe(self, event: ev.Event) -> None:
        """Fold one ledger event in (a ledger listener: any thread; appends are atomic under the GIL)."""
        if isinstance(event, ev.TransferObserved):
            if event.transfer.startswith("probe:"):  # the connect-time probe is not a request's transfer
                return
            if not event.ok:
                self.data["num_failed_transfers"].append(1)
                return
            self.data["transfer_duration"].append(event.t_xfer_s)
            self.data["post_duration"].append(event.t_post_s)
            self.data["bytes_transferred"].append(event.nbytes)
            self.data["num_descriptors"].append(event.descriptors)
        elif isinstance(event, ev.TgtLoadFailed):
            self.data["num_failed_transfers"].append(1)
        elif isinstance(event, ev.SrcLeaseReleased) and event.reason == "expired":
            self.data["num_expired_leases"].append(1)
        elif isinstance(event, ev.Refused):
            self.data["num_refusals"].append(1)
        elif isinstance(event, ev.TgtPartDone) and event.verified:
            self.data["num_verified_blocks"].append(event.verified)
        elif isinstance(event, ev.TgtDigestMismatch):
            self.data["num_digest_mismatches"].append(len(event.expected) // 8)

    def clone_and_reset(self) -> KVLifecycleStats:
        old = copy.copy(self)
        self.reset()
        return old

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in HISTOGRAMS + COUNTERS + GAUGES)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self

    def reduce(self) -> dict[str, int | float]:
        """What vLLM's periodic log line shows for the interval."""
        xfer = self.data["transfer_duration"]
        n = len(xfer)
        total_bytes = float(sum(self.data["bytes_transferred"]))
        return {
            "Num successful transfers": n,
            "Avg xfer time (ms)": round(1e3 * sum(xfer) / n, 3) if n else 0,
            "Avg post time (ms)": round(1e3 * sum(self.data["post_duration"]) / n, 3) if n else 0,
            "Avg MB per transfer": round(total_bytes / 2**20 / n, 3) if n else 0,
            "Num failed transfers": len(self.data["num_failed_transfers"]),
            "Num expired leases": len(self.data["num_expired_leases"]),
            "Num refusals": len(self.data["num_refusals"]),
            "Num verified blocks": sum(self.data.get("num_verified_blocks", ())),
            "Num digest mismatches": sum(self.data.get("num_digest_mismatches", ())),
            "Num staged blocks": sum(self.data.get("num_staged_blocks", ())),
            "Pinned block-seconds": round(sum(self.data.get("pinned_block_seconds", ())), 3),
        }


class KVLifecyclePromMetrics(KVConnectorPromMetrics):
    """``vllm:kvlifecycle_*``: histograms per transfer (time, post time, bytes, descriptors) and counters."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        seconds = [0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0]
        spec = {
            "transfer_duration": ("vllm:kvlifecycle_xfer_time_seconds",
                                  "Transfer time of kvlifecycle KV cache transfers (post to completion).", seconds),
            "post_duration": ("vllm:kvlifecycle_post_time_seconds",
                              "Time to post kvlifecycle KV cache transfers.", seconds),
            "bytes_transferred": ("vllm:kvlifecycle_bytes_transferred",
                                  "Bytes per kvlifecycle KV cache transfer.", [2 ** (10 + i) for i in range(1, 25, 2)]),
            "num_descriptors": ("vllm:kvlifecycle_num_descriptors",
                                "Descriptors per kvlifecycle KV cache transfer.",
                                [1, 4, 16, 64, 256, 1024, 4096, 16384, 65536]),
        }
        # vLLM types each class as any of its metric kinds; these are a histogram's and a counter's
        histogram_cls: Any = self._histogram_cls
        counter_cls: Any = self._counter_cls
        self.histograms: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                histogram_cls(name=name, documentation=doc, buckets=buckets, labelnames=labelnames),
                self.per_engine_labelvalues)
            for key, (name, doc, buckets) in spec.items()
        }
        counters = {
            "num_failed_transfers": ("vllm:kvlifecycle_num_failed_transfers",
                                     "Failed kvlifecycle KV loads (any part, any cause)."),
            "num_expired_leases": ("vllm:kvlifecycle_num_expired_leases",
                                   "kvlifecycle leases released by expiry (tracked on P)."),
            "num_refusals": ("vllm:kvlifecycle_num_refusals",
                             "Commands the kvlifecycle ledgers refused (each is an event in the log)."),
            "num_verified_blocks": ("vllm:kvlifecycle_num_verified_blocks",
                                    "KV blocks whose landed bytes matched P's digest on D (verify)."),
            "num_digest_mismatches": ("vllm:kvlifecycle_num_digest_mismatches",
                                      "KV blocks whose landed bytes failed their digest on D; the load was refused."),
            "num_staged_blocks": ("vllm:kvlifecycle_num_staged_blocks",
                                  "KV blocks P copied to its host staging pool and gave back to vLLM (P)."),
            "pinned_block_seconds": ("vllm:kvlifecycle_pinned_block_seconds",
                                     "KV blocks pinned on P under leases, integrated over time (block-seconds)."),
        }
        self.counters: dict[str, dict[int, Any]] = {
            key: create_metric_per_engine(
                counter_cls(name=name, documentation=doc, labelnames=labelnames), self.per_engine_labelvalues)
            for key, (name, doc) in counters.items()
        }

        gauge_cls: Any = self._gauge_cls
        self.gauges: dict[str, dict[int, Any]] = {
            "staging_pool_occupancy": create_metric_per_engine(
                gauge_cls(name="vllm:kvlifecycle_staging_pool_occupancy",
                          documentation="Host staging pool slots held now (copying, staged or being read), P.",
                          labelnames=labelnames, multiprocess_mode="mostrecent"),
                self.per_engine_labelvalues),
        }
        self._gauge_ranks: dict[tuple[str, int], dict[int, float]] = {}  # (gauge, engine) -> rank -> last value

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, metric in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].observe(value)
        for key, metric in self.counters.items():
            for value in transfer_stats_data.get(key, ()):
                metric[engine_idx].inc(value)
        for key, metric in self.gauges.items():
            samples = transfer_stats_data.get(key)
            if samples:
                ranks = self._gauge_ranks.setdefault((key, engine_idx), {})
                for rank, value in samples:
                    ranks[int(rank)] = value
                metric[engine_idx].set(sum(ranks.values()))
