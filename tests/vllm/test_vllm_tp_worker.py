"""The connector's worker side under tensor parallelism, without a server: one ``WorkerSide`` per vLLM rank in this
process (real NIXL on DRAM, real zmq side channels, vLLM's CPU layout [blocks, heads, block_size, 2 x head_size]),
driven by the connector metadata vLLM would broadcast to every rank.

- P TP 2 -> D TP 1 (D reads its heads from both P ranks) and P TP 1 -> D TP 2 (both D ranks read slices of the
  one P rank's blocks, pinned for two consumers): bytes head for head, every rank's log replays clean.
- A failed slice fails the request while a sibling slice of it is still in flight, and nothing is freed under the
  sibling: on D (one rank reading two P ranks) and on P (one lease read by two D ranks).
"""

from __future__ import annotations

import os
import random
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transports"))  # the shared vLLM stubs
from vllm_stubs import LAYER, kv_caches, vllm_or_stubs

from kvlifecycle.transport import TransferHandle, TransportError, XferStatus

pytestmark = [pytest.mark.nixl]

NB, BS, HEADS, HD = 16, 4, 2, 8  # blocks, tokens per block, KV heads over all ranks, head size
LAYERS = [0, 1]
WAIT_S = 30.0
LEASE_TTL_S = 20.0
# A release that D's hand-back (one short side-channel request) missed on a starved machine comes at lease expiry
RELEASE_WAIT_S = WAIT_S + LEASE_TTL_S


@pytest.fixture(autouse=True)
def _nixl() -> None:
    # a skip here is a failure in CI (tests/conftest.py: only GPU tests may skip there)
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (pip install nixl==1.5.1)")


@dataclass
class Ranks:
    p: list[Any]  # WorkerSide per P rank
    d: list[Any]  # WorkerSide per D rank
    p_caches: list[dict[str, torch.Tensor]]
    d_caches: list[dict[str, torch.Tensor]]
    address: str  # P rank 0's side channel (what P publishes in kv_transfer_params)
    log_dir: Path


def _config(role: str, tp: int, dp_index: int = 0) -> Any:
    model = SimpleNamespace(model="tiny-random-llama", get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HD)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_load_failure_policy="fail"),
        cache_config=SimpleNamespace(block_size=BS, enable_prefix_caching=False),
        parallel_config=SimpleNamespace(data_parallel_index=dp_index, tensor_parallel_size=tp),
        model_config=model,
    )


def _worker(monkeypatch: pytest.MonkeyPatch, role: str, tp: int, rank: int, engine: str, config: Any,
            dp_index: int = 0) -> Any:
    from kvlifecycle.adapters.vllm.worker import WorkerSide

    monkeypatch.setattr(sys.modules["vllm.distributed.parallel_state"], "get_tensor_model_parallel_rank",
                        lambda: rank)
    return WorkerSide(_config(role, tp, dp_index), config, engine, SimpleNamespace(num_blocks=NB))


def free_port_run(count: int) -> int:
    """A base port with ``count`` consecutive free ports (P rank k listens on base + k), drawn below the ephemeral
    range: a port just after one the kernel handed out (``bind(0)``) is where the next outgoing connection of any
    process on the machine may land."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports on 127.0.0.1")


@pytest.fixture
def ranks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Ranks]:
    """P and D ``WorkerSide`` per rank for ``request.param`` = (P TP, D TP); shut down on exit."""
    p_tp, d_tp = request.param
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm.config import AdapterConfig

        config = AdapterConfig(side_channel_port=free_port_run(p_tp), log_dir=str(tmp_path), load_timeout_s=WAIT_S,
                               lease_ttl_s=LEASE_TTL_S, decode_tp_size=d_tp)
        shape = dict(num_blocks=NB, block_size=BS, head_size=HD, dtype=torch.float32)
        p_caches = [kv_caches("LBHNC", LAYERS, heads=HEADS // p_tp, seed=10 + r, **shape) for r in range(p_tp)]
        d_caches = [kv_caches("LBHNC", LAYERS, heads=HEADS // d_tp, **shape) for _ in range(d_tp)]
        workers: list[Any] = []
        try:
            p = [_worker(monkeypatch, "kv_producer", p_tp, r, "engine-p", config) for r in range(p_tp)]
            workers += p
            d = [_worker(monkeypatch, "kv_consumer", d_tp, r, "engine-d", config) for r in range(d_tp)]
            workers += d
            for worker, caches in zip(p + d, p_caches + d_caches, strict=True):
                worker.register_kv_caches(caches)
            yield Ranks(p, d, p_caches, d_caches, f"tcp://127.0.0.1:{config.side_channel_port}", tmp_path)
        finally:
            for worker in reversed(workers):
                worker.shutdown()


@dataclass
class Settled:
    received: list[set[str]] = field(default_factory=list)  # per D rank: finished_recving
    failed: list[set[str]] = field(default_factory=list)  # per D rank: failed_recving
    sent: list[set[str]] = field(default_factory=list)  # per P rank: finished_sending

    def collect(self, ranks: Ranks) -> None:
        for i, d in enumerate(ranks.d):
            _, recving, failed = d.get_transfer_results()
            self.received[i] |= recving
            self.failed[i] |= failed
        for i, p in enumerate(ranks.p):
            self.sent[i] |= p.get_transfer_results()[0]


def settled(ranks: Ranks) -> Settled:
    return Settled([set() for _ in ranks.d], [set() for _ in ranks.d], [set() for _ in ranks.p])


def wait_until(check: Any, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.002)


def grant_everywhere(ranks: Ranks, p_blocks: tuple[int, ...]) -> None:
    from kvlifecycle.adapters.vllm.metadata import GrantCmd, KVLifecycleMetadata

    for p in ranks.p:  # vLLM broadcasts one scheduler output to every rank
        p.on_metadata(KVLifecycleMetadata(grants=[GrantCmd("req-p", p_blocks)]))


def recv_on(d: Any, ranks: Ranks, d_blocks: tuple[int, ...]) -> None:
    from kvlifecycle.adapters.vllm.metadata import KVLifecycleMetadata, PeerRef, RecvCmd

    peer = PeerRef("req-d", ranks.address, "req-p", len(ranks.p))
    d.on_metadata(KVLifecycleMetadata(recvs=[RecvCmd(peer, d_blocks)]))


def finish_everywhere(ranks: Ranks) -> None:
    from kvlifecycle.adapters.vllm.metadata import KVLifecycleMetadata

    for d in ranks.d:
        d.on_metadata(KVLifecycleMetadata(finishes=["req-d"]))
    wait_until(lambda: all("req-d" not in d.target.requests for d in ranks.d), "every D rank freed req-d")


def full_heads(caches: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor:
    """A layer's cache over all heads: the ranks' head slices side by side (vLLM's TP split of KV heads)."""
    return torch.cat([c[name] for c in caches], dim=1)


def replay_problems(log_dir: Path, sides: tuple[int, int]) -> list[str]:
    """Every rank's log on both sides: each quiescent, every (source, target) pair consistent."""
    from kvlifecycle.replay import check, check_pair, replay

    dirs = sorted(p for p in log_dir.iterdir() if p.is_dir() and p.name.startswith(("source-", "target-")))
    counts = (sum(p.name.startswith("source-") for p in dirs), sum(p.name.startswith("target-") for p in dirs))
    if counts != sides:
        return [f"expected {sides} source/target logs, found {[p.name for p in dirs]}"]
    results = [replay(p) for p in dirs]
    return [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]


P_BLOCKS, D_BLOCKS = (9, 2, 15), (0, 1, 2)


@pytest.mark.parametrize("ranks", [(2, 1), (1, 2), (2, 2)], indirect=True, ids=["p2-d1", "p1-d2", "p2-d2"])
def test_heads_move_between_tp_sizes(ranks: Ranks) -> None:
    """Every D rank gets exactly its heads of P's blocks; vLLM would see the request finished on every D rank
    (finished_recving) and on every P rank (finished_sending); nothing else is written; the logs replay clean."""
    out = settled(ranks)
    grant_everywhere(ranks, P_BLOCKS)
    for d in ranks.d:
        recv_on(d, ranks, D_BLOCKS)

    def done() -> bool:
        out.collect(ranks)
        return all(out.received) and all(out.sent)

    wait_until(done, "every rank settled")
    assert out.failed == [set()] * len(ranks.d)
    assert out.received == [{"req-d"}] * len(ranks.d) and out.sent == [{"req-p"}] * len(ranks.p)
    finish_everywhere(ranks)
    pi, di = torch.tensor(P_BLOCKS), torch.tensor(D_BLOCKS)
    rest = torch.tensor(sorted(set(range(NB)) - set(D_BLOCKS)))
    for i in LAYERS:
        name = LAYER.format(i)
        want, got = full_heads(ranks.p_caches, name), full_heads(ranks.d_caches, name)
        assert torch.equal(got.index_select(0, di), want.index_select(0, pi))
        assert not got.index_select(0, rest).any()
    assert replay_problems(ranks.log_dir, (len(ranks.p), len(ranks.d))) == []


class SlicedTransport:
    """D's real NIXL transport, with two test controls over the reads of one request: the read of
    ``held`` (a P transfer id) is posted only when :meth:`release_held` is called (until then it is in flight, as
    seen from D), and the read of ``broken`` fails at post. Everything else goes to the real transport."""

    def __init__(self, real: Any, *, held: str = "", broken: str = "") -> None:
        self.real, self.held, self.broken = real, held, broken
        self.lock = threading.Lock()
        self.waiting: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.posted: dict[int, TransferHandle] = {}
        self.held_polls = 0
        self.broken_posts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def post(self, *args: Any, **kwargs: Any) -> TransferHandle:
        transfer = kwargs.get("transfer", "")
        if transfer == self.broken:
            self.broken_posts += 1
            raise TransportError("injected: this slice's read cannot be posted")
        if transfer != self.held:
            return self.real.post(*args, **kwargs)
        plan = args[1]
        handle = TransferHandle(-1 - len(self.waiting), args[0], plan.peer, plan.peer_epoch, transfer)
        with self.lock:
            self.waiting[handle.id] = (args, kwargs)
        return handle

    def release_held(self) -> None:
        with self.lock:
            for hid, (args, kwargs) in self.waiting.items():
                self.posted[hid] = self.real.post(*args, **kwargs)
            self.waiting.clear()

    def _real(self, handle: TransferHandle) -> TransferHandle | None:
        with self.lock:
            return self.posted.get(handle.id) if handle.id < 0 else handle

    def poll(self, handle: TransferHandle) -> XferStatus:
        real = self._real(handle)
        if handle.id < 0:
            self.held_polls += 1
        return XferStatus.PENDING if real is None else self.real.poll(real)

    def error(self, handle: TransferHandle) -> Any:
        real = self._real(handle)
        return None if real is None else self.real.error(real)

    def stats(self, handle: TransferHandle) -> Any:
        real = self._real(handle)
        return None if real is None else self.real.stats(real)

    def release(self, handle: TransferHandle) -> None:
        real = self._real(handle)
        if real is not None:
            self.real.release(real)


@pytest.mark.parametrize("ranks", [(2, 1)], indirect=True, ids=["p2-d1"])
def test_failed_slice_waits_for_its_sibling_read_in_flight_on_d(ranks: Ranks) -> None:
    """P TP 2 -> D TP 1: D's read from P rank 1 fails while its read from P rank 0 is still in flight. The request
    fails (vLLM's kv_load_failure_policy), but only once the sibling read settled: until then D's blocks stay
    LOADING in its ledger, vLLM hears nothing (so it frees and reuses nothing), and P rank 0 keeps its lease."""
    d = ranks.d[0]
    out = settled(ranks)
    grant_everywhere(ranks, P_BLOCKS)
    held, broken = (ranks.p[r].producer.grants["req-p"].transfer for r in (0, 1))
    sliced = SlicedTransport(d.consumer.transport, held=held, broken=broken)
    d.consumer.transport = sliced
    recv_on(d, ranks, D_BLOCKS)
    wait_until(lambda: sliced.broken_posts == 1 and sliced.held_polls >= 3, "D saw the failure with a read held")
    out.collect(ranks)
    load = d.target.requests["req-d"]
    assert load.transfer is not None and load.transfer in d.target.loads  # still LOADING, not freed
    assert out.received == [set()] and out.failed == [set()]  # vLLM keeps the blocks
    assert held in ranks.p[0].source.leases and out.sent[0] == set()  # P rank 0's blocks stay pinned

    sliced.release_held()  # the sibling read is posted and lands; only now does the failure settle

    def failed() -> bool:
        out.collect(ranks)
        return bool(out.failed[0]) and all(out.sent)

    wait_until(failed, "the request failed and both P ranks released", RELEASE_WAIT_S)
    assert out.received == [{"req-d"}] and out.failed == [{"req-d"}]
    assert "req-d" not in d.target.requests  # policy fail: the blocks went back once nothing was in flight
    name = LAYER.format(0)
    landed = ranks.d_caches[0][name][list(D_BLOCKS), :1]  # P rank 0's head arrived into blocks still reserved
    assert torch.equal(landed, ranks.p_caches[0][name][list(P_BLOCKS)])
    assert replay_problems(ranks.log_dir, (2, 1)) == []


@pytest.mark.parametrize("ranks", [(1, 2)], indirect=True, ids=["p1-d2"])
def test_failed_consumer_leaves_the_lease_to_its_sibling_on_p(ranks: Ranks) -> None:
    """P TP 1 -> D TP 2: one lease, two consumers. D rank 0's slice fails and it tells P at once; P keeps the
    blocks pinned (its sibling consumer may be reading), D rank 1 still claims and reads its slice, and only then
    is the lease released (failed, as vLLM fails the request when any rank failed)."""
    p = ranks.p[0]
    out = settled(ranks)
    grant_everywhere(ranks, P_BLOCKS)
    transfer = p.producer.grants["req-p"].transfer
    assert p.source.leases[transfer].consumers == 2
    ranks.d[0].consumer.transport = SlicedTransport(ranks.d[0].consumer.transport, broken=transfer)
    recv_on(ranks.d[0], ranks, D_BLOCKS)

    def rank0_failed() -> bool:
        out.collect(ranks)
        return bool(out.failed[0])

    wait_until(rank0_failed, "D rank 0 failed its slice")
    # P recorded D rank 0's failure and deferred the release (a private view: no event marks a deferral)
    wait_until(lambda: bool(p.producer._failed_consumers), "P heard of D rank 0's failure")
    out.collect(ranks)
    assert transfer in p.source.leases and out.sent == [set()]  # still pinned for D rank 1
    recv_on(ranks.d[1], ranks, D_BLOCKS)

    def rank1_done() -> bool:
        out.collect(ranks)
        return bool(out.received[1]) and bool(out.sent[0])

    wait_until(rank1_done, "D rank 1 read its slice and P released", RELEASE_WAIT_S)
    assert out.failed[1] == set() and out.received == [{"req-d"}, {"req-d"}] and out.sent == [{"req-p"}]
    name = LAYER.format(1)
    assert torch.equal(ranks.d_caches[1][name][list(D_BLOCKS)], ranks.p_caches[0][name][list(P_BLOCKS), 1:])
    ranks.d[1].on_metadata(_finishes())
    wait_until(lambda: "req-d" not in ranks.d[1].target.requests, "D rank 1 freed req-d")
    problems = replay_problems(ranks.log_dir, (1, 2))
    assert problems == []


def _finishes() -> Any:
    from kvlifecycle.adapters.vllm.metadata import KVLifecycleMetadata

    return KVLifecycleMetadata(finishes=["req-d"])


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 2), (4, 4), (2, 1), (4, 1), (8, 2), (1, 2), (1, 4), (2, 8)])
def test_source_ranks_and_consumers_agree_with_the_tp_plan(p_tp: int, d_tp: int) -> None:
    """What a D rank connects to before any handshake (``tp_source_ranks``) and what P counts at grant time
    (``tp_consumers``) are what the handshake's plan later reads and counts."""
    from kvlifecycle.layout import tp_consumers, tp_plan, tp_source_ranks

    heads, block = 8, 16
    for d_rank in range(d_tp):
        plan = tp_plan(p_tp=p_tp, d_tp=d_tp, d_rank=d_rank, p_block_bytes=heads // p_tp * block,
                       d_block_bytes=heads // d_tp * block, num_kv_heads=heads, kv_layout="HND")
        assert tp_source_ranks(p_tp=p_tp, d_tp=d_tp, d_rank=d_rank) == tuple(r.p_rank for r in plan.reads)
        assert tp_consumers(p_tp=p_tp, d_tp=d_tp) == plan.consumers_per_p_rank


def test_connector_threads_start_free_of_the_forward_threads_core_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker binds the forward thread to one core; threads the connector starts from it run on every
    CPU, and the forward thread's own binding is back afterwards."""
    if (os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a process allowed on 2 CPUs")
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm import worker

        before = os.sched_getaffinity(0)
        seen: list[set[int]] = []
        try:
            os.sched_setaffinity(0, {min(before)})  # what VLLM_CPU_OMP_THREADS_BIND does to the forward thread
            bound = worker._widen_affinity()
            thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            thread.start()
            thread.join(10)
            worker._restore_affinity(bound)
            assert os.sched_getaffinity(0) == {min(before)}
        finally:
            os.sched_setaffinity(0, before)
    assert bound == {min(before)} and len(seen) == 1 and seen[0] == before


def test_dp_ranks_listen_on_base_plus_dp_index_times_tp_plus_tp_rank(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """P of DP 2 x TP 2, one ``WorkerSide`` per (DP rank, TP rank), as vLLM builds them (its DP engine ids differ
    only in their ``_dp<d>`` tail): each listens on base + DP index x TP size + TP rank, and the four keep apart
    event logs under four worker names."""
    dp_size, tp = 2, 2
    with vllm_or_stubs(monkeypatch):
        from kvlifecycle.adapters.vllm.config import AdapterConfig

        config = AdapterConfig(side_channel_port=free_port_run(dp_size * tp), log_dir=str(tmp_path))
        shape = dict(num_blocks=NB, block_size=BS, head_size=HD, dtype=torch.float32)
        workers: list[Any] = []
        try:
            for dp in range(dp_size):
                for rank in range(tp):
                    # vLLM's DP engine id: "<id>_dp<d>"; a dense model's workers see DP size 1, index d
                    worker = _worker(monkeypatch, "kv_producer", tp, rank, f"0123456789ab-engine_dp{dp}", config,
                                     dp_index=dp)
                    workers.append(worker)
                    worker.register_kv_caches(kv_caches("LBHNC", LAYERS, heads=HEADS // tp, **shape))
            ports = [int(w.producer.address.rsplit(":", 1)[1]) for w in workers]
            names = [w.source.worker for w in workers]
        finally:
            for worker in reversed(workers):
                worker.shutdown()
    base = config.side_channel_port
    assert ports == [base + dp * tp + rank for dp in range(dp_size) for rank in range(tp)]
    assert names == [f"p-0123456789ab-dp{dp}-tp{rank}" for dp in range(dp_size) for rank in range(tp)]
    assert len({d.name.rsplit("-", 1)[0] for d in tmp_path.glob("source-*")}) == dp_size * tp
