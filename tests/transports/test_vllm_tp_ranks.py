"""The vLLM connector's worker side under tensor parallelism with every rank in its own process: P TP 2 -> D TP 1.

Two P ranks and one D rank, each a spawned process holding one ``WorkerSide`` (``adapters/vllm/worker.py``) as a
vLLM worker process would: its own ledger, its own side channel (port + TP rank), its own NIXL agent and, where the
KV lives in VRAM, its own CUDA IPC export. The caches are bf16 in FlashAttention's K/V-outer layout with vLLM's HND
stride order (``[2, blocks, block_size, heads, head_size]`` over head-major memory: the layout heterogeneous TP
needs), each P rank holding half of the KV heads, D all of them.

- ``cuda``: on one GPU (the ranks are processes, so D maps each P rank through a real CUDA IPC handle): D's links
  to both P ranks chose ``cuda_ipc``, D's blocks hold P rank 0's heads then P rank 1's, bit for bit, no other D
  block is written, P's caches are unchanged, every rank's log replays clean (two sources, one target, consistent).
- ``cpu``: the same processes over NIXL on DRAM (this harness, checked where there is no GPU).
- token-major blocks (NHD) cannot be split by heads: the handshake refuses, D fails the request, both P ranks are
  told and release, no D byte is written, and the logs still replay clean.

vLLM cannot be installed on the GPU machine: its import-time names are stubbed there (``vllm_stubs``).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from vllm_stubs import LAYER, free_port, kv_caches, vllm_or_stubs

HAVE_CUDA = torch.cuda.is_available()
NO_CUDA = "needs a CUDA device: torch.cuda.is_available() is False (the CUDA IPC transport moves VRAM only)"

NB, BS, HEADS, HD = 64, 16, 8, 128  # blocks, tokens per block, KV heads over all ranks, head size
LAYERS = [0, 1, 2, 3]
P_TP, D_TP = 2, 1
P_BLOCKS, D_BLOCKS = (40, 2, 17, 33, 5, 61), (0, 1, 2, 3, 4, 5)
WAIT_S = 90.0  # spawning a rank (torch, CUDA, NIXL) and a first copy (Triton compiles) take seconds


@dataclass(frozen=True)
class RankSpec:
    role: str  # "kv_producer" | "kv_consumer"
    tp: int
    rank: int
    heads: int  # this rank's KV heads
    form: str  # a vllm_stubs.KV_FORMS key
    device: str
    port: int  # P rank 0's side-channel port (the adapter adds the TP rank)
    log_dir: str
    seed: int | None  # random caches (P) or zeros (D)


def _vllm_config(spec: RankSpec) -> Any:
    model = SimpleNamespace(model="tiny-random-llama", get_total_num_kv_heads=lambda: HEADS, get_head_size=lambda: HD)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role=spec.role, kv_load_failure_policy="fail"),
        cache_config=SimpleNamespace(block_size=BS, enable_prefix_caching=False),
        parallel_config=SimpleNamespace(data_parallel_index=0, tensor_parallel_size=spec.tp),
        model_config=model,
    )


def _rank_main(conn: Any, spec: RankSpec) -> None:
    """One vLLM rank: a WorkerSide over this rank's caches, driven over ``conn`` by the test (vLLM's metadata
    broadcast, its forward thread's ``get_finished``); ``get_transfer_results`` is drained between commands."""
    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        with pytest.MonkeyPatch.context() as patch, vllm_or_stubs(patch):
            patch.setattr(sys.modules["vllm.distributed.parallel_state"], "get_tensor_model_parallel_rank",
                          lambda: spec.rank)
            from kvlifecycle.adapters.vllm.config import AdapterConfig
            from kvlifecycle.adapters.vllm.worker import WorkerSide

            config = AdapterConfig(side_channel_port=spec.port, log_dir=spec.log_dir, load_timeout_s=WAIT_S,
                                   decode_tp_size=D_TP)
            caches = kv_caches(spec.form, LAYERS, num_blocks=NB, block_size=BS, heads=spec.heads, head_size=HD,
                               device=spec.device, seed=spec.seed)
            engine = "engine-p" if spec.role == "kv_producer" else "engine-d"
            worker = WorkerSide(_vllm_config(spec), config, engine, SimpleNamespace(num_blocks=NB))
            try:
                worker.register_kv_caches(caches)
                conn.send(("ready", type(worker.fast_transport).__name__))
                _serve(conn, worker, caches)
            finally:
                worker.shutdown()
        conn.send(("bye", None))
    except BaseException:  # report, so the test fails with the reason instead of a timeout
        conn.send(("error", traceback.format_exc()))


def _serve(conn: Any, worker: Any, caches: dict[str, torch.Tensor]) -> None:
    from kvlifecycle.adapters.vllm.metadata import GrantCmd, KVLifecycleMetadata, PeerRef, RecvCmd

    sent: set[str] = set()
    received: set[str] = set()
    failed: set[str] = set()
    while True:
        if not conn.poll(0.002):
            s, r, f = worker.get_transfer_results()  # what vLLM's forward thread does every step
            sent |= s
            received |= r
            failed |= f
            continue
        cmd, *args = conn.recv()
        if cmd == "grant":
            worker.on_metadata(KVLifecycleMetadata(grants=[GrantCmd("req-p", tuple(args[0]))]))
            conn.send(("granted", worker.producer.grants["req-p"].transfer))
        elif cmd == "recv":
            address, p_tp, blocks = args
            peer = PeerRef("req-d", address, "req-p", p_tp)
            worker.on_metadata(KVLifecycleMetadata(recvs=[RecvCmd(peer, tuple(blocks))]))
            conn.send(("queued", None))
        elif cmd == "results":
            conn.send(("results", (sorted(sent), sorted(received), sorted(failed), _links(worker))))
        elif cmd == "finish":
            worker.on_metadata(KVLifecycleMetadata(finishes=["req-d"]))
            deadline = time.monotonic() + WAIT_S
            while "req-d" in worker.target.requests and time.monotonic() < deadline:
                time.sleep(0.002)
            conn.send(("finished", "req-d" not in worker.target.requests))
        elif cmd == "bytes":
            torch.cuda.synchronize() if torch.cuda.is_available() else None
            conn.send(("bytes", {name: c.view(torch.int16).cpu().numpy() for name, c in caches.items()}))
        elif cmd == "stop":
            return


def _links(worker: Any) -> dict[str, dict[str, Any]]:
    """D: per P rank address, the path its link chose and how the fast path reaches that P."""
    if worker.consumer is None:
        return {}
    out = {}
    for address, link in worker.consumer.links.items():
        choice = link.choice
        info: dict[str, Any] = {"backend": choice.backend if choice is not None else None,
                                "reason": choice.reason if choice is not None else None}
        if link.data is not None:
            info |= link.data.peer_info(link.data_peer)
        out[address] = info
    return out


class Rank:
    def __init__(self, ctx: Any, spec: RankSpec) -> None:
        self.spec = spec
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_rank_main, args=(child, spec), daemon=True)
        self.proc.start()

    def recv(self, timeout_s: float = WAIT_S) -> Any:
        assert self.conn.poll(timeout_s), f"rank {self.spec.role} {self.spec.rank} did not answer"
        kind, value = self.conn.recv()
        if kind == "error":
            raise AssertionError(f"rank {self.spec.role} {self.spec.rank} failed:\n{value}")
        return value

    def ask(self, *cmd: Any) -> Any:
        self.conn.send(cmd)
        return self.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(AssertionError, OSError, EOFError):
                self.conn.send(("stop",))
                self.recv(30)
            self.proc.join(15)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@contextlib.contextmanager
def tp_ranks(form: str, device: str, log_dir: Path) -> Any:
    """P TP 2 and D TP 1 as three processes, caches registered; (P ranks, D rank, P rank 0's address)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    while not _port_free(port + 1):
        port = free_port()
    common = dict(form=form, device=device, port=port, log_dir=str(log_dir))
    specs = [RankSpec("kv_producer", P_TP, r, HEADS // P_TP, seed=10 + r, **common) for r in range(P_TP)]
    specs += [RankSpec("kv_consumer", D_TP, 0, HEADS // D_TP, seed=None, **common)]
    ranks = [Rank(ctx, spec) for spec in specs]
    try:
        fast = [rank.recv() for rank in ranks]
        want = "CudaIpcTransport" if device.startswith("cuda") else "NoneType"
        assert fast == [want] * len(ranks), f"fast path per rank: {fast}"
        yield ranks[:P_TP], ranks[P_TP], f"tcp://127.0.0.1:{port}"
    finally:
        for rank in reversed(ranks):
            rank.close()


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def settle(p_ranks: list[Rank], d_rank: Rank) -> tuple[list[list[str]], list[str], list[str], dict[str, Any]]:
    """Ask every rank for vLLM's view until D's load settled and every P rank released (bounded)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        sent = [p.ask("results")[0] for p in p_ranks]
        _, received, failed, links = d_rank.ask("results")
        if (received and all(sent)) or time.monotonic() > deadline:
            return sent, received, failed, links
        time.sleep(0.01)


def replay_problems(log_dir: Path, sides: tuple[int, int]) -> list[str]:
    """Every rank's log on both sides: each quiescent, every (source, target) pair consistent."""
    from kvlifecycle.replay import check, check_pair, replay

    dirs = sorted(p for p in log_dir.iterdir() if p.is_dir() and p.name.startswith(("source-", "target-")))
    counts = (sum(p.name.startswith("source-") for p in dirs), sum(p.name.startswith("target-") for p in dirs))
    if counts != sides:
        return [f"expected {sides} source/target logs, found {[p.name for p in dirs]}"]
    results = [replay(p) for p in dirs]
    return [str(v) for r in results for v in check(r, quiescent=True)] + [str(v) for v in check_pair(results)]


DEVICES = [pytest.param("cpu", marks=pytest.mark.nixl, id="cpu-nixl"),
           pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.nixl,
                                         pytest.mark.skipif(not HAVE_CUDA, reason=NO_CUDA)], id="cuda-ipc")]


@pytest.fixture(autouse=True)
def _nixl() -> None:
    pytest.importorskip("nixl._api", reason="needs the real NIXL package (nixl==1.5.1): the connector's transport")


@pytest.mark.parametrize("device", DEVICES)
def test_p_tp2_to_d_tp1_moves_each_ranks_heads_between_processes(device: str, tmp_path: Path) -> None:
    """D TP 1 reads its 8 heads from two P TP 2 processes (4 each) into the same D blocks; vLLM would see the
    request finished on D and on both P ranks; bytes are checked bit for bit on the three ranks' own caches."""
    with tp_ranks("kv-outer-HND", device, tmp_path) as (p_ranks, d_rank, address):
        transfers = [p.ask("grant", P_BLOCKS) for p in p_ranks]  # vLLM broadcasts one scheduler output
        assert len(set(transfers)) == P_TP  # each P rank grants its slice under its own lease
        p_before = [p.ask("bytes") for p in p_ranks]
        d_rank.ask("recv", address, P_TP, D_BLOCKS)
        sent, received, failed, links = settle(p_ranks, d_rank)
        assert failed == [], f"D reported a failed load; links {links}"
        assert (received, sent) == (["req-d"], [["req-p"]] * P_TP)
        assert sorted(links) == [f"tcp://127.0.0.1:{int(address.rsplit(':', 1)[1]) + r}" for r in range(P_TP)]
        for info in links.values():
            if device.startswith("cuda"):  # real IPC: another process's handles, opened here
                assert info["backend"] == "cuda_ipc", info
                assert not info["same_process"] and info["ipc_mappings"] >= 1, info
            else:
                assert info["backend"] is None  # NIXL on DRAM
        assert d_rank.ask("finish")
        d_after = d_rank.ask("bytes")
        p_after = [p.ask("bytes") for p in p_ranks]
    pi, di = np.array(P_BLOCKS), np.array(D_BLOCKS)
    rest = np.setdiff1d(np.arange(NB), di)
    for i in LAYERS:
        name = LAYER.format(i)
        for before, after in zip(p_before, p_after, strict=True):
            assert np.array_equal(before[name], after[name]), name  # P was read, not written
        want = np.concatenate([p[name] for p in p_before], axis=3)  # [2, blocks, block_size, heads, head_size]
        got = d_after[name]
        assert np.array_equal(got[:, di], want[:, pi]), name  # bit for bit (int16 views of the bf16 caches)
        assert not got[:, rest].any(), name  # no other D block written
    assert release_reasons(tmp_path) == [["completed"]] * P_TP
    assert replay_problems(tmp_path, (P_TP, D_TP)) == []


@pytest.mark.parametrize("device", DEVICES)
def test_token_major_blocks_are_refused_and_both_p_ranks_release(device: str, tmp_path: Path) -> None:
    """NHD blocks interleave the heads of every token, so D cannot read one P rank's heads as a slice: the
    handshake refuses, the request fails on D (policy ``fail``), both P ranks release at once (told by D, not at
    lease expiry), nothing is written into D, and the logs replay clean."""
    with tp_ranks("kv-outer-NHD", device, tmp_path) as (p_ranks, d_rank, address):
        for p in p_ranks:
            p.ask("grant", P_BLOCKS)
        d_rank.ask("recv", address, P_TP, D_BLOCKS)
        sent, received, failed, _ = settle(p_ranks, d_rank)
        assert (received, failed, sent) == (["req-d"], ["req-d"], [["req-p"]] * P_TP)
        d_after = d_rank.ask("bytes")
    assert not any(cache.any() for cache in d_after.values())
    assert release_reasons(tmp_path) == [["failed"]] * P_TP  # told by D, not left to expire
    assert replay_problems(tmp_path, (P_TP, D_TP)) == []


def release_reasons(log_dir: Path) -> list[list[str]]:
    """Per P rank's log (in rank order): why each of its leases ended."""
    from kvlifecycle.eventlog import read_events
    from kvlifecycle.events import SrcLeaseReleased

    dirs = sorted((p for p in log_dir.iterdir() if p.name.startswith("source-")), key=lambda p: p.name)
    return [[e.reason for e in read_events(d) if isinstance(e, SrcLeaseReleased)] for d in dirs]
