"""``kvlifecycle bench gpu``: the same-node GPU fast path against NIXL, torch and a contiguous copy, in one run.

A KV request is ``regions × blocks × block_bytes`` (default 64 × 256 × 32 KiB = 512 MiB) plus a small request of
``--small-blocks`` blocks in every region (default 16 → 32 MiB). Block ids are random, distinct, and change every
repetition (so neither the kernel nor the ceiling is served from L2). Paths, all on one device:

(a) ``kvl``: the CUDA IPC transport end to end, two processes. P (a spawned process) allocates its regions, registers
    them (IPC export), allocates + prefill_done + grants in its :class:`SourceLedger`; D (this process) maps P at
    connect, reserves, then ``start_load`` → ``post(READ)`` → polls the completion event → ``part_done`` in its
    :class:`TargetLedger`; the copy's notification tells P, whose ``consumer_done`` releases the lease. Timed on D
    from ``start_load`` to ``part_done`` (wall clock), and P's whole round trip (grant → lease released). Both
    ledgers log to disk and are replayed and checked at the end.
(b) ``nixl``: raw NIXL/UCX, two agents in this process, prepped descriptor lists, READ of the same blocks.
(c) ``torch``: ``index_select`` + ``index_copy_`` over a stacked ``[regions, blocks, bytes]`` tensor.
(d) ``ceiling``: one contiguous device-to-device copy of the same number of bytes.
Also ``kernel``: the batched block-copy kernel alone, in-process, CUDA-event timed.

Wall-clock figures are "launch → completion observed by polling" for every path, so they compare like with like;
CUDA-event figures time the device work alone. Every copy is checked byte for byte (destination poisoned first).

The modules, in the order a run goes through them: :mod:`.shapes` (the requests, id sets, timers' arithmetic),
:mod:`.in_process` (d, c and the kernel), :mod:`.peer` (two GPUs), :mod:`.raw_nixl` (b), :mod:`.e2e` with
:mod:`.e2e_source` (P) and :mod:`.e2e_decode` (D) for (a), :mod:`.budget` (the host budget), :mod:`.summary`
(ratios and goals), :mod:`.table` (the printout) and :mod:`.command` (the verb). :mod:`.fastpath` holds every name
taken from the CUDA IPC transport.
"""

from .budget import ledger_hot_us
from .command import add_arguments, measure, run
from .shapes import GOALS, Shape
from .summary import summarise
from .table import print_table

__all__ = ["GOALS", "Shape", "add_arguments", "ledger_hot_us", "measure", "print_table", "run", "summarise"]
