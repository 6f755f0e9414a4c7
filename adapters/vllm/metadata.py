"""What the scheduler side tells the worker side each step (vLLM carries it in ``SchedulerOutput``).

Plain frozen values, picklable: vLLM sends them to worker processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True, slots=True)
class GrantCmd:
    """P: the request finished its prefill; pin ``block_ids`` under a lease and publish the grant."""

    request: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PeerRef:
    """D: where a request's KV lives (from P's ``kv_transfer_params``)."""

    request: str  # D's request id
    address: str  # P's side channel, tcp://host:port
    remote_request: str  # P's request id (the grant's key)


@dataclass(frozen=True, slots=True)
class RecvCmd:
    """D: blocks are reserved for the request; load them (pull or push)."""

    peer: PeerRef
    block_ids: tuple[int, ...]


@dataclass
class KVLifecycleMetadata(KVConnectorMetadata):
    grants: list[GrantCmd] = field(default_factory=list)
    announces: list[PeerRef] = field(default_factory=list)  # D: heartbeat the lease from arrival on
    recvs: list[RecvCmd] = field(default_factory=list)
    skips: list[PeerRef] = field(default_factory=list)  # D: nothing to load (local hit / never admitted)
    cancels: list[str] = field(default_factory=list)  # D: request aborted/preempted while loading or reserved
    finishes: list[str] = field(default_factory=list)  # D: request finished; its blocks go back to vLLM

    def is_empty(self) -> bool:
        return not (self.grants or self.announces or self.recvs or self.skips or self.cancels or self.finishes)
