"""Scheduler side (vLLM's EngineCore process): decides, per request, what the worker side must do.

The ledgers live with the transport on the worker side (they need the registered KV memory and the NIXL agent);
this side only turns vLLM's scheduler hooks into commands (:mod:`.metadata`) and keeps the two facts vLLM needs
synchronously: which D requests still have a load in flight (their blocks must not be freed), and what P publishes
in ``kv_transfer_params``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from .config import AdapterConfig
from .metadata import GrantCmd, KVLifecycleMetadata, PeerRef, RecvCmd, StreamStep

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvlifecycle.adapters.vllm")

PARAMS_VERSION = 1
REQUIRED_REMOTE_KEYS = ("remote_request_id", "remote_host", "remote_port")
# layer-wise streaming (the proxy's ``--layerwise``): the key both P's and D's request carry; D's reservation and,
# on fallback, P's grant are published under it
STREAM_KEY = "kvlifecycle_stream"


def side_channel_port(config: AdapterConfig, vllm_config: VllmConfig, tp_rank: int = 0) -> int:
    """P rank ``tp_rank`` of DP rank ``d`` listens on ``base + d * tp_size + tp_rank``: the DP ranks' TP ranks never
    share a port (``base + d + tp_rank`` would, for DP > 1 and TP > 1), and with TP 1 it is ``base + d`` as
    vLLM's NixlConnector counts."""
    parallel = vllm_config.parallel_config
    tp_size = int(getattr(parallel, "tensor_parallel_size", 1) or 1)
    return config.side_channel_port + parallel.data_parallel_index * tp_size + tp_rank


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, config: AdapterConfig, engine_id: str) -> None:
        self.config = config
        self.engine_id = engine_id
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.host = config.side_channel_host
        self.port = side_channel_port(config, vllm_config)
        self._pending = KVLifecycleMetadata()
        # D: requests whose recv was shipped and not yet reported finished (vLLM must not free their blocks)
        self._loading: set[str] = set()
        self._settled: set[str] = set()  # D: load reported (done or failed); the ledger still holds the request
        self._streaming: dict[str, tuple[str, int, list[int]]] = {}  # P: request -> (key, prompt length, blocks)

    # -- D: a request with P's params arrives --------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode") and params.get(STREAM_KEY):
            self._streaming[request.request_id] = (str(params[STREAM_KEY]), len(request.prompt_token_ids or ()), [])
        if params and params.get("do_remote_prefill") and not params.get(STREAM_KEY):  # a stream has no grant yet
            peer = self._peer(request)
            if peer is not None:
                self._pending.announces.append(peer)  # heartbeats start now, not when blocks are found

    def _peer(self, request: Request) -> PeerRef | None:
        params = request.kv_transfer_params or {}
        if not all(params.get(k) is not None for k in REQUIRED_REMOTE_KEYS):
            log.warning("request %s: kv_transfer_params lack %s; it will be prefilled locally", request.request_id,
                        [k for k in REQUIRED_REMOTE_KEYS if params.get(k) is None])
            return None
        address = f"tcp://{params['remote_host']}:{int(params['remote_port'])}"
        return PeerRef(request.request_id, address, str(params["remote_request_id"]), int(params.get("tp_size") or 1))

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill") and self._peer(request) is not None:
            count = len(request.prompt_token_ids or ()) - num_computed_tokens
            if count > 0:
                return count, True  # loaded asynchronously: the request waits in WAITING_FOR_REMOTE_KVS
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if called again
        peer = self._peer(request)
        if peer is None:
            return
        if num_external_tokens <= 0:
            self._pending.skips.append(peer)  # a full local prefix hit: tell P to release now
            return
        block_ids = blocks.get_unhashed_block_ids_all_groups()
        if len(block_ids) != 1:
            raise NotImplementedError("KVLifecycleConnector supports models with one KV cache group")
        self._pending.recvs.append(RecvCmd(peer, tuple(int(b) for b in block_ids[0]), bool(params.get(STREAM_KEY))))
        self._loading.add(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVLifecycleMetadata:
        # A preempted D request gave its loaded blocks back to vLLM (it will be recomputed): the ledger must
        # free them too, or the next reservation of those blocks would be refused.
        for request_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            if request_id in self._settled:
                self._settled.discard(request_id)
                self._pending.cancels.append(request_id)
        if self._streaming:
            self._stream_steps(scheduler_output)
        meta, self._pending = self._pending, KVLifecycleMetadata()
        return meta

    def _stream_steps(self, out: SchedulerOutput) -> None:
        """P: for each layer-wise request in this step, the blocks complete once its forward ran (a block is
        complete when all its tokens are computed; the last, partial one when the whole prompt is)."""
        cached = out.scheduled_cached_reqs
        # a cached request's new blocks are None when this step gave it none
        steps: list[tuple[str, tuple[list[int], ...] | None, int]] = [
            (r.req_id, r.block_ids, r.num_computed_tokens) for r in out.scheduled_new_reqs]
        steps += [(rid, cached.new_block_ids[i], cached.num_computed_tokens[i]) for i, rid in enumerate(cached.req_ids)]
        for request_id, new_blocks, computed in steps:
            entry = self._streaming.get(request_id)
            if entry is None:
                continue
            key, prompt_len, blocks = entry
            if new_blocks:
                blocks += [int(b) for b in new_blocks[0]]
            done = computed + out.num_scheduled_tokens.get(request_id, 0)
            whole = done >= prompt_len
            complete = -(-prompt_len // self.block_size) if whole else done // self.block_size
            self._pending.streams.append(StreamStep(request_id, key, tuple(blocks), min(complete, len(blocks))))
            if whole:
                del self._streaming[request_id]

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for request_id in output.finished_recving or ():
            if request_id in self._loading:
                self._loading.discard(request_id)
                self._settled.add(request_id)

    # -- both: a request ends ------------------------------------------------------------------------------------
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        request_id = request.request_id
        if params.get("do_remote_decode"):  # P
            finished_ok = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            self._streaming.pop(request_id, None)
            key = str(params.get(STREAM_KEY) or "")
            if key and block_ids and not finished_ok:  # its layers may still be landing at D: free once settled
                self._pending.grants.append(GrantCmd(request_id, tuple(int(b) for b in block_ids), key, aborted=True))
                return True, None
            if not finished_ok or not block_ids:
                return False, None  # aborted before its prefill finished: vLLM frees the blocks, nothing granted
            self._pending.grants.append(GrantCmd(request_id, tuple(int(b) for b in block_ids), key))
            return True, {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": self.engine_id,
                "remote_request_id": request_id,
                "remote_block_ids": [int(b) for b in block_ids],
                "remote_host": self.host,
                "remote_port": self.port,
                "remote_block_size": self.block_size,
                "tp_size": self.tp_size,
                "transfer_mode": self.config.mode,
                "kvlifecycle": PARAMS_VERSION,
            }
        # D
        if params.get("do_remote_prefill"):
            # never admitted (aborted or rejected before blocks were allocated): release P's blocks now
            # instead of at lease expiry (vLLM #41269)
            params["do_remote_prefill"] = False
            peer = self._peer(request)
            if peer is not None:
                self._pending.skips.append(peer)
            return False, None
        if request_id in self._loading:
            # aborted while its load is in flight: bytes may still land, so vLLM keeps the blocks until the
            # worker reports the transfer settled (finished_recving)
            self._pending.cancels.append(request_id)
            self._loading.discard(request_id)
            return True, None
        if request_id in self._settled:
            self._settled.discard(request_id)
            self._pending.finishes.append(request_id)
        return False, None
