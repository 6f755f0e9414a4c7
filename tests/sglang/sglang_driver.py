"""Drive one side of a real SGLang P/D handoff through SGLang's own classes (manager, sender/receiver, bootstrap
server over HTTP + ZMQ), for the tests in ``tests/sglang`` and for ``bench/sglang_pd.sh``.

Runs in the SGLang virtual environment::

    python tests/sglang/sglang_driver.py --role prefill --backend kvlifecycle --port 18800 --out p.json
    python tests/sglang/sglang_driver.py --role decode  --backend kvlifecycle --port 18800 --out d.json

Both sides derive the same plan from ``--seed`` (room ids, source and destination pages, aux rows, KV bytes), so
the decode side checks byte for byte what landed, and that every page no successful room targeted is untouched.
KV lives in DRAM (torch CPU tensors); aux rows are SGLang's own ``MetadataBuffers`` where they construct on CPU.
Every wait is bounded (``--deadline``); the result is one JSON file.

Tensor parallelism: each attention TP rank is its own process (``--tp`` size, ``--tp-rank``; prefill rank 0 runs
the bootstrap server, a prefill waits for ``--decode-tp`` decode ranks to finish). ``--heads`` splits the model's
KV heads over the ranks, each prefill rank filling its own heads' bytes; every decode rank checks that its pages
hold exactly its heads of the prefill's pages (``--page-size 1`` for differing TP sizes).

Scenarios (``--scenario``):
  transfer   ``--rooms`` rooms after one warm-up room (the benchmark's; also plain correctness)
  serial     the transfer rooms one at a time (the benchmark's small-room mode): the decode opens a room only once
             the one before it succeeded and reports each room's latency, from making its receiver to its Success
  suite      transfer rooms + abort by decode before metadata, abort by decode after metadata (P holds the send
             until D's abort went out), abort by prefill, and a room no decode ever claims (bootstrap timeout)
  restart    prefill: serve ``--rooms`` rooms, then crash (``os._exit``) holding one bootstrapped room;
             ``--generation 2`` is the restarted prefill, which serves the rooms after it. Decode: all of it.
  never      decode only: a receiver whose prefill never appears, polled as SGLang's scheduler polls it (the
             parallel info retried every poll, ``init`` only once it arrived)
  silent     a live prefill that bootstraps a room and never serves it (the serve bound ends it on both sides)
  refused    the decode registers a KV layout the prefill refuses (give the decode another ``--item-bytes``)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

SENTINEL = 0xA5
ROOM_BASE = 7_000_000
# Loopback only, unless the caller's environment says otherwise: UCX over shared memory and TCP on ``lo``, SGLang's
# bootstrap on 127.0.0.1. Set by main() before SGLang (and through it UCX) is first imported, in run_prefill or
# run_decode; importing this module changes no environment.
LOOPBACK_DEFAULTS = (("UCX_TLS", "self,sm,tcp"), ("UCX_NET_DEVICES", "lo"), ("SGLANG_HOST_IP", "127.0.0.1"),
                     ("HOST_IP", "127.0.0.1"))


@dataclass
class Plan:
    seed: int
    num_pages: int
    layers: int
    item_bytes: int
    pages_per_room: int
    rooms: int
    aux_rows: int
    page_size: int = 16
    heads: int = 1  # the model's KV heads; a rank of TP t holds heads // t of them
    room_ids: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = ROOM_BASE + 1000 * self.seed
        n = self.rooms
        self.room_ids = {
            "warmup": [base],
            "transfer": [base + 1 + i for i in range(n)],
            "abort_d": [base + 200],
            "abort_d_meta": [base + 201],
            "abort_p": [base + 202],
            "unclaimed": [base + 203],
            "crash": [base + 300],
            "after": [base + 400 + i for i in range(n)],
            "never": [base + 500],
            "silent": [base + 600],
            "refused": [base + 700],
        }
        every = [r for rooms in self.room_ids.values() for r in rooms]
        need = len(every) * self.pages_per_room
        if need > self.num_pages:
            raise SystemExit(f"plan needs {need} pages, have {self.num_pages}: raise --num-pages")
        rng = np.random.default_rng(self.seed)
        src = rng.permutation(self.num_pages)[:need].astype(np.int32)
        dst = rng.permutation(self.num_pages)[:need].astype(np.int32)
        self.src: dict[int, np.ndarray] = {}
        self.dst: dict[int, np.ndarray] = {}
        self.aux_src: dict[int, int] = {}
        self.aux_dst: dict[int, int] = {}
        for i, room in enumerate(every):
            self.src[room] = np.sort(src[i * self.pages_per_room:(i + 1) * self.pages_per_room])
            self.dst[room] = dst[i * self.pages_per_room:(i + 1) * self.pages_per_room]
            self.aux_src[room] = i % self.aux_rows
            self.aux_dst[room] = (self.aux_rows - 1 - i) % self.aux_rows

    def kv_bytes(self, tp: int = 1, rank: int = 0) -> list[np.ndarray]:
        """KV regions (K and V per layer) of attention TP rank ``rank`` of ``tp``, the same bytes in every process
        for one seed. The model's rows (``item_bytes``: page_size tokens × ``heads`` heads, token-major as SGLang's
        MHA pages) are random per (page, token, head, byte); a rank's row is its heads' slice of each token. A
        prefill rank fills its own heads' bytes; a decode rank expects its heads, whichever prefill ranks they came
        from (the concatenation of several, or a slice of one)."""
        if self.item_bytes % (self.page_size * self.heads) or self.heads % tp:
            raise SystemExit(f"--item-bytes {self.item_bytes} must split into page size {self.page_size} × "
                             f"{self.heads} heads, and the heads into TP {tp}")
        rng = np.random.default_rng(self.seed + 1)
        mine = slice(rank * self.heads // tp, (rank + 1) * self.heads // tp)
        shape = (self.num_pages, self.page_size, self.heads, self.item_bytes // (self.page_size * self.heads))
        return [np.ascontiguousarray(rng.integers(0, 256, size=shape, dtype=np.uint8)[:, :, mine, :])
                .reshape(self.num_pages, -1) for _ in range(2 * self.layers)]

    def row_bytes(self, tp: int) -> int:
        return self.item_bytes // tp

    def aux_row_bytes(self, buf_index: int, row: int, nbytes: int) -> np.ndarray:
        rng = np.random.default_rng((self.seed, buf_index, row))
        return rng.integers(0, 256, size=nbytes, dtype=np.uint8)


def _log(*parts: Any) -> None:
    print(f"[driver {os.getpid()} {time.strftime('%H:%M:%S')}]", *parts, file=sys.stderr, flush=True)


class Side:
    """One SGLang KV manager with DRAM KV pages and metadata rows, built the way SGLang's scheduler builds it."""

    def __init__(self, args: argparse.Namespace, plan: Plan) -> None:
        import torch
        from sglang.srt import runtime_context as rc
        from sglang.srt.disaggregation import utils as disagg_utils
        from sglang.srt.disaggregation.utils import DisaggregationMode, KVClassType, TransferBackend
        from sglang.srt.server_args import ServerArgs

        if args.backend == "kvlifecycle":
            from kvlifecycle.adapters.sglang.plugin import install

            install()
        self.torch = torch
        self.args = args
        self.plan = plan
        self.backend = TransferBackend(args.backend)
        self.mode = DisaggregationMode.PREFILL if args.role == "prefill" else DisaggregationMode.DECODE
        sa = ServerArgs(model_path="dummy", device="cpu", host="127.0.0.1", disaggregation_mode=args.role,
                        disaggregation_transfer_backend=args.backend, disaggregation_bootstrap_port=args.port,
                        port=args.port + 1, page_size=plan.page_size, tp_size=args.tp)
        # one scheduler rank of attention TP args.tp: SGLang derives attn_tp_size / attn_tp_rank from these
        rc.publish(sa, role="scheduler", ranks=rc.SpawnRanks(world_rank=args.tp_rank, dp_rank=None, gpu_id=0))
        # one rank, no torch.distributed: the groups SGLang's managers read exist but are never used
        rc.get_parallel().override_permanently(pp_group=None, world_group=None, attn_tp_group=None)
        # looked up at call time: the plugin's hook replaces the module attribute
        self.get = lambda kind: disagg_utils.get_kv_class(self.backend, getattr(KVClassType, kind))
        self.bootstrap = None
        if self.mode == DisaggregationMode.PREFILL and args.tp_rank == 0:  # one bootstrap server per prefill
            self.bootstrap = self.get("BOOTSTRAP_SERVER")("127.0.0.1", args.port)
        if self.mode == DisaggregationMode.PREFILL:
            self.kv = [torch.from_numpy(a.copy()) for a in plan.kv_bytes(args.tp, args.tp_rank)]
        else:
            self.kv = [torch.full((plan.num_pages, plan.row_bytes(args.tp)), SENTINEL, dtype=torch.uint8)
                       for _ in range(2 * plan.layers)]
        self.aux = self._aux_buffers()
        kv_args = self.get("KVARGS")()
        kv_args.engine_rank = args.tp_rank
        kv_args.pp_rank = 0
        kv_args.system_dp_rank = 0
        kv_args.rust_http_port = None
        kv_args.kv_cache_dtype_str = "auto"
        kv_args.kv_layout = None
        kv_args.prefill_start_layer = 0
        kv_args.prefill_end_layer = plan.layers
        kv_args.kv_data_ptrs = [t.data_ptr() for t in self.kv]
        kv_args.kv_data_lens = [t.nbytes for t in self.kv]
        kv_args.kv_item_lens = [t[0].nbytes for t in self.kv]
        kv_args.kv_data_mem_kinds = ["DRAM"] * len(self.kv)
        kv_args.num_draft_entries = 0
        kv_args.kv_layer_ids = list(range(plan.layers)) * 2
        if self.mode == DisaggregationMode.PREFILL:  # SGLang's decode sets no head counts before its manager
            kv_args.kv_head_num = plan.heads // args.tp
            kv_args.total_kv_head_num = plan.heads
        kv_args.page_size = plan.page_size
        kv_args.aux_data_ptrs = [t.data_ptr() for t in self.aux]
        kv_args.aux_data_lens = [t.nbytes for t in self.aux]
        kv_args.aux_item_lens = [t[0].nbytes for t in self.aux]
        kv_args.ib_device = None
        kv_args.gpu_id = 0
        for name in ("state_types", "state_data_ptrs", "state_data_lens", "state_item_lens", "state_layer_ids",
                     "state_dim_per_tensor", "state_slice_outer_counts", "state_conv_shard_groups"):
            setattr(kv_args, name, [])
        kv_args.is_hybrid_mla_backend = False
        kv_args.swa_kv_cache_layout = None
        kv_args.mla_compression_ratios = None
        kv_args.kv_buf_groups = 1
        kv_args.hidden_kv_layers = plan.layers
        kv_args.draft_kv_layers = 0
        self.kv_args = kv_args
        t0 = time.monotonic()
        self.mgr = self.get("MANAGER")(kv_args, self.mode, sa, args.mla)
        _log(f"{args.backend} {args.role} manager up in {time.monotonic() - t0:.2f}s")
        self.addr = f"127.0.0.1:{args.port}"

    def _aux_buffers(self) -> list:
        torch = self.torch
        try:
            from sglang.srt.disaggregation.utils import MetadataBuffers

            meta = MetadataBuffers(self.plan.aux_rows, hidden_size=64, hidden_states_dtype=torch.float32,
                                   max_sampling_mask_tokens=16)
            bufs = [b for b in (meta.output_ids, meta.cached_tokens, meta.output_token_logprobs_val,
                                meta.output_token_logprobs_idx, meta.output_top_logprobs_val,
                                meta.output_top_logprobs_idx, meta.output_topk_p, meta.output_topk_index,
                                meta.output_hidden_states, meta.bootstrap_room) if b is not None]
            self.metadata_buffers = meta
        except Exception as exc:
            _log(f"MetadataBuffers unavailable on CPU ({exc}); plain tensors instead")
            bufs = [torch.zeros((self.plan.aux_rows, 16), dtype=torch.int32),
                    torch.zeros((self.plan.aux_rows, 64), dtype=torch.float32),
                    torch.zeros((self.plan.aux_rows, 8), dtype=torch.int64)]
        views = [b.view(torch.uint8).reshape(b.shape[0], -1) for b in bufs]
        if self.args.role == "decode":
            for v in views:
                v.fill_(SENTINEL)
        return bufs

    def aux_views(self) -> list:
        return [b.view(self.torch.uint8).reshape(b.shape[0], -1) for b in self.aux]

    def prepare_aux(self, rooms: list[int]) -> None:
        """Draw the aux rows of ``rooms`` ahead: a room's send then only copies them (a row's random draw would
        otherwise sit inside every room's timed path, the same for both backends)."""
        self._aux_ready = {room: [self.torch.from_numpy(self.plan.aux_row_bytes(i, room, v.shape[1]))
                                  for i, v in enumerate(self.aux_views())] for room in rooms}

    def fill_aux(self, room: int) -> None:
        row = self.plan.aux_src[room]
        ready = getattr(self, "_aux_ready", {}).get(room)
        for i, v in enumerate(self.aux_views()):
            v[row] = ready[i] if ready is not None else self.torch.from_numpy(self.plan.aux_row_bytes(i, room,
                                                                                                        v.shape[1]))

    def close(self) -> None:
        close = getattr(self.mgr, "close", None)
        if close is not None:
            close()


def _failure_reason(obj: Any) -> str:
    try:
        obj.failure_exception()
    except Exception as exc:
        return str(exc)
    return ""


def run_prefill(args: argparse.Namespace, plan: Plan) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    side = Side(args, plan)
    Sender = side.get("SENDER")
    ids = plan.room_ids
    if args.scenario in ("transfer", "serial"):
        order = ids["warmup"] + ids["transfer"]
    elif args.scenario == "suite":
        order = ids["warmup"] + ids["transfer"] + ids["abort_d"] + ids["abort_d_meta"] + ids["abort_p"] + \
            ids["unclaimed"]
    elif args.scenario == "restart":
        order = ids["warmup"] + ids["transfer"] + ids["crash"] if args.generation == 1 else ids["after"]
    elif args.scenario == "silent":
        order = ids["warmup"] + ids["silent"]
    elif args.scenario == "refused":
        order = []  # the decode is refused at registration: the prefill only serves the bootstrap
    else:
        raise SystemExit(f"prefill has no part in scenario {args.scenario!r}")
    side.prepare_aux(order)
    hold_file = Path(args.sync_dir) / "abort_d_meta.sent" if args.sync_dir else None
    result: dict[str, Any] = {"role": "prefill", "backend": args.backend, "rooms": {}, "pid": os.getpid(),
                              "log_dir": getattr(side.mgr, "ledger_log_dir", None),
                              "epoch": getattr(side.mgr, "kvl_epoch", None)}
    senders: dict[int, Any] = {}
    sent: set[int] = set()
    reserved_at_send: dict[int, int] = {}
    done: dict[int, dict] = {}
    t_first_send: float | None = None
    timed = set(ids["transfer"]) if args.scenario in ("transfer", "serial") else set()
    deadline = time.monotonic() + args.deadline
    active = list(order[:1])  # the warm-up room first, alone
    queue = list(order[1:])
    # serial: the senders of the next two rooms wait for their decode (as the rooms of a scheduler's bootstrap queue
    # do), not every room's at once: polling many idle senders would take the shared cores from the one room timed
    window = 2 if args.scenario == "serial" else len(order)
    while (active or queue) and time.monotonic() < deadline:
        if not active or (active == order[:1] and order[0] in done) or \
                (args.scenario == "serial" and len(active) < window and queue and order[0] in done):
            active = [r for r in active if r not in done]
            take = max(window - len(active), 0)
            active, queue = active + queue[:take], queue[take:]
        for room in list(active):
            if room in done:
                continue
            s = senders.get(room)
            if s is None:
                s = senders[room] = Sender(side.mgr, side.addr, room)
            state = s.poll()
            if state == KVPoll.WaitingForInput and room not in sent:
                if room in ids["silent"]:
                    continue  # alive, heartbeating, bootstrapped, and never sends
                if room in ids["abort_p"]:
                    s.abort()
                    sent.add(room)
                    continue
                if room in ids["crash"]:
                    if any(r not in done for r in order if r not in ids["crash"]):
                        continue  # crash only once every other room concluded: nothing else is in flight
                    _log("crash: holding a bootstrapped room, exiting without a word")
                    Path(args.out).write_text(json.dumps({**result, "crashed": True}))
                    os._exit(0)
                if room in ids["abort_d_meta"] and hold_file is not None:
                    if not hold_file.exists():
                        continue  # P holds the send until D's abort went out
                    # the race SGLang's scheduler can hit: its last poll said WaitingForInput, the ABORT has been
                    # processed since, and send() comes now. The backend must not write.
                    if side.mgr.p_room_status(room) != KVPoll.Failed:
                        continue
                streamer = getattr(side.mgr, "streamer", None)
                if streamer is not None:  # the decode ranks that reserved the room when the prefill may start
                    reserved_at_send[room] = streamer.reservations(str(room))
                s.init(len(plan.src[room]), plan.aux_src[room])
                side.fill_aux(room)
                if room in timed and t_first_send is None:
                    t_first_send = time.monotonic()
                pages = plan.src[room]
                if args.chunked and room % 2 == 1 and pages.size > 1:
                    # chunked prefill: the first chunk goes out before the last (which carries the aux row)
                    s.send(pages[: pages.size // 2])
                    s.send(pages[pages.size // 2:])
                else:
                    s.send(pages)
                sent.add(room)
            elif state in (KVPoll.Success, KVPoll.Failed):
                reason = _failure_reason(s) if state == KVPoll.Failed else ""
                if state == KVPoll.Success:
                    s.clear()
                done[room] = {"status": "success" if state == KVPoll.Success else "failed", "reason": reason,
                              "t": time.monotonic()}
                active.remove(room)
        time.sleep(0.0005)
    for room in order:
        result["rooms"][str(room)] = done.get(room, {"status": "timeout", "reason": "driver deadline"})
    result["reserved_at_send"] = {str(room): n for room, n in reserved_at_send.items()}
    if timed and all(done.get(r, {}).get("status") == "success" for r in timed):
        result["t_first_send"] = t_first_send
        result["t_all_done"] = max(done[r]["t"] for r in timed)
    ledger = getattr(side.mgr, "ledger", None)
    if ledger is not None:
        result["ledger"] = {"counts": ledger.counts(), "stats": ledger.stats, "refusals": ledger.refusals,
                            "leases": len(ledger.leases)}
        result["malformed"] = getattr(side.mgr, "side_channel_refused", None)
        result["rank_socket_refused"] = side.mgr.malformed
        streamer = getattr(side.mgr, "streamer", None)
        result["streams"] = dict(streamer.counts) if streamer is not None else {}
    # stay up until the decode is done with us (its heartbeats and acks still reach us)
    linger = time.monotonic() + args.linger
    done_files = [Path(args.sync_dir) / f"decode{rank}.done" for rank in range(args.decode_tp)] if args.sync_dir \
        else []
    while time.monotonic() < linger and not (done_files and all(f.exists() for f in done_files)):
        time.sleep(0.05)
    side.close()
    if ledger is not None:
        result["ledger"]["leases_at_exit"] = len(ledger.leases)
        result["ledger"]["counts_at_exit"] = ledger.counts()
        result["streams_pending_at_exit"] = side.mgr.streamer.pending() if hasattr(side.mgr, "streamer") else None
    return result


def _corrupt_landed(streams: Any, count: int) -> None:
    """A fault on the way: the first ``count`` layer batches that carry P's digest get one byte of their first page
    flipped in D's memory after they landed, just before D checks them (the check must refuse each)."""
    left = [count]
    check = streams._batch_verified

    def flip_then_check(stream: Any, batch: Any) -> Any:
        if left[0] > 0 and batch.digest is not None:
            left[0] -= 1
            first_region = streams.consumer.digester._groups[0][0]  # D's pages, in place
            first_region[int(stream.blocks[batch.lo]), 0] ^= 0x01
        return check(stream, batch)

    streams._batch_verified = flip_then_check


def run_decode(args: argparse.Namespace, plan: Plan) -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    side = Side(args, plan)
    if args.corrupt_landed:
        _corrupt_landed(side.mgr.streams, args.corrupt_landed)
    Receiver = side.get("RECEIVER")
    ids = plan.room_ids
    addr = side.addr
    if args.scenario == "never":
        addr = f"127.0.0.1:{args.absent_port}"
    result: dict[str, Any] = {"role": "decode", "backend": args.backend, "rooms": {}, "pid": os.getpid(),
                              "log_dir": getattr(side.mgr, "ledger_log_dir", None)}
    deadline = time.monotonic() + args.deadline

    def wait_info(target: str, limit: float) -> bool:
        end = min(deadline, time.monotonic() + limit)
        while time.monotonic() < end:
            if side.mgr.try_ensure_parallel_info(target):
                return True
            time.sleep(0.2)
        return False

    def open_room(room: int, *, metadata: bool = True) -> Any:
        r = Receiver(side.mgr, addr, room)
        r.init(0)
        if metadata and r.poll() != KVPoll.Failed:
            r.send_metadata(plan.dst[room], plan.aux_dst[room])
        return r

    def settle(receivers: dict[int, Any], done: dict[int, dict]) -> None:
        while len(done) < len(receivers) and time.monotonic() < deadline:
            for room, r in receivers.items():
                if room in done:
                    continue
                state = r.poll()
                if state in (KVPoll.Success, KVPoll.Failed):
                    seen, reason = time.monotonic(), ""  # before clear(): the room's time ends at its Success
                    if state == KVPoll.Failed:
                        acked = None
                        if room in aborted and hasattr(r, "is_abort_release_safe"):
                            # like SGLang's deferred KV release: hold the pages until P acknowledged (bounded)
                            hold = min(deadline, time.monotonic() + 20.0)
                            while not (acked := r.is_abort_release_safe()) and time.monotonic() < hold:
                                time.sleep(0.005)
                        reason = _failure_reason(r)
                    else:
                        acked = None
                        r.clear()
                    done[room] = {"status": "success" if state == KVPoll.Success else "failed",
                                  "reason": reason, "t": seen, "abort_acked": acked}
            time.sleep(0.0005)

    receivers: dict[int, Any] = {}
    done: dict[int, dict] = {}
    aborted = set(ids["abort_d"]) | set(ids["abort_d_meta"])
    if args.scenario == "never":
        # as SGLang's decode queue does: make the receiver, then poll it while retrying the parallel info;
        # init() comes only once the info arrived (here: never)
        room = ids["never"][0]
        r = receivers[room] = Receiver(side.mgr, addr, room)
        ok = False
        while room not in done and time.monotonic() < deadline:
            if not ok and side.mgr.try_ensure_parallel_info(addr):
                ok = True
                r.init(0)
            state = r.poll()
            if state in (KVPoll.Success, KVPoll.Failed):
                done[room] = {"status": "success" if state == KVPoll.Success else "failed",
                              "reason": _failure_reason(r), "t": time.monotonic(), "abort_acked": None}
            time.sleep(0.05)
        result["parallel_info"] = ok
    elif args.scenario in ("silent", "refused"):
        if not wait_info(addr, args.deadline):
            raise SystemExit(f"prefill bootstrap at {addr} never answered")
        rooms = ids["warmup"] + ids["silent"] if args.scenario == "silent" else ids["refused"]
        for room in rooms:
            receivers[room] = open_room(room)
            if room in ids["warmup"]:
                settle(receivers, done)
        settle(receivers, done)
    else:
        if not wait_info(addr, args.deadline):
            raise SystemExit(f"prefill bootstrap at {addr} never answered")
        warm = ids["warmup"][0]
        receivers[warm] = open_room(warm)
        settle(receivers, done)
        if args.scenario == "suite":
            # malformed frames on the prefill rank's side channel, and a foreign one on its SGLang rank socket:
            # refused and counted, nothing else lost
            import zmq  # SGLang's rank socket speaks zmq

            from kvlifecycle.sidechannel import SideChannelClient, SideChannelRefused, encode_frame

            info = (receivers[warm].bootstrap_infos or [{}])[0]
            side_channel = SideChannelClient(str(info.get("kvl_side")), [], timeout_s=30.0)
            refusals = []
            for frame in (b"\xc1 not a side-channel frame", encode_frame(b"\x92\xa3hb", 1)):  # no header; no message
                try:
                    side_channel.request_raw(frame)
                except SideChannelRefused as exc:
                    refusals.append(exc.code)
            side_channel.close()
            ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
            rank_sock: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
            rank_sock.setsockopt(zmq.LINGER, 1000)
            rank_sock.connect(f"tcp://{info.get('rank_ip')}:{info.get('rank_port')}")
            rank_sock.send_multipart([b"KVL1", b"\xc1 not msgpack"])
            time.sleep(0.3)  # refused before the rooms below start
            rank_sock.close()
            result["malformed_sent"] = 2
            result["malformed_answers"] = refusals  # the side channel's answers, as the sender heard them
            result["foreign_sent"] = 1
        timed = ids["transfer"]
        if args.scenario == "serial":
            latencies = []
            for room in timed:  # one room at a time: the next once this one concluded
                t_open = time.monotonic()
                receivers[room] = open_room(room)
                settle(receivers, done)
                if done.get(room, {}).get("status") == "success":
                    latencies.append(done[room]["t"] - t_open)
            result["room_latencies_s"] = latencies
        for room in (r for r in timed if r not in receivers):
            receivers[room] = open_room(room)
        if args.scenario == "suite":
            for room in ids["abort_d"]:
                receivers[room] = open_room(room, metadata=False)
                receivers[room].abort()
            for room in ids["abort_d_meta"]:
                receivers[room] = open_room(room)
                time.sleep(0.3)
                receivers[room].abort()
                if args.sync_dir:
                    (Path(args.sync_dir) / "abort_d_meta.sent").write_text("1")
            for room in ids["abort_p"]:
                receivers[room] = open_room(room)
        if args.scenario == "restart":
            for room in ids["crash"]:
                receivers[room] = open_room(room)
        settle(receivers, done)
        if args.scenario in ("transfer", "serial") and all(done.get(r, {}).get("status") == "success" for r in timed):
            result["t_all_success"] = max(done[r]["t"] for r in timed)
        if args.scenario == "restart":
            # the restarted prefill serves the next rooms: the new epoch must be picked up, not the dead one
            if wait_info(addr, args.deadline):
                for room in ids["after"]:
                    receivers[room] = open_room(room)
                settle(receivers, done)
            result["peer_ranks"] = {k: v.epoch for k, v in getattr(side.mgr, "p_ranks", {}).items()}
    for room in receivers:
        result["rooms"][str(room)] = done.get(room, {"status": "timeout", "reason": "driver deadline"})
    # bytes: every successful room's pages and aux row hold P's bytes; every other page kept the sentinel
    src = plan.kv_bytes(args.tp, args.tp_rank)  # this decode rank's heads of the prefill's bytes
    touched = np.zeros(plan.num_pages, dtype=bool)
    mismatches: list[str] = []
    for room, info in done.items():
        if info["status"] != "success":
            continue
        touched[plan.dst[room]] = True
        for r, region in enumerate(side.kv):
            got = region.numpy()[plan.dst[room]]
            if not np.array_equal(got, src[r][plan.src[room]]):
                mismatches.append(f"room {room} region {r}")
        for i, v in enumerate(side.aux_views()):
            want = plan.aux_row_bytes(i, room, v.shape[1])
            if not np.array_equal(v[plan.aux_dst[room]].numpy(), want):
                mismatches.append(f"room {room} aux buffer {i}")
    untouched_ok = all(bool((region.numpy()[~touched] == SENTINEL).all()) for region in side.kv)
    aux_rows_used = {plan.aux_dst[r] for r, i in done.items() if i["status"] == "success"}
    for v in side.aux_views():
        rows = [i for i in range(v.shape[0]) if i not in aux_rows_used]
        untouched_ok = untouched_ok and bool((v.numpy()[rows] == SENTINEL).all())
    result.update(bytes_equal=not mismatches and any(i["status"] == "success" for i in done.values()),
                  mismatches=mismatches[:20], untouched_ok=untouched_ok,
                  bytes_moved=int(sum(plan.pages_per_room * plan.row_bytes(args.tp) * 2 * plan.layers
                                      for r in ids["transfer"] if done.get(r, {}).get("status") == "success")))
    ledger = getattr(side.mgr, "ledger", None)
    if ledger is not None:
        result["ledger"] = {"counts": ledger.counts(), "stats": ledger.stats, "refusals": ledger.refusals,
                            "loads": len(ledger.loads), "peer_epochs": ledger.peer_epochs}
    if args.sync_dir:
        (Path(args.sync_dir) / f"decode{args.tp_rank}.done").write_text("1")
    time.sleep(0.2)
    side.close()
    return result


def main(argv: list[str] | None = None) -> int:
    for key, value in LOOPBACK_DEFAULTS:
        os.environ.setdefault(key, value)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--backend", default="kvlifecycle")
    ap.add_argument("--scenario", choices=("transfer", "serial", "suite", "restart", "never", "silent", "refused"),
                    default="transfer")
    ap.add_argument("--port", type=int, required=True, help="bootstrap port (127.0.0.1)")
    ap.add_argument("--absent-port", type=int, default=1, help="scenario never: where no prefill listens")
    ap.add_argument("--generation", type=int, default=1, help="restart: 1 = first prefill, 2 = restarted")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--rooms", type=int, default=4)
    ap.add_argument("--pages-per-room", type=int, default=8)
    ap.add_argument("--num-pages", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--item-bytes", type=int, default=4096)
    ap.add_argument("--aux-rows", type=int, default=32)
    ap.add_argument("--deadline", type=float, default=120.0)
    ap.add_argument("--linger", type=float, default=30.0, help="prefill: wait this long for the decodes' done")
    ap.add_argument("--tp", type=int, default=1, help="this side's attention TP size (one process per rank)")
    ap.add_argument("--tp-rank", type=int, default=0, help="this process's attention TP rank")
    ap.add_argument("--decode-tp", type=int, default=1, help="prefill: how many decode ranks report done")
    ap.add_argument("--heads", type=int, default=1, help="the model's KV heads (split over the TP ranks)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page (SGLang's --page-size)")
    ap.add_argument("--sync-dir", default="")
    ap.add_argument("--chunked", action="store_true", help="send odd rooms in two chunks (chunked prefill)")
    ap.add_argument("--mla", action="store_true", help="make the manager an MLA backend's (replicated latent KV)")
    ap.add_argument("--corrupt-landed", type=int, default=0,
                    help="decode: flip one byte of the first page of each of the first N verified layer batches "
                         "after it landed, before the digest check (KVL_SGLANG_VERIFY)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    plan = Plan(args.seed, args.num_pages, args.layers, args.item_bytes, args.pages_per_room, args.rooms,
                args.aux_rows, page_size=args.page_size, heads=args.heads)
    try:
        result = run_prefill(args, plan) if args.role == "prefill" else run_decode(args, plan)
    except BaseException as exc:
        Path(args.out).write_text(json.dumps({"role": args.role, "error": repr(exc),
                                              "traceback": traceback.format_exc()}))
        raise
    Path(args.out).write_text(json.dumps(result, default=str))
    _log("result", json.dumps({k: v for k, v in result.items() if k != "rooms"}, default=str)[:400])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # SGLang's backends leave non-daemon threads behind (NIXL's bootstrap thread)


if __name__ == "__main__":
    sys.exit(main())
