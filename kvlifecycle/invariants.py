"""Invariant checks over ledgers and over event streams (one side, or P and D merged).

The ledgers enforce these by construction; the checks are an independent second opinion used by
``kvlifecycle replay --check`` and by the tests after every step. They recompute what they need from scratch
rather than trusting the ledger's own counters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.machines import SourceState, TargetState


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.detail}"


def check_source(ledger) -> list[Violation]:
    state, pins = ledger.state, getattr(ledger, "pins", None)  # derived views: build each once
    out: list[Violation] = []
    n = ledger.num_blocks
    expected_pins = np.zeros(n, dtype=np.int64)
    pinned_epoch = np.full(n, -1, dtype=np.int64)
    for lease in ledger.leases.values():
        expected_pins[lease.blocks] += 1
        stale = lease.epochs != ledger.epoch[lease.blocks]
        if stale.any():
            block = int(lease.blocks[int(np.argmax(stale))])
            out.append(
                Violation(
                    "pinned-under-two-epochs",
                    f"lease {lease.transfer} pins block {block} at epoch {int(lease.epochs[stale][0])}, "
                    f"block is at epoch {int(ledger.epoch[block])}",
                )
            )
        prior = pinned_epoch[lease.blocks]
        clash = (prior >= 0) & (prior != lease.epochs)
        if clash.any():
            out.append(
                Violation(
                    "pinned-under-two-epochs",
                    f"block {int(lease.blocks[int(np.argmax(clash))])} pinned by leases of different epochs",
                )
            )
        pinned_epoch[lease.blocks] = lease.epochs
        not_pinned = state[lease.blocks] != SourceState.PINNED_FOR_TRANSFER
        if not_pinned.any():
            block = int(lease.blocks[int(np.argmax(not_pinned))])
            out.append(
                Violation(
                    "left-pinned-while-leased",
                    f"block {block} is {SourceState(int(state[block])).name} "
                    f"while lease {lease.transfer} is live",
                )
            )
    if not np.array_equal(expected_pins, pins):
        block = int(np.argmax(expected_pins != pins))
        out.append(
            Violation(
                "pin-count",
                f"block {block}: {int(pins[block])} pins recorded, {int(expected_pins[block])} live leases",
            )
        )
    pinned = state == SourceState.PINNED_FOR_TRANSFER
    orphan = pinned & (expected_pins == 0)
    if orphan.any():
        out.append(Violation("pinned-without-lease", f"{int(orphan.sum())} block(s), first {int(np.argmax(orphan))}"))
    refs = np.zeros(n, dtype=np.int64)
    for req in ledger.requests.values():
        refs[req.blocks] += 1
    held = (state == SourceState.ALLOCATED) | (state == SourceState.READY)
    unowned = held & (refs == 0)
    if unowned.any():
        out.append(Violation("held-without-owner", f"{int(unowned.sum())} ALLOCATED/READY block(s) no request holds"))
    free_but_held = (state == SourceState.FREE) & (refs > 0)
    if free_but_held.any():
        out.append(Violation("free-but-owned", f"block {int(np.argmax(free_but_held))} is FREE but a request holds it"))
    return out


def check_target(ledger) -> list[Violation]:
    state = ledger.state  # a derived view: build it once
    out: list[Violation] = []
    owner = np.zeros(ledger.num_blocks, dtype=np.int64)
    for name, req in ledger.requests.items():
        owner[req.blocks] += 1
        states = state[req.blocks]
        loading = states == TargetState.LOADING
        if loading.any() and req.transfer is None:
            out.append(Violation("loading-without-transfer", f"request {name} has LOADING blocks and no live load"))
        if req.transfer is not None and not loading.all():
            out.append(Violation("load-state", f"request {name} has a live load but blocks not all LOADING"))
    if (owner > 1).any():
        out.append(Violation("block-two-owners", f"block {int(np.argmax(owner > 1))} held by two requests"))
    stray = (state != TargetState.FREE) & (owner == 0)
    if stray.any():
        out.append(
            Violation("held-without-owner", f"block {int(np.argmax(stray))} is not FREE and no request holds it")
        )
    return out


def check_quiescent(ledger) -> list[Violation]:
    """At quiescence: no pins, no leases, no in-flight transfers."""
    state, pins = ledger.state, getattr(ledger, "pins", None)  # derived views: build each once
    out: list[Violation] = []
    if ledger.side == "source":
        if ledger.leases:
            out.append(
                Violation("quiescent-leases", f"{len(ledger.leases)} lease(s) left: {sorted(ledger.leases)[:5]}")
            )
        pinned = int((state == SourceState.PINNED_FOR_TRANSFER).sum())
        if pinned or int(pins.sum()):
            out.append(Violation("quiescent-pins", f"{pinned} PINNED block(s), {int(pins.sum())} pins"))
    else:
        if ledger.loads:
            out.append(
                Violation("quiescent-loads", f"{len(ledger.loads)} load(s) in flight: {sorted(ledger.loads)[:5]}")
            )
        loading = int((state == TargetState.LOADING).sum())
        if loading:
            out.append(Violation("quiescent-loading", f"{loading} LOADING block(s)"))
    return out


def check_target_events(events: Iterable[ev.Event]) -> list[Violation]:
    """Independent of the ledger code: no request is READY_FOR_ATTENTION without a completion for every expected
    part of its load, and no part completes twice."""
    out: list[Violation] = []
    expected: dict[str, int] = {}
    done: dict[str, set[int]] = {}
    for e in events:
        if isinstance(e, ev.TgtLoadStarted):
            expected[e.transfer] = e.parts
            done[e.transfer] = set()
        elif isinstance(e, ev.TgtPartDone):
            parts = done.get(e.transfer)
            if parts is None:
                out.append(Violation("part-without-load", f"transfer {e.transfer} part {e.part} with no live load"))
                continue
            if e.part in parts:
                out.append(Violation("duplicate-part", f"transfer {e.transfer} part {e.part} applied twice"))
            parts.add(e.part)
            if len(parts) == expected[e.transfer]:
                del done[e.transfer]
        elif isinstance(e, ev.TgtLoadFailed):
            done.pop(e.transfer, None)
        elif isinstance(e, ev.TgtLocalFilled):
            pass
    return out


def check_merged(source_events: Iterable[ev.Event], target_events: Iterable[ev.Event]) -> list[Violation]:
    """Cross-side rules on P's and D's logs (HLC-ordered): P must not release a lease under a reader.

    - a load D started after P had already released that transfer's lease (D read blocks P may have reused);
    - P released a lease as failed or cancelled while D's pull of it was still in flight (completion and expiry
      are the only ways a lease may end under a reader). In push mode P is the one reading its blocks (to write
      them into D's): once its write failed, releasing before D has heard of it is the right order.
    """
    out: list[Violation] = []
    released: dict[str, tuple[int, str]] = {}
    for e in source_events:
        if isinstance(e, ev.SrcLeaseReleased):
            released[e.transfer] = (e.hlc, e.reason)
    started: dict[str, int] = {}
    settled: dict[str, int] = {}
    pushed: set[str] = set()
    for e in target_events:
        if isinstance(e, ev.TgtLoadStarted):
            started[e.transfer] = e.hlc
            if e.mode == "push":
                pushed.add(e.transfer)
        elif isinstance(e, ev.TgtPartDone | ev.TgtLoadFailed):
            settled[e.transfer] = e.hlc
    for transfer, start in started.items():
        if transfer not in released:
            continue
        rel_hlc, reason = released[transfer]
        if rel_hlc < start and reason != "completed":
            out.append(Violation("read-after-release", f"D started loading {transfer} after P released it ({reason})"))
        end = settled.get(transfer)
        under_reader = transfer not in pushed and start <= rel_hlc and (end is None or rel_hlc < end)
        if reason in ("failed", "cancelled") and under_reader:
            out.append(
                Violation("released-under-reader", f"P released {transfer} ({reason}) while D's load was in flight")
            )
    return out
