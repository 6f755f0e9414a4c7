"""(a), D's half: this process maps P's regions and runs rounds of requests through its :class:`TargetLedger` and
the CUDA IPC transport, as a decode worker's scheduler loop does — reserve, ``start_load`` → ``post(READ)`` → poll
→ ``part_done`` — timing each step, and, for comparison, a contiguous copy at the same point of the same loop."""

from __future__ import annotations

import ctypes
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvlifecycle.transport import Notification, XferStatus

from . import fastpath
from .in_process import InProcess
from .shapes import spin


class PipeToP:
    """D's end of the pipe to P: every wait bounded, P's failure raised here with its traceback."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def send(self, msg: tuple[Any, ...]) -> None:
        self.conn.send(msg)

    def recv(self, timeout: float = 120.0, spin: bool = False) -> Any:
        if spin:
            # D busy-waits for P's grant, as a decode worker's busy scheduler loop would: a core that slept in a
            # blocking read starts the timed request cold (caches, clocks), while the ceiling it is compared with
            # is timed in a hot loop. Bounded like the blocking wait.
            deadline = time.perf_counter() + timeout
            while not self.conn.poll(0):
                if time.perf_counter() > deadline:
                    raise TimeoutError("P process did not answer")
        elif not self.conn.poll(timeout):
            raise TimeoutError("P process did not answer")
        msg = self.conn.recv()
        if msg[0] == "error":
            raise RuntimeError(f"P process failed:\n{msg[1]}")
        return msg


@dataclass
class Round:
    """One round's requests and the stamps taken along its path."""

    count: int
    grants: list[Any]
    names: list[str]
    dst_sets: np.ndarray
    handles: dict[Any, Any] = field(default_factory=dict)
    marks: list[float] = field(default_factory=list)
    batch_marks: list[float] = field(default_factory=list)
    ready: list[tuple[Any, Any, float]] = field(default_factory=list)
    t_start: float = 0.0
    t_issued: float = 0.0
    t_ready: float = 0.0
    first_seen: float = 0.0
    part_done_s: float = 0.0
    kernel_s: float = 0.0


class DecodeLoop:
    """D connected to P: the rounds, and what they record (single requests' steps, post stages, multi-request
    splits) for :mod:`.e2e` to take medians of."""

    def __init__(self, torch: Any, ip: InProcess, pipe: PipeToP, transport: Any, ledger: Any, peer: Any,
                 peer_epoch: int, plan: Any) -> None:
        self.torch, self.ip, self.pipe, self.transport, self.ledger = torch, ip, pipe, transport, ledger
        self.peer, self.peer_epoch, self.plan = peer, peer_epoch, plan
        self.src_views = [torch.as_tensor(fastpath.raw_cuda_array(a, (ip.pool, ip.block_bytes), (ip.block_bytes, 1)),
                                          device=ip.device) for a in fastpath.mapped_base_addrs(transport, peer)]
        self.rng = np.random.default_rng(11)
        self.counter = 0
        self.stages: list[dict[str, float]] = []  # KVL_CUDA_IPC_TRACE=1: where post's time goes
        self.multi: dict[str, list[dict[str, float]]] = {}  # rounds of several requests: where their wall goes
        self.steps: list[list[float]] = []  # single requests: start_load, post, wait for the event, ledger completion
        self.flat_src, self.flat_dst = ip.src.view(-1), ip.dst.view(-1)
        self.ceiling_end = torch.cuda.Event()
        self.drv = fastpath.driver(transport)
        self.fast = self.drv.fast
        self.fast.cuMemcpyDtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        self.raw_end = self.drv.event_create(timing=False)
        self.raw_src, self.raw_dst = self.flat_src.data_ptr(), self.flat_dst.data_ptr()

    def close(self) -> None:
        self.drv.event_destroy(self.raw_end)

    def raw_copy(self, nbytes: int) -> None:
        """The least host work a contiguous copy can take: two driver calls and a spin on the event."""
        fast, raw_end = self.fast, self.raw_end
        stream = self.torch._C._cuda_getCurrentRawStream(self.ip.device.index)
        rc = fast.cuMemcpyDtoDAsync_v2(self.raw_dst, self.raw_src, nbytes, stream)
        rc = rc or fast.cuEventRecord(raw_end, stream)
        if rc:
            raise RuntimeError(f"raw ceiling copy failed ({rc})")
        deadline = time.perf_counter() + 30
        while fast.cuEventQuery(raw_end) == 600:
            if time.perf_counter() > deadline:
                raise TimeoutError("raw ceiling copy did not complete in 30 s")

    def round(self, count: int, n: int, verify: bool, batched: bool = False, ceiling: str = ""
              ) -> tuple[float, float, list[float], bool, dict[str, Any]]:
        """``count`` requests of ``n`` blocks: posted one by one, or (``batched``) as one ``post_batch`` (a
        scheduler step's loads). Each ledger step's records are appended at its end, after the launch.

        ``ceiling`` ("torch" or "driver"): at the moment the transfer would start, time a contiguous copy of
        the same bytes first (D's own buffers; wall, launch to its event seen, as the ceiling is timed; torch's
        ``copy_``, or the raw driver calls), then run the round as usual, untimed. The ceiling measured at the
        same point of the same loop, side by side.

        Returns (wall, device time per request, P's round trips, byte-exact, the last request's stats)."""
        rnd = self._reserve(count, n, verify)
        ceiling_s = 0.0
        if ceiling:
            ceiling_s = self._time_ceiling(count * n * self.ip.regions * self.ip.block_bytes, ceiling)
        rnd.t_start = rnd.t_ready = time.perf_counter()
        rnd.marks.append(rnd.t_start)
        self._issue(rnd, batched)
        rnd.t_issued = time.perf_counter()
        self._wait_ready(rnd)
        stats0 = self._observe_and_release(rnd, single=count == 1 and not ceiling)
        # start_load of the first -> the last request's blocks READY_FOR_ATTENTION
        elapsed = ceiling_s if ceiling else rnd.t_ready - rnd.t_start
        if count > 1 and not ceiling:  # where a multi-request round's wall goes (medians per row, in µs)
            self.multi.setdefault(("batched" if batched else "pipelined"), []).append(self._split(rnd, batched))
        exact = self._verify(rnd) if verify else True
        for name in rnd.names:
            self.ledger.finish(name)
        self.ledger.commit()
        _, roundtrip, missing = self.pipe.recv()
        if missing:
            raise RuntimeError(f"P never saw completions for {missing}")
        return elapsed, rnd.kernel_s / count, roundtrip, exact, stats0

    def _reserve(self, count: int, n: int, verify: bool) -> Round:
        """Ask P for ``count`` grants and reserve as many destinations (poisoned when the round is checked)."""
        self.pipe.send(("grant", count, n))
        _, grants = self.pipe.recv(spin=True)
        dst_sets = self.rng.permutation(self.ip.pool)[: count * n].astype(np.int32).reshape(count, n)
        names = []
        for i in range(count):
            name = f"d{self.counter}"
            self.counter += 1
            self.ledger.reserve(name, dst_sets[i])
            names.append(name)
            if verify:
                self.ip.poison(dst_sets[i])
        self.ledger.commit()
        self.torch.cuda.synchronize(self.ip.device)
        return Round(count, grants, names, dst_sets)

    def _time_ceiling(self, nbytes: int, how: str) -> float:
        t0 = time.perf_counter()
        if how == "driver":
            self.raw_copy(nbytes)
        else:
            self.flat_dst[:nbytes].copy_(self.flat_src[:nbytes])
            self.ceiling_end.record()
            spin(self.ceiling_end)
        ceiling_s = time.perf_counter() - t0
        self.torch.cuda.synchronize(self.ip.device)
        return ceiling_s

    def _issue(self, rnd: Round, batched: bool) -> None:
        # on the timed path: attributes read once into locals, as the closures this loop was written with did
        ledger, peer, peer_epoch, names, marks = self.ledger, self.peer, self.peer_epoch, rnd.names, rnd.marks
        with ledger.step():  # the gates act now; their log records are appended after the launch
            for i, (_, transfer, generation, _) in enumerate(rnd.grants):
                ledger.start_load(names[i], transfer, generation=generation, peer=peer, peer_epoch=peer_epoch)
                marks.append(time.perf_counter())
                if not batched:
                    self._post_one(rnd, i)
            if batched:
                self._post_all(rnd)

    def _post_one(self, rnd: Round, i: int) -> None:
        transport = self.transport
        p_name, transfer, generation, src = rnd.grants[i]
        note = Notification(p_name, transfer, generation, transport.epoch, "done", 0)
        rnd.handles[transfer] = (transport.post("READ", self.plan, rnd.dst_sets[i], src, notification=note,
                                                transfer=transfer), rnd.names[i])
        rnd.marks.append(time.perf_counter())

    def _post_all(self, rnd: Round) -> None:
        """The step's requests as one post_batch."""
        transport = self.transport
        batch = [(rnd.dst_sets[i], src, Notification(p_name, transfer, generation, transport.epoch, "done", 0),
                  transfer) for i, (p_name, transfer, generation, src) in enumerate(rnd.grants)]
        t_batch = time.perf_counter()
        posted = transport.post_batch("READ", self.plan, batch)
        t_batched = time.perf_counter()
        rnd.handles.update({b[3]: (h, rnd.names[i]) for i, (b, h) in enumerate(zip(batch, posted, strict=True))})
        t_launched = fastpath.launched_at(transport, posted[0].id, t_batched)
        marks_c = fastpath.stage_marks(transport)  # the compiled post's own stamps (traced): when it was called
        t_call = marks_c[1] if marks_c and marks_c[0] == "native" else t_batch
        rnd.batch_marks.extend((t_batch, t_call, t_launched, t_batched))

    def _wait_ready(self, rnd: Round) -> None:
        """Poll until every request is done; each completion's part_done in a ledger step of its own."""
        transport, ledger, handles, marks = self.transport, self.ledger, rnd.handles, rnd.marks
        deadline = time.perf_counter() + 60
        while handles:
            done = []
            for transfer, (handle, _name) in handles.items():
                status = transport.poll(handle)
                if status is XferStatus.FAILED:
                    raise RuntimeError(f"transfer failed: {transport.error(handle)}")
                if status is XferStatus.DONE:
                    done.append(transfer)
            if not done:
                if time.perf_counter() > deadline:
                    raise TimeoutError("e2e transfers did not complete in 60 s")
                continue
            t_seen = time.perf_counter()
            rnd.first_seen = rnd.first_seen or t_seen
            marks.append(t_seen)
            # The blocks are READY_FOR_ATTENTION once part_done returns: that ends a request's latency (the
            # step's log records follow, at its end).
            with ledger.step():
                for transfer in done:
                    ledger.part_done(transfer)
                t_ready = time.perf_counter()
            rnd.t_ready = t_ready
            rnd.part_done_s += t_ready - t_seen
            marks.append(t_ready)
            rnd.ready += [(transfer, handles.pop(transfer)[0], t_seen) for transfer in done]

    def _observe_and_release(self, rnd: Round, single: bool) -> dict[str, Any]:
        """Metrics and the handles' release change no block state: they follow once every request of the round
        is READY (as an engine's step makes its loads visible first), off the latency path."""
        transport, ledger = self.transport, self.ledger
        stats0: dict[str, Any] = {}
        for transfer, handle, t_seen in rnd.ready:
            t_done = fastpath.done_at(transport, handle.id)
            st = transport.stats(handle)
            extra = transport.stage_times(handle)
            ledger.observe_transfer_stats(transfer, st)
            transport.release(handle)
            rnd.kernel_s += st.t_xfer_s
            if single:
                rnd.marks.append(time.perf_counter())
                step = [b - a for a, b in itertools.pairwise(rnd.marks)]
                # split of the wait: until the event was seen complete, then stats + notification to P
                step += [t_done - rnd.marks[2], t_seen - t_done]
                self.steps.append(step)
                if extra:
                    self.stages.append(extra)
            stats0 = {"t_post_us": st.t_post_s * 1e6, "t_xfer_us": st.t_xfer_s * 1e6, "backend": st.backend,
                      "descriptors_replaced": st.desc_count}
        return stats0

    @staticmethod
    def _split(rnd: Round, batched: bool) -> dict[str, float]:
        count, marks = rnd.count, rnd.marks
        starts = marks[1:count + 1] if batched else marks[1:2 * count:2]
        befores = marks[:count] if batched else marks[0:2 * count:2]
        split = {"start_loads": sum(b - a for a, b in zip(befores, starts, strict=True)),
                 "issue": rnd.t_issued - rnd.t_start, "until_first_seen": rnd.first_seen - rnd.t_issued,
                 "first_seen_to_last_ready": rnd.t_ready - rnd.first_seen, "part_dones": rnd.part_done_s,
                 "transfer_device": rnd.kernel_s / count if batched else rnd.kernel_s}
        if batched:
            t_batch, t_call, t_launched, t_batched = rnd.batch_marks
            split |= {"post_batch_to_launch": t_launched - t_batch, "post_batch_python_before_call":
                      t_call - t_batch, "post_batch_after_launch": t_batched - t_launched,
                      "step_exit": rnd.t_issued - t_batched}
        return split

    def _verify(self, rnd: Round) -> bool:
        torch, ip = self.torch, self.ip
        exact = True
        for i, (_, _, _, src) in enumerate(rnd.grants):
            s = torch.from_numpy(src).to(ip.device).long()
            d = torch.from_numpy(rnd.dst_sets[i]).to(ip.device).long()
            for r in range(ip.regions):
                exact = exact and bool(torch.equal(ip.dst[r][d], self.src_views[r][s]))
        return exact
