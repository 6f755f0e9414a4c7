"""D's loads for vLLM: the forward thread hands each step's commands (announce, receive, skip, cancel, finish,
release) to one adapter thread, which takes them to the :class:`~kvlifecycle.handoff.Consumer` (everything that may
block: fetching grants, the handshake, the claim) and never blocks the forward thread; vLLM's receive results come
back through a ledger listener and are drained on the forward thread."""

from __future__ import annotations

import enum
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.choices import TransferMode
from kvlifecycle.layout import UnsupportedMappingError, tp_source_ranks
from kvlifecycle.ledger import InvalidTransitionError, LedgerError, TargetLedger
from kvlifecycle.machines import TargetState

from .config import AdapterConfig
from .metadata import KVLifecycleMetadata, PeerRef, RecvCmd

if TYPE_CHECKING:
    from kvlifecycle.handoff import Consumer

    from .streaming import LayerStreaming

log = logging.getLogger("kvlifecycle.adapters.vllm")
RESERVED = int(TargetState.RESERVED)


class _Command(enum.Enum):
    """What the forward thread and the ledger listener hand D's adapter thread, with its argument."""

    ANNOUNCE = "announce"  # a PeerRef: keep P's grants alive until the load starts
    RECV = "recv"  # a RecvCmd
    SKIP = "skip"  # a PeerRef: nothing to load
    CANCEL = "cancel"  # a request
    FINISH = "finish"  # a request
    RELEASE = "release"  # a request whose reservation goes back (its load failed under recompute, or never began)


class DecodeLoads:
    """D's side of one vLLM worker: the adapter thread, and the results vLLM polls (module docstring)."""

    def __init__(self, target: TargetLedger, config: AdapterConfig, *, tp_rank: int, tp_size: int) -> None:
        self.target, self.config, self.tp_rank, self.tp_size = target, config, tp_rank, tp_size
        self.consumer: Consumer | None = None
        self.streaming: LayerStreaming | None = None  # layer-wise streaming (requests the proxy marks for it)
        # results for vLLM, filled by the ledger listener (any thread), drained on the forward thread
        self._results_lock = threading.Lock()
        self._done_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._load_of_transfer: dict[str, str] = {}
        self._commands: queue.SimpleQueue[tuple[_Command, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvl-vllm-consumer", daemon=True)
        target.listeners.append(self._on_target_event)

    def start(self, consumer: Consumer) -> None:
        self.consumer = consumer
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def on_metadata(self, meta: KVLifecycleMetadata) -> None:
        """The forward thread: queue the step's commands (never blocks). Ends first: vLLM may hand a block it freed
        from a finished request to one it admitted in the same step, and the ledger reserves that block for the new
        request only once the old one let it go."""
        for request in meta.finishes:
            self._commands.put((_Command.FINISH, request))
        for peer in meta.announces:
            self._commands.put((_Command.ANNOUNCE, peer))
        for recv in meta.recvs:
            self._commands.put((_Command.RECV, recv))
        for peer in meta.skips:
            self._commands.put((_Command.SKIP, peer))
        for request in meta.cancels:
            self._commands.put((_Command.CANCEL, request))

    def take_results(self) -> tuple[set[str], set[str]]:
        """(finished receives, failed receives) since the last call: a failed receive is also a finished one."""
        with self._results_lock:
            recving, self._done_recving = self._done_recving, set()
            failed, self._failed_recving = self._failed_recving, set()
        return recving, failed

    def take_failed_blocks(self) -> set[int]:
        with self._results_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out

    # -- D: ledger listener (runs on whichever thread changed the target ledger) ---------------------------------
    def _on_target_event(self, event: ev.Event) -> None:
        if isinstance(event, ev.TgtLoadStarted):
            self._load_of_transfer[event.transfer] = event.request
        elif isinstance(event, ev.TgtPartDone):
            if self.target is not None and event.transfer not in self.target.loads:
                request = self._load_of_transfer.pop(event.transfer, None)
                if request is not None:
                    with self._results_lock:
                        self._done_recving.add(request)
        elif isinstance(event, ev.TgtLoadFailed):
            request = self._load_of_transfer.pop(event.transfer, None)
            if request is not None:
                blocks = self.target.requests.get(request) if self.target is not None else None
                with self._results_lock:
                    self._failed_recving.add(request)
                    self._done_recving.add(request)  # vLLM: a failed receive is also a finished receive
                    if blocks is not None:
                        self._failed_blocks.update(int(b) for b in blocks.blocks)
                if event.recompute:
                    self._commands.put((_Command.RELEASE, request))
                log.warning("KV load of %s failed (%s): %s", request,
                            "recompute" if event.recompute else "fail", event.reason)

    def on_abandoned(self, request: str, reason: str) -> None:
        """The consumer could not start the load (P refused the claim: its lease was gone). No load exists in the
        ledger to fail, so vLLM learns it here; the consumer already applied the policy to the reservation."""
        log.warning("KV load of %s not started: %s", request, reason)
        self._report_failed(request)
        self._commands.put((_Command.RELEASE, request))

    # -- D: the adapter thread ---------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stop.is_set():
            kind: _Command | None
            try:
                kind, arg = self._commands.get(timeout=0.05)
            except queue.Empty:
                kind, arg = None, None
            try:
                if kind is _Command.ANNOUNCE:
                    self._announce(arg)
                elif kind is _Command.RECV:
                    self._recv(arg)
                elif kind is _Command.SKIP:
                    self._skip(arg)
                elif kind is _Command.CANCEL:
                    self._cancel(arg)
                elif kind is _Command.FINISH:
                    self._finish(arg)
                elif kind is _Command.RELEASE:
                    self._release_reservation(arg)
                if self.target is not None:
                    self.target.commit()
            except Exception:
                log.exception("KVLifecycleConnector adapter thread: %s failed",
                              kind.value if kind is not None else "commit")

    def _source_addresses(self, peer: PeerRef) -> list[str]:
        """The side channels of the P ranks this D rank reads (the core's TP plan: rank i <-> rank i at equal
        sizes, several P ranks when P TP > D TP, one shared P rank when P TP < D TP)."""
        ranks = tp_source_ranks(p_tp=peer.remote_tp_size, d_tp=self.tp_size, d_rank=self.tp_rank)
        return [peer.rank_address(rank) for rank in ranks]

    def _announce(self, peer: PeerRef) -> None:
        """P's grants for a request whose blocks vLLM has not reserved yet: the consumer holds them alive."""
        assert self.consumer is not None
        try:
            addresses = self._source_addresses(peer)
        except UnsupportedMappingError as exc:
            log.warning("request %s: %s; its load will be refused", peer.request, exc)
            return
        self.consumer.announce(peer.request, peer.remote_request, addresses, wait_s=self.config.grant_wait_s)

    def _recv(self, cmd: RecvCmd) -> None:
        """Reserve vLLM's blocks and load them (the consumer fails a load that cannot start, in the ledger)."""
        assert self.consumer is not None and self.target is not None
        peer = cmd.peer
        blocks = np.asarray(cmd.block_ids, dtype=np.int32)
        try:
            self.target.reserve(peer.request, blocks)
        except LedgerError as exc:
            # vLLM gave us blocks the ledger still sees in use: refuse to load into them
            log.error("request %s: cannot reserve %d blocks: %s", peer.request, blocks.size, exc)
            self.consumer.forget_grants(peer.request)
            self._report_failed(peer.request)
            return
        try:
            if cmd.stream and self._stream(peer):
                self.consumer.forget_grants(peer.request)
                return
            addresses = self._source_addresses(peer)
        except Exception as exc:  # every shipped recv must settle, or vLLM waits on it forever
            log.error("request %s: handoff from %s refused: %s", peer.request, peer.address, exc)
            self.consumer.forget_grants(peer.request)
            self.consumer.fail_unstarted(peer.request, [], f"{type(exc).__name__}: {exc}", consumer=0)
            return
        self.consumer.load(peer.request, peer.remote_request, addresses, push=self.config.mode is TransferMode.PUSH,
                           wait_s=self.config.grant_wait_s)

    def _report_failed(self, request: str) -> None:
        with self._results_lock:
            self._failed_recving.add(request)
            self._done_recving.add(request)  # vLLM: a failed receive is also a finished receive

    def _stream(self, peer: PeerRef) -> bool:
        """Layer-wise: ask P to stream into the reservation; False when declined (the post-prefill path follows)."""
        assert self.consumer is not None and self.streaming is not None
        if peer.remote_tp_size != self.tp_size:  # this adapter streams rank to rank; other sizes pull after it
            return False
        address = self._source_addresses(peer)[0]
        if address not in self.consumer.links:
            self.consumer.connect(address, push=True)
        return self.streaming.request(peer.request, address, peer.remote_request)

    def _skip(self, peer: PeerRef) -> None:
        """Nothing to load (full local prefix hit, or the request never got blocks): release P's grant now."""
        assert self.consumer is not None
        try:
            addresses = self._source_addresses(peer)
        except UnsupportedMappingError as exc:
            log.info("could not release %s: %s (its lease will expire)", peer.remote_request, exc)
            self.consumer.forget_grants(peer.request)
            return
        self.consumer.skip(peer.request, peer.remote_request, addresses, wait_s=self.config.grant_wait_s)

    def _cancel(self, request: str) -> None:
        """vLLM aborted a request whose load it had not seen settle. In flight: the ledger keeps the blocks
        LOADING and the listener reports the request once the transfer settles (vLLM frees the blocks then).
        Otherwise its settling was already reported: only the ledger needs to know."""
        assert self.target is not None and self.consumer is not None
        self.consumer.forget_grants(request)
        if self.streaming is not None and self.streaming.cancel(request):
            return  # a stream: P stops posting, the blocks go once its writes settled
        if request in self.target.requests:
            self.target.cancel(request)

    def _release_reservation(self, request: str) -> None:
        """After a failed load under policy ``recompute`` vLLM frees the request's blocks and allocates new ones
        for the local prefill (no valid computed tokens): the ledger gives the old reservation back too."""
        assert self.target is not None
        req = self.target.requests.get(request)
        if req is not None and req.transfer is None:
            self.target.cancel(request)

    def _finish(self, request: str) -> None:
        assert self.target is not None
        req = self.target.requests.get(request)
        if req is None:
            return  # a failed load already freed it
        try:
            if req.transfer is None and req.state == RESERVED:  # the request's own state: no full-array view
                self.target.local_fill(request)  # RESERVED after a failed load: vLLM recomputed it
            self.target.finish(request)
        except (InvalidTransitionError, LedgerError) as exc:
            log.warning("finishing %s: %s", request, exc)
