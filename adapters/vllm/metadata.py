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
    stream_key: str = ""  # layer-wise: the key D's reservation names (its grant, on fallback, is published as it)
    aborted: bool = False  # layer-wise: aborted mid-prefill; no grant, the blocks go back once the writes settled


@dataclass(frozen=True, slots=True)
class StreamStep:
    """P, layer-wise: in this step's forward, each layer completes ``block_ids[:complete]`` of the request."""

    request: str
    stream_key: str
    block_ids: tuple[int, ...]  # every block of the request so far, token order
    complete: int  # blocks whose tokens are all computed once this step's forward ran


@dataclass(frozen=True, slots=True)
class PeerRef:
    """D: where a request's KV lives (from P's ``kv_transfer_params``)."""

    request: str  # D's request id
    address: str  # P's side channel, tcp://host:port
    remote_request: str  # P's request id (the grant's key)
    remote_tp_size: int = 1  # P's TP size: P rank k serves its slice on the side-channel port + k

    def rank_address(self, p_rank: int) -> str:
        """The side channel of P rank ``p_rank`` (``address`` is rank 0's)."""
        host, _, port = self.address.rpartition(":")
        return f"{host}:{int(port) + p_rank}"


@dataclass(frozen=True, slots=True)
class RecvCmd:
    """D: blocks are reserved for the request; load them (pull or push)."""

    peer: PeerRef
    block_ids: tuple[int, ...]
    stream: bool = False  # layer-wise: reserve at P before its prefill (peer.remote_request is the stream key)


@dataclass
class KVLifecycleMetadata(KVConnectorMetadata):
    grants: list[GrantCmd] = field(default_factory=list)
    announces: list[PeerRef] = field(default_factory=list)  # D: heartbeat the lease from arrival on
    recvs: list[RecvCmd] = field(default_factory=list)
    skips: list[PeerRef] = field(default_factory=list)  # D: nothing to load (local hit / never admitted)
    cancels: list[str] = field(default_factory=list)  # D: request aborted/preempted while loading or reserved
    finishes: list[str] = field(default_factory=list)  # D: request finished; its blocks go back to vLLM
    streams: list[StreamStep] = field(default_factory=list)  # P: layer-wise requests in this step's forward

    def is_empty(self) -> bool:
        return not (self.grants or self.announces or self.recvs or self.skips or self.cancels or self.finishes
                    or self.streams)
