"""What a run exercised: each edge of both block machines (:mod:`kvlifecycle.machines`) and each fault, counted.

A :class:`LedgerWatch` listens to one ledger incarnation: per recorded event it diffs the blocks' states against the
state before the event and counts the edge taken (a self-loop edge, where the state does not change, is counted
from what the event says), marks the ledger dirty for the invariant checks, and counts each request's lives and
ends, so the quiescence check can say "every request ended exactly once".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from kvlifecycle import events as ev
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import SOURCE_MACHINE, TARGET_MACHINE, MachineSpec, SourceState, TargetState


def edge_names(spec: MachineSpec) -> list[str]:
    return [f"{spec.name}: {e.source} -> {e.dest} ({e.label()})" for e in spec.edges]


ALL_EDGES: tuple[str, ...] = tuple(edge_names(SOURCE_MACHINE) + edge_names(TARGET_MACHINE))

# Edges the simulated engines cannot take, and why; they are listed, never counted as unexercised.
NOT_MODELED = {
    "target: LOADING -> FREE (cancel [not in_flight])": "unreachable: a LOADING request always has a live load "
                                                        "(check_target's loading-without-transfer)",
}


def _edge_index(spec: MachineSpec) -> dict[tuple[type, int, int], list[str]]:
    """(event type, source state, dest state) -> the edges an event of that type may have taken."""
    states = spec.states
    out: dict[tuple[type, int, int], list[str]] = {}
    for record in spec.records:
        for e in spec.edges:
            if e.trigger in record.triggers:
                key = (record.event, int(states[e.source]), int(states[e.dest]))
                out.setdefault(key, []).append(f"{spec.name}: {e.source} -> {e.dest} ({e.label()})")
    return out


_INDEX = {"source": _edge_index(SOURCE_MACHINE), "target": _edge_index(TARGET_MACHINE)}
_LOADING, _PINNED = int(TargetState.LOADING), int(SourceState.PINNED_FOR_TRANSFER)
_SELF_LOOPS = {
    "part_done": "target: LOADING -> LOADING (part_done [not all_parts_done])",
    "layer_landed": "target: LOADING -> LOADING (layer_landed)",
    "cancel": "target: LOADING -> LOADING (cancel [in_flight])",
    "grant": "source: PINNED_FOR_TRANSFER -> PINNED_FOR_TRANSFER (grant)",
    "release": "source: PINNED_FOR_TRANSFER -> PINNED_FOR_TRANSFER (release [not last_pin])",
}


# refusals that show a fault was exercised: (command, reason before its first colon) -> fault
_REFUSAL_FAULTS = {
    ("consumer_done", "stale token"): "late_completion",
    ("consumer_done", "duplicate completion from consumer 0"): "duplicate_completion",
    ("heartbeat", "lease already expired"): "heartbeat_after_expiry",
    ("fail", "stale token"): "fail_after_release",
    ("start_load", "stale token"): "stale_epoch_refused",
    ("heartbeat", "stale token"): "stale_epoch_refused",
    # the copy to host completed after a consumer claimed the GPU lease: the GPU copy stays pinned
    ("hand_over_staged", "claimed"): "staging_copy_races_claim",
}


class LedgerWatch:
    """Listens to one ledger incarnation (see the module docstring)."""

    def __init__(self, ledger: SourceLedger | TargetLedger, coverage: Counter[str],
                 on_ready: Callable[[str], None] | None = None) -> None:
        self.ledger, self.coverage, self.on_ready = ledger, coverage, on_ready
        self.index = _INDEX[ledger.side]
        self.prev = ledger.state
        self.dirty = True
        self.lives: Counter[str] = Counter()
        self.ends: Counter[str] = Counter()
        self.live: set[str] = set(ledger.requests)
        self.request_of: dict[str, str] = {}
        self.events: list[ev.Event] = []
        ledger.listeners.append(self)

    def __call__(self, event: ev.Event) -> None:
        self.dirty = True
        if isinstance(event, ev.Refused):
            fault = _REFUSAL_FAULTS.get((event.command, event.reason.split(":")[0]))
            if fault is not None:
                self.coverage[f"fault: {fault}"] += 1
        elif isinstance(event, ev.SrcLeaseReleased) and event.reason == "expired":
            self.coverage["fault: lease_expired"] += 1
        elif isinstance(event, ev.TgtDigestMismatch):  # what landed failed its digest: the load fails, not READY
            stream = event.num_layers > 0 or event.transfer.startswith("stream:")
            self.coverage["fault: corruption_refused_stream" if stream else "fault: corruption_refused"] += 1
        self.events.append(event)
        ledger = self.ledger
        now = ledger.state
        changed = np.flatnonzero(now != self.prev)
        kind = type(event)
        if changed.size:
            pairs = set(zip(self.prev[changed].tolist(), now[changed].tolist(), strict=True))
            for s, d in pairs:
                for name in self.index.get((kind, s, d), ()):
                    self.coverage[name] += 1
        self._self_loops(event, now)
        self.prev = now
        request = getattr(event, "request", "") or self.request_of.get(getattr(event, "transfer", ""), "")
        if isinstance(event, ev.TgtLoadStarted | ev.SrcGranted):
            self.request_of[event.transfer] = event.request
        if not request:
            return
        if request in ledger.requests and request not in self.live:
            self.live.add(request)
            self.lives[request] += 1
        elif request not in ledger.requests and request in self.live:
            self.live.discard(request)
            self.ends[request] += 1
        if (self.on_ready is not None and isinstance(event, ev.TgtPartDone) and request in ledger.requests
                and ledger.requests[request].state == TargetState.READY_FOR_ATTENTION):
            self.on_ready(request)

    def _self_loops(self, event: ev.Event, now: np.ndarray) -> None:
        ledger = self.ledger
        if isinstance(event, ev.TgtLayersLanded):
            self.coverage[_SELF_LOOPS["layer_landed"]] += 1
        elif isinstance(event, ev.TgtPartDone):
            assert isinstance(ledger, TargetLedger)  # a target event comes from a target ledger
            load = ledger.loads.get(event.transfer)
            if load is not None:
                self.coverage[_SELF_LOOPS["part_done"]] += 1
        elif isinstance(event, ev.TgtCancelled):
            assert isinstance(ledger, TargetLedger)
            cancelled = ledger.requests.get(event.request)
            if cancelled is not None and cancelled.cancel_pending:
                self.coverage[_SELF_LOOPS["cancel"]] += 1
        elif isinstance(event, ev.SrcGranted):
            blocks = ledger.requests[event.request].blocks
            if (self.prev[blocks] == _PINNED).any():
                self.coverage[_SELF_LOOPS["grant"]] += 1
        elif isinstance(event, ev.SrcLeaseReleased):
            req = ledger.requests.get(self.request_of.get(event.transfer, ""))
            if req is not None and (now[req.blocks] == _PINNED).all():
                self.coverage[_SELF_LOOPS["release"]] += 1

    def detach(self) -> None:
        if self in self.ledger.listeners:
            self.ledger.listeners.remove(self)
