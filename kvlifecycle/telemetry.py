"""OpenTelemetry traces and metrics for KV handoffs, fed by a ledger's events.

One concept in one module, longer than most: the mapping from ledger events to spans and instruments. Its parts
(trace identity, the span tree per handoff, the instruments, the env-driven exporters) share the per-handoff state
and are read together; splitting them would spread one event's handling over several files.

``instrument(ledger)`` subscribes to a :class:`~kvlifecycle.ledger.SourceLedger` or
:class:`~kvlifecycle.ledger.TargetLedger` (``ledger.listeners``) and turns its events into:

* **one trace per handoff, across both processes.** P and D never share memory, so both derive the trace from the
  transfer id: the trace id is the first 16 bytes of ``blake2b(transfer)`` and every top-level span of the handoff
  is a child of a *virtual root* span whose id is derived the same way (:func:`handoff_context`). No field needs to
  travel: any process that knows the transfer id lands in the same trace. (The virtual root itself is never
  exported; viewers show the two sides' spans side by side under it. :func:`traceparent` gives the W3C header for
  callers that want to put their own spans, e.g. the engine's prefill, into the same trace.)
* P spans: ``kv.source.handoff`` (allocation → lease released) with children ``kv.prefill`` (allocated → prefill
  done), ``kv.lease`` (granted → released; renewals, deferred cancels, consumer completions, refused stale tokens and
  the expiry are span events) and ``kv.transfer`` (each observed data-plane transfer).
* D spans: ``kv.target.load`` (reserve → ready / failed) with children ``kv.reserved`` (reserve → load posted),
  ``kv.load`` (posted → ready), one ``kv.part_wait`` per part (posted → that part landed) and ``kv.transfer``.
* metrics (histograms) ``kv.transfer.post_time`` (T_post), ``kv.transfer.xfer_time`` (T_xfer),
  ``kv.transfer.bandwidth`` (bytes / T_xfer of successful transfers), ``kv.visible_wait`` (T_visible: D's reserve →
  ready, on the ledger clock); counters ``kv.transfers`` (by ``kv.outcome`` and ``kv.ok``), ``kv.lease.renewals``,
  ``kv.lease.expiries``, ``kv.refusals`` and ``kv.stale_token.refusals``, ``kv.fallback.recompute``; observable
  gauges ``kv.source.pinned_blocks``, ``kv.target.loading_blocks`` and ``kv.target.ready_blocks``.

Only ``opentelemetry-api`` is imported here: exporters and providers are the user's choice. With no SDK configured
the API hands out no-op tracers and instruments and the listener's cost is a dict lookup and a few no-op calls per
event (``kvlifecycle bench lifecycle`` measures it).
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.metrics import (
    CallbackOptions,
    Counter,
    Histogram,
    Meter,
    MeterProvider,
    ObservableGauge,
    Observation,
)
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TracerProvider,
)
from opentelemetry.util.types import AttributeValue

from kvlifecycle import envvars
from kvlifecycle import events as ev
from kvlifecycle._version import __version__
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.machines import SourceState, TargetState
from kvlifecycle.transfer_ids import source_transfers

INSTRUMENTATION_NAME = "kvlifecycle"
INSTRUMENTATION_VERSION = __version__
DORMANT_RECHECK = 64  # events between looks for an SDK provider while none is installed

# events a ledger records that no span or metric reads, and why (the machines' records list every event a side
# records; tests/test_machines.py checks that each is handled here or named here)
NOT_OBSERVED: dict[type[ev.Event], str] = {
    ev.SrcEvicted: "eviction of cached blocks is no part of a handoff (no request or transfer to attach it to)",
    ev.PeerEpochChanged: "a restarted peer shows in the spans of the leases and loads it ends, each with its reason",
}

# release reasons / load outcomes that count as a successful handoff
_OK_OUTCOMES = frozenset({"completed", "ready"})


# --- deterministic trace context -------------------------------------------------------------------------------


def handoff_ids(transfer: str) -> tuple[int, int]:
    """(trace id, virtual root span id) of the handoff ``transfer``: the same in every process."""
    digest = hashlib.blake2b(transfer.encode(), digest_size=24, person=b"kvlifecycle").digest()
    trace_id = int.from_bytes(digest[:16], "big") or 1  # 0 is the invalid trace id
    span_id = int.from_bytes(digest[16:], "big") or 1
    return trace_id, span_id


def handoff_span_context(transfer: str) -> SpanContext:
    trace_id, span_id = handoff_ids(transfer)
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))


def handoff_context(transfer: str) -> Context:
    """An OpenTelemetry ``Context`` whose parent is the handoff's virtual root: spans started in it join the
    handoff's trace (``tracer.start_span(name, context=handoff_context(tid))``)."""
    return trace.set_span_in_context(NonRecordingSpan(handoff_span_context(transfer)))


def traceparent(transfer: str) -> str:
    """The W3C ``traceparent`` header of the handoff's virtual root (for engines that carry one anyway)."""
    trace_id, span_id = handoff_ids(transfer)
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def parse_traceparent(header: str) -> SpanContext:
    """A remote ``SpanContext`` from a W3C ``traceparent``; ``ValueError`` for anything malformed."""
    parts = header.strip().split("-")
    if len(parts) != 4 or len(parts[0]) != 2 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        raise ValueError(f"malformed traceparent {header!r}")
    try:
        trace_id, span_id, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError as exc:
        raise ValueError(f"malformed traceparent {header!r}") from exc
    if trace_id == 0 or span_id == 0:
        raise ValueError(f"traceparent {header!r} has an all-zero id")
    return SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(flags & 0x01))


# --- per-request and per-transfer bookkeeping ------------------------------------------------------------------


@dataclass(slots=True)
class _Request:
    start_ns: int
    at: float  # ledger clock at allocation / reservation
    blocks: int
    prefill_ns: int = 0
    transfer: str | None = None
    cancel_pending: bool = False


@dataclass(slots=True)
class _Handoff:
    request: str
    root: Span
    phase: Span  # kv.lease (P) or kv.load (D); INVALID_SPAN until it starts, just after the root
    started_at: float  # ledger clock at the start of the request
    phase_ns: int = 0
    parts: int = 1
    done: set[int] = field(default_factory=set)
    attributes: dict[str, AttributeValue] = field(default_factory=dict)


def _now_ns() -> int:
    return time.time_ns()


def _epoch_attributes(epochs: np.ndarray) -> dict[str, AttributeValue]:
    """``kv.epoch`` when the request's blocks share one epoch (the usual case), else its range: scalars only (a
    per-block list would cost more to clean and export than the rest of the span)."""
    if epochs.size == 0:
        return {}
    lo, hi = int(epochs.min()), int(epochs.max())
    return {"kv.epoch": lo} if lo == hi else {"kv.epoch.min": lo, "kv.epoch.max": hi}


class _Instruments:
    """The metric instruments, shared by every ledger instrumented against the same meter."""

    def __init__(self, meter: Meter) -> None:
        self.post_time: Histogram = meter.create_histogram(
            "kv.transfer.post_time", unit="s", description="T_post: time to prepare and submit a transfer"
        )
        self.xfer_time = meter.create_histogram(
            "kv.transfer.xfer_time", unit="s", description="T_xfer: submit to completion reported by the backend"
        )
        self.bandwidth = meter.create_histogram(
            "kv.transfer.bandwidth", unit="By/s", description="effective bandwidth of a successful transfer"
        )
        self.visible_wait = meter.create_histogram(
            "kv.visible_wait", unit="s", description="T_visible: D reserve -> KV ready (or failed)"
        )
        self.transfers: Counter = meter.create_counter(
            "kv.transfers", unit="{transfer}", description="handoffs settled, by outcome"
        )
        self.renewals = meter.create_counter("kv.lease.renewals", unit="{renewal}", description="lease renewals")
        self.expiries = meter.create_counter("kv.lease.expiries", unit="{lease}", description="leases that expired")
        self.refusals = meter.create_counter("kv.refusals", unit="{command}", description="refused commands")
        self.stale = meter.create_counter(
            "kv.stale_token.refusals", unit="{command}", description="commands refused for naming a stale token"
        )
        self.digest_mismatches = meter.create_counter(
            "kv.digest.mismatches", unit="{block}", description="blocks whose landed bytes failed their digest"
        )
        self.digest_verified = meter.create_counter(
            "kv.digest.verified", unit="{block}", description="blocks whose landed bytes matched P's digest"
        )
        self.recompute = meter.create_counter(
            "kv.fallback.recompute", unit="{request}", description="failed loads that fell back to recomputing the KV"
        )


_NOOP_INSTRUMENTS = _Instruments(metrics.NoOpMeter(INSTRUMENTATION_NAME))  # what a dormant subscription holds


def is_noop_tracer_provider(provider: TracerProvider) -> bool:
    """Whether ``provider`` records nothing: a no-op, or the API's global default before an SDK is installed."""
    return isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider))


def is_noop_meter_provider(provider: MeterProvider) -> bool:
    """Whether ``provider`` records nothing: a no-op, or the API's global default before an SDK is installed."""
    # the API's global default is a private _ProxyMeterProvider until the application sets a real one
    return isinstance(provider, metrics.NoOpMeterProvider) or type(provider).__name__ == "_ProxyMeterProvider"


class Instrumentation:
    """The subscription :func:`instrument` returns; :meth:`detach` unsubscribes (open spans are ended).

    Dormant until a real (SDK) tracer or meter provider exists: while both are the API's no-ops, an event costs a
    counter decrement, and every ``DORMANT_RECHECK`` events two provider look-ups. An SDK provider installed later
    switches the instrumentation on within that many events (handoffs already under way are traced from then on).
    """

    def __init__(
        self,
        ledger: SourceLedger | TargetLedger,
        tracer_provider: TracerProvider | None = None,
        meter_provider: MeterProvider | None = None,
    ) -> None:
        self.ledger = ledger
        self.side = ledger.side
        self.worker = ledger.worker
        self._tracer_provider = tracer_provider
        self._meter_provider = meter_provider
        # no-ops until activate() finds a real provider; the handlers run only after it, so they never see these
        self.tracer: Tracer = trace.NoOpTracer()
        self.meter: Meter = metrics.NoOpMeter(INSTRUMENTATION_NAME)
        self.metrics: _Instruments | None = None  # None while dormant
        self._m: _Instruments = _NOOP_INSTRUMENTS
        self.active = False
        self._requests: dict[str, _Request] = {}
        self._handoffs: dict[str, _Handoff] = {}
        self._remote_parents: dict[str, SpanContext] = {}
        self._base: dict[str, AttributeValue] = {"kv.side": self.side, "kv.worker": self.worker}
        # each handler takes the event type it is keyed by: Any is the one parameter type all of them accept
        handlers: dict[type[ev.Event], Callable[[Any], None]] = {
            ev.TransferObserved: self._on_observed,
            ev.Refused: self._on_refused,
        }
        if self.side == "source":
            handlers.update(
                {
                    ev.SrcAllocated: self._on_src_allocated,
                    ev.SrcShared: self._on_src_allocated,
                    ev.SrcPrefillDone: self._on_src_prefill_done,
                    ev.SrcGranted: self._on_src_granted,
                    ev.SrcLeaseRenewed: self._on_src_renewed,
                    ev.SrcCancelDeferred: self._on_src_cancel_deferred,
                    ev.SrcConsumerDone: self._on_src_consumer_done,
                    ev.SrcLeaseReleased: self._on_src_released,
                    ev.SrcFreed: self._on_src_gone,
                    ev.SrcAborted: self._on_src_gone,
                }
            )
        else:
            handlers.update(
                {
                    ev.TgtReserved: self._on_tgt_reserved,
                    ev.TgtLoadStarted: self._on_tgt_load_started,
                    ev.TgtLayersLanded: self._on_tgt_layers_landed,
                    ev.TgtLoadDeclined: self._on_tgt_load_declined,
                    ev.TgtPartDone: self._on_tgt_part_done,
                    ev.TgtLoadFailed: self._on_tgt_load_failed,
                    ev.TgtDigestMismatch: self._on_tgt_digest_mismatch,
                    ev.TgtCancelled: self._on_tgt_cancelled,
                    ev.TgtLocalFilled: self._on_tgt_local_filled,
                    ev.TgtFinished: self._on_tgt_finished,
                }
            )
        self._handlers = handlers
        self._gauges: list[ObservableGauge] = []
        # the ledger calls self._listener: a bare countdown closure while dormant (a plain function call is the
        # cheapest thing a listener can be), swapped for the dispatcher once a real provider appears
        self._listener: Callable[[ev.Event], None] = self.__call__ if self.activate() else self._dormant()
        ledger.listeners.append(self._listener)

    # -- public ---------------------------------------------------------------------------------------------------
    def __call__(self, event: ev.Event) -> None:
        handler = self._handlers.get(type(event))
        if handler is not None:
            handler(event)

    def _dormant(self) -> Callable[[ev.Event], None]:
        countdown = [DORMANT_RECHECK]
        listeners = self.ledger.listeners

        def dormant(event: ev.Event) -> None:
            # look for a newly installed SDK provider once every DORMANT_RECHECK events only
            countdown[0] -= 1
            if countdown[0] > 0:
                return
            countdown[0] = DORMANT_RECHECK
            if self.activate():
                if dormant in listeners:
                    listeners[listeners.index(dormant)] = self.__call__
                self._listener = self.__call__
                self(event)

        return dormant

    def activate(self) -> bool:
        """Switch on if a real tracer or meter provider exists now; returns whether the instrumentation is on."""
        if self.active:
            return True
        tracer_provider = self._tracer_provider or trace.get_tracer_provider()
        meter_provider = self._meter_provider or metrics.get_meter_provider()
        tracing = not is_noop_tracer_provider(tracer_provider)
        metering = not is_noop_meter_provider(meter_provider)
        if not (tracing or metering):
            return False
        self.tracer = (
            trace.get_tracer(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION, tracer_provider=tracer_provider)
            if tracing
            else trace.NoOpTracer()
        )
        self.meter = (
            metrics.get_meter(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION, meter_provider=meter_provider)
            if metering
            else metrics.NoOpMeter(INSTRUMENTATION_NAME)
        )
        self.metrics = self._m = _Instruments(self.meter)
        self._gauges = self._register_gauges(self.meter)
        self.active = True
        return True

    def set_remote_parent(self, transfer: str, header: str) -> None:
        """Parent this side's spans of ``transfer`` under a W3C ``traceparent`` received from the peer (e.g. P's own
        span carried in the grant) instead of the derived virtual root. Call before the load/grant is recorded."""
        self._remote_parents[transfer] = parse_traceparent(header)

    def detach(self) -> None:
        """Stop listening; spans still open end now with outcome ``detached``."""
        if self._listener in self.ledger.listeners:
            self.ledger.listeners.remove(self._listener)
        now = _now_ns()
        for handoff in self._handoffs.values():
            for span in (handoff.phase, handoff.root):
                span.set_attribute("kv.outcome", "detached")
                span.end(end_time=now)
        self._handoffs.clear()
        self._requests.clear()

    def shutdown(self) -> None:
        """Detach, and flush and close what this subscription owns (providers it made: see
        :func:`instrument_to_files`). Providers passed in stay the caller's to shut down."""
        self.detach()

    @property
    def subscribed(self) -> bool:
        """Whether this instrumentation still listens to its ledger."""
        return self._listener in self.ledger.listeners

    @property
    def open_handoffs(self) -> int:
        return len(self._handoffs)

    # -- helpers --------------------------------------------------------------------------------------------------
    def _parent(self, transfer: str) -> tuple[Context, list[Link]]:
        """Parent context and links of a handoff's top span. A D load that reads several P ranks at once is named
        ``<request><-<t1>+<t2>...`` by :class:`~kvlifecycle.handoff.Consumer`: it joins the first P transfer's
        trace and links the others'."""
        remote = self._remote_parents.pop(transfer, None)
        if remote is not None:
            return trace.set_span_in_context(NonRecordingSpan(remote)), []
        sources = source_transfers(transfer)
        return handoff_context(sources[0]), [Link(handoff_span_context(t)) for t in sources[1:]]

    def _child(
        self, handoff: _Handoff, name: str, start_ns: int, attributes: dict[str, AttributeValue] | None = None
    ) -> Span:
        return self.tracer.start_span(
            name, context=trace.set_span_in_context(handoff.root), attributes=attributes, start_time=start_ns
        )

    def _register_gauges(self, meter: Meter) -> list[ObservableGauge]:
        ledger = self.ledger
        attrs = dict(self._base)

        def count(state: int) -> Callable[[CallbackOptions], Iterable[Observation]]:
            def callback(_options: CallbackOptions) -> Iterable[Observation]:
                return [Observation(int(np.count_nonzero(ledger.state == state)), attrs)]

            return callback

        if self.side == "source":
            return [
                meter.create_observable_gauge(
                    "kv.source.pinned_blocks",
                    [count(SourceState.PINNED_FOR_TRANSFER)],
                    unit="{block}",
                    description="source blocks pinned for a transfer",
                )
            ]
        return [
            meter.create_observable_gauge(
                "kv.target.loading_blocks",
                [count(TargetState.LOADING)],
                unit="{block}",
                description="target blocks receiving bytes",
            ),
            meter.create_observable_gauge(
                "kv.target.ready_blocks",
                [count(TargetState.READY_FOR_ATTENTION)],
                unit="{block}",
                description="target blocks ready for attention",
            ),
        ]

    def _settle(self, transfer: str, outcome: str, now: int, at: float, detail: str = "") -> _Handoff | None:
        handoff = self._handoffs.pop(transfer, None)
        ok = outcome in _OK_OUTCOMES
        self._m.transfers.add(1, {**self._base, "kv.outcome": outcome, "kv.ok": ok})
        if handoff is None:
            return None
        for span in (handoff.phase, handoff.root):
            span.set_attribute("kv.outcome", outcome)
            if detail:
                span.set_attribute("kv.outcome.detail", detail)
            if not ok:
                span.set_status(Status(StatusCode.ERROR, f"{outcome}: {detail}" if detail else outcome))
            span.end(end_time=now)
        return handoff

    # -- both sides -----------------------------------------------------------------------------------------------
    def _on_observed(self, e: ev.TransferObserved) -> None:
        now = _now_ns()
        # connect-time path probes (Consumer names them "probe:<agent>") are transfers too, but not handoffs
        kind = "probe" if e.transfer.startswith("probe:") else "handoff"
        attrs: dict[str, AttributeValue] = {
            **self._base, "kv.backend": e.backend, "kv.ok": e.ok, "kv.transfer.kind": kind
        }
        self._m.post_time.record(e.t_post_s, attrs)
        self._m.xfer_time.record(e.t_xfer_s, attrs)
        if e.ok and e.t_xfer_s > 0:
            self._m.bandwidth.record(e.nbytes / e.t_xfer_s, attrs)
        start = now - int(max(e.t_xfer_s, 0.0) * 1e9)
        span_attrs: dict[str, AttributeValue] = {
            **attrs,
            "kv.transfer_id": e.transfer,
            "kv.bytes": e.nbytes,
            "kv.descriptors": e.descriptors,
            "kv.t_post_s": e.t_post_s,
            "kv.t_xfer_s": e.t_xfer_s,
        }
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            span_attrs["kv.request_id"] = handoff.request
            span = self._child(handoff, "kv.transfer", start, span_attrs)
        else:  # observed after the lease settled, or on a side that holds no span for it: still the same trace
            span = self.tracer.start_span(
                "kv.transfer",
                context=handoff_context(source_transfers(e.transfer)[0]),
                attributes=span_attrs,
                start_time=start,
            )
        span.add_event("posted", {"kv.t_post_s": e.t_post_s}, timestamp=start + int(max(e.t_post_s, 0.0) * 1e9))
        if not e.ok:
            span.set_status(Status(StatusCode.ERROR, "transfer failed"))
        span.end(end_time=now)

    def _on_refused(self, e: ev.Refused) -> None:
        stale = e.reason.startswith("stale token")
        attrs = {**self._base, "kv.command": e.command}
        self._m.refusals.add(1, attrs)
        if stale:
            self._m.stale.add(1, attrs)
        event_attrs = {
            "kv.command": e.command,
            "kv.reason": e.reason,
            "kv.request_id": e.request,
            "kv.transfer_id": e.transfer,
        }
        name = "refused.stale_token" if stale else "refused"
        handoff = self._handoffs.get(e.transfer) if e.transfer else None
        if handoff is None and e.request:
            req = self._requests.get(e.request)
            handoff = self._handoffs.get(req.transfer) if req is not None and req.transfer else None
        now = _now_ns()
        if handoff is not None:
            handoff.phase.add_event(name, event_attrs, timestamp=now)
        elif e.transfer:
            # a late or stale token for a settled handoff: show it in that handoff's trace all the same
            span = self.tracer.start_span(
                "kv.refused",
                context=handoff_context(source_transfers(e.transfer)[0]),
                attributes={**self._base, **event_attrs},
                start_time=now,
            )
            span.add_event(name, event_attrs, timestamp=now)
            span.set_status(Status(StatusCode.ERROR, e.reason))
            span.end(end_time=now)

    # -- source side ----------------------------------------------------------------------------------------------
    def _on_src_allocated(self, e: ev.SrcAllocated | ev.SrcShared) -> None:
        self._requests[e.request] = _Request(_now_ns(), e.at, len(e.blocks) // 4)

    def _on_src_prefill_done(self, e: ev.SrcPrefillDone) -> None:
        req = self._requests.get(e.request)
        if req is not None:
            req.prefill_ns = _now_ns()

    def _on_src_granted(self, e: ev.SrcGranted) -> None:
        now = _now_ns()
        req = self._requests.get(e.request)
        if req is None:  # instrumented after allocation
            req = self._requests[e.request] = _Request(now, e.at, 0)
        req.transfer = e.transfer
        lease = self.ledger.leases.get(e.transfer) if isinstance(self.ledger, SourceLedger) else None
        attrs: dict[str, AttributeValue] = {
            **self._base,
            "kv.request_id": e.request,
            "kv.transfer_id": e.transfer,
            "kv.generation": e.generation,
            "kv.consumers": e.consumers,
            "kv.peer": e.peer,
            "kv.lease.ttl_s": e.expires_at - e.at,
        }
        if lease is not None:
            attrs.update(_epoch_attributes(lease.epochs))
            attrs["kv.blocks"] = int(lease.blocks.size)
        parent, links = self._parent(e.transfer)
        root = self.tracer.start_span(
            "kv.source.handoff",
            context=parent,
            kind=SpanKind.PRODUCER,
            attributes=attrs,
            links=links,
            start_time=req.start_ns,
        )
        handoff = _Handoff(e.request, root, trace.INVALID_SPAN, req.at, now, attributes=attrs)
        if req.prefill_ns:
            self._child(handoff, "kv.prefill", req.start_ns, {"kv.request_id": e.request}).end(end_time=req.prefill_ns)
        handoff.phase = self._child(
            handoff, "kv.lease", now, {"kv.transfer_id": e.transfer, "kv.generation": e.generation}
        )
        handoff.phase.add_event("lease.granted", {"kv.expires_at": e.expires_at}, timestamp=now)
        self._handoffs[e.transfer] = handoff

    def _on_src_renewed(self, e: ev.SrcLeaseRenewed) -> None:
        self._m.renewals.add(1, self._base)
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            handoff.phase.add_event(
                "lease.renewed", {"kv.expires_at": e.expires_at, "kv.at": e.at}, timestamp=_now_ns()
            )

    def _on_src_cancel_deferred(self, e: ev.SrcCancelDeferred) -> None:
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            handoff.phase.add_event(
                "cancel.deferred", {"kv.why": "a consumer claimed the lease and may be reading"}, timestamp=_now_ns()
            )

    def _on_src_consumer_done(self, e: ev.SrcConsumerDone) -> None:
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            handoff.phase.add_event("consumer.done", {"kv.consumer": e.consumer}, timestamp=_now_ns())

    def _on_src_released(self, e: ev.SrcLeaseReleased) -> None:
        now = _now_ns()
        if e.reason == "expired":
            self._m.expiries.add(1, self._base)
            handoff = self._handoffs.get(e.transfer)
            if handoff is not None:
                handoff.phase.add_event("lease.expired", {"kv.detail": e.detail, "kv.at": e.at}, timestamp=now)
        self._settle(e.transfer, e.reason, now, e.at, e.detail)

    def _on_src_gone(self, e: ev.SrcFreed | ev.SrcAborted) -> None:
        self._requests.pop(e.request, None)

    # -- target side ----------------------------------------------------------------------------------------------
    def _on_tgt_reserved(self, e: ev.TgtReserved) -> None:
        self._requests[e.request] = _Request(_now_ns(), e.at, len(e.blocks) // 4)

    def _on_tgt_load_started(self, e: ev.TgtLoadStarted) -> None:
        now = _now_ns()
        req = self._requests.get(e.request)
        if req is None:
            req = self._requests[e.request] = _Request(now, e.at, 0)
        req.transfer = e.transfer
        attrs: dict[str, AttributeValue] = {
            **self._base,
            "kv.request_id": e.request,
            "kv.transfer_id": e.transfer,
            "kv.generation": e.generation,
            "kv.peer": e.peer,
            "kv.peer_epoch": e.peer_epoch,
            "kv.parts": e.parts,
            "kv.blocks": req.blocks,
        }
        treq = self.ledger.requests.get(e.request)
        if treq is not None:
            attrs.update(_epoch_attributes(treq.epochs))
        parent, links = self._parent(e.transfer)
        root = self.tracer.start_span(
            "kv.target.load",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes=attrs,
            links=links,
            start_time=req.start_ns,
        )
        handoff = _Handoff(e.request, root, trace.INVALID_SPAN, req.at, now, parts=e.parts, attributes=attrs)
        self._child(handoff, "kv.reserved", req.start_ns, {"kv.request_id": e.request}).end(end_time=now)
        handoff.phase = self._child(handoff, "kv.load", now, {"kv.transfer_id": e.transfer, "kv.parts": e.parts})
        self._handoffs[e.transfer] = handoff

    def _on_tgt_layers_landed(self, e: ev.TgtLayersLanded) -> None:
        """A streaming load's layer batch: an event on the load's phase span (one per batch, not per block)."""
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            handoff.phase.add_event("kv.layers_landed", {"kv.part": e.part, "kv.first_layer": e.first_layer,
                                                         "kv.num_layers": e.num_layers,
                                                         "kv.blocks": len(e.blocks) // 4})

    def _on_tgt_load_declined(self, e: ev.TgtLoadDeclined) -> None:
        """A stream the source declined: the load span ends as ``declined``; the reservation stays."""
        handoff = self._handoffs.get(e.transfer)
        if handoff is None:
            return
        req = self._requests.get(handoff.request)
        self._settle(e.transfer, "declined", _now_ns(), e.at, e.reason)
        if req is not None:
            req.transfer = None

    def _on_tgt_part_done(self, e: ev.TgtPartDone) -> None:
        if e.verified:
            self._m.digest_verified.add(e.verified, self._base)
        handoff = self._handoffs.get(e.transfer)
        if handoff is None:
            return
        now = _now_ns()
        handoff.done.add(e.part)
        self._child(handoff, "kv.part_wait", handoff.phase_ns, {"kv.part": e.part}).end(end_time=now)
        if len(handoff.done) < handoff.parts:
            return
        req = self._requests.get(handoff.request)
        outcome = "discarded" if req is not None and req.cancel_pending else "ready"
        self._m.visible_wait.record(e.at - handoff.started_at, {**self._base, "kv.outcome": outcome})
        self._settle(e.transfer, outcome, now, e.at)
        if outcome == "discarded":
            self._requests.pop(handoff.request, None)

    def _on_tgt_digest_mismatch(self, e: ev.TgtDigestMismatch) -> None:
        """Blocks whose bytes failed their digest: counted per block; an event on the load's span names them."""
        units = len(e.expected) // 8
        self._m.digest_mismatches.add(units, self._base)
        handoff = self._handoffs.get(e.transfer)
        if handoff is not None:
            handoff.phase.add_event("kv.digest_mismatch", {"kv.part": e.part, "kv.blocks": units,
                                                           "kv.slice": e.slice_index})

    def _on_tgt_load_failed(self, e: ev.TgtLoadFailed) -> None:
        handoff = self._handoffs.get(e.transfer)
        req = self._requests.get(handoff.request) if handoff is not None else None
        cancelled = req is not None and req.cancel_pending
        outcome = "discarded" if cancelled else ("recompute" if e.recompute else "failed")
        if e.recompute and outcome == "recompute":
            self._m.recompute.add(1, self._base)
        if handoff is not None:
            self._m.visible_wait.record(e.at - handoff.started_at, {**self._base, "kv.outcome": outcome})
        self._settle(e.transfer, outcome, _now_ns(), e.at, e.reason)
        if handoff is not None and outcome != "recompute":
            self._requests.pop(handoff.request, None)
        elif req is not None:
            req.transfer = None

    def _on_tgt_cancelled(self, e: ev.TgtCancelled) -> None:
        req = self._requests.get(e.request)
        if req is None:
            return
        handoff = self._handoffs.get(req.transfer) if req.transfer else None
        if handoff is None:
            self._requests.pop(e.request, None)
            return
        req.cancel_pending = True
        handoff.phase.add_event(
            "cancel.pending", {"kv.why": "load in flight: blocks free when it settles"}, timestamp=_now_ns()
        )

    def _on_tgt_local_filled(self, e: ev.TgtLocalFilled) -> None:
        self._requests.pop(e.request, None)

    def _on_tgt_finished(self, e: ev.TgtFinished) -> None:
        self._requests.pop(e.request, None)


def instrument(
    ledger: SourceLedger | TargetLedger,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
) -> Instrumentation:
    """Subscribe OpenTelemetry traces and metrics to ``ledger``'s events. Providers default to the global ones
    (no-ops until the application installs an SDK). Returns the subscription; ``.detach()`` ends it."""
    return Instrumentation(ledger, tracer_provider, meter_provider)


def count_side_channel_refusals(server: Any, meter_provider: Any = None) -> Any:
    """Count every message a side-channel server refuses (malformed, too deep, unauthenticated, ...) in the counter
    ``kv.sidechannel.refused``, by ``kv.code``. Returns the counter."""
    meter = (meter_provider or metrics.get_meter_provider()).get_meter(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION)
    counter = meter.create_counter("kv.sidechannel.refused", unit="{message}",
                                   description="side-channel messages refused and dropped")
    server.add_refusal_listener(lambda code: counter.add(1, {"kv.code": code}))
    return counter


def count_log_write_failures(meter_provider: Any = None) -> Callable[[], None]:
    """Count every event-log write or fsync failure in this process (a full disk, EIO, a failed fsync) in the counter
    ``kv.log.write_failures``, by ``kv.log.dir`` and ``kv.errno``: a log that cannot be written shows in the metrics,
    not only on stderr. Returns the function that stops counting."""
    from kvlifecycle.eventlog import on_write_failure

    meter = (meter_provider or metrics.get_meter_provider()).get_meter(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION)
    counter = meter.create_counter("kv.log.write_failures", unit="{failure}",
                                   description="event-log writes and fsyncs that failed (records stay pending)")

    def count(log: Any, error: Any) -> None:
        code = errno.errorcode.get(error.errno, str(error.errno)) if error.errno is not None else "none"
        counter.add(1, {"kv.log.dir": str(log.directory), "kv.errno": code})

    return on_write_failure(count)


# --- files, for demos and issue reports (needs the SDK: pip install 'kvlifecycle[otel]') -------------------------

ENV_OTEL_DIR = envvars.OTEL_DIR.name


def instrument_to_files(ledger: SourceLedger | TargetLedger, directory: str | os.PathLike[str]) -> Instrumentation:
    """Instrument ``ledger`` with SDK providers of its own that write ``<worker>.spans.jsonl`` (each span as it
    ends) and ``<worker>.metrics.jsonl`` (at shutdown, also at process exit) into ``directory``: one file pair per
    process, and the spans of all of them group into traces by transfer. Needs ``opentelemetry-sdk``."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    spans_file = open(out / f"{ledger.worker}.spans.jsonl", "a", buffering=1)  # noqa: SIM115 - lives with the provider
    metrics_file = open(out / f"{ledger.worker}.metrics.jsonl", "a", buffering=1)  # noqa: SIM115
    resource = Resource.create({"service.name": f"kvlifecycle-{ledger.side}", "service.instance.id": ledger.worker})
    tracer_provider = TracerProvider(resource=resource)
    tracer_provider.add_span_processor(
        SimpleSpanProcessor(
            ConsoleSpanExporter(out=spans_file, formatter=lambda span: span.to_json(indent=None) + "\n")
        )
    )
    reader = PeriodicExportingMetricReader(
        ConsoleMetricExporter(out=metrics_file, formatter=lambda data: data.to_json(indent=None) + "\n"),
        export_interval_millis=3_600_000,
    )
    meter_provider = MeterProvider(metric_readers=[reader], resource=resource)
    subscription = instrument(ledger, tracer_provider, meter_provider)
    done = False

    def shutdown() -> None:
        nonlocal done
        if done:
            return
        done = True
        subscription.detach()
        meter_provider.shutdown()  # exports the metrics one last time
        tracer_provider.shutdown()
        spans_file.close()
        metrics_file.close()

    subscription.shutdown = shutdown  # type: ignore[method-assign]  # this one also shuts down the providers it made
    atexit.register(shutdown)
    # multiprocessing children leave through os._exit, which skips atexit; its finalizers still run
    from multiprocessing import util

    util.Finalize(subscription, shutdown, exitpriority=10)
    return subscription


def instrument_from_env(ledger: SourceLedger | TargetLedger) -> Instrumentation:
    """``$KVL_OTEL_DIR`` set: :func:`instrument_to_files` there; unset: :func:`instrument` with the global
    providers (no-ops unless the application installed an SDK)."""
    directory = envvars.OTEL_DIR.read()
    return instrument_to_files(ledger, directory) if directory else instrument(ledger)


# --- data-path selection -----------------------------------------------------------------------------------------

_path_instruments: dict[int, tuple[Histogram, Counter]] = {}


def record_path_selection(
    *,
    peer: str,
    transport: str,
    backend: str | None,
    reason: str,
    gbps: float | None,
    probe_bytes: int = 0,
    floor_gbps: float = 0.0,
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
) -> bool:
    """Make a data-path choice visible: a ``kv.path.select`` span (with a ``kv.path.slow`` event when the measured
    bandwidth is below ``floor_gbps``), a ``kv.path.bandwidth`` histogram and a ``kv.path.slow`` counter.
    Returns whether the path is slow. Costs nothing measurable without an SDK (global no-op providers)."""
    slow = gbps is not None and gbps < floor_gbps
    attributes: dict[str, AttributeValue] = {
        "kv.peer": peer,
        "kv.path.transport": transport,
        "kv.path.backend": backend or "",
        "kv.path.reason": reason,
        "kv.path.floor_gbps": floor_gbps,
    }
    if gbps is not None:
        attributes.update({"kv.path.gbps": gbps, "kv.path.probe_bytes": probe_bytes})
    tracer = trace.get_tracer(
        INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION, tracer_provider=tracer_provider or trace.get_tracer_provider()
    )
    with tracer.start_as_current_span("kv.path.select", attributes=attributes) as span:
        if gbps is None:
            span.add_event("kv.path.unmeasured", {"kv.peer": peer})
        elif slow:
            span.add_event("kv.path.slow", {"kv.path.gbps": gbps, "kv.path.floor_gbps": floor_gbps})
            span.set_status(Status(StatusCode.ERROR, f"{gbps:.3f} GB/s is below the floor of {floor_gbps:.3f}"))
    provider = meter_provider or metrics.get_meter_provider()
    instruments = _path_instruments.get(id(provider))
    if instruments is None:
        meter = metrics.get_meter(INSTRUMENTATION_NAME, INSTRUMENTATION_VERSION, meter_provider=provider)
        instruments = (
            meter.create_histogram(
                "kv.path.bandwidth", unit="GB/s", description="connect-time test transfer bandwidth of a chosen path"
            ),
            meter.create_counter("kv.path.slow", description="paths chosen below their bandwidth floor"),
        )
        _path_instruments[id(provider)] = instruments
    metric_attributes = {"kv.path.transport": transport, "kv.path.backend": backend or ""}
    if gbps is not None:
        instruments[0].record(gbps, metric_attributes)
    if slow:
        instruments[1].add(1, metric_attributes)
    return slow
