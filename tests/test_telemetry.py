"""OpenTelemetry instrumentation on real ledgers, read back through the SDK's in-memory exporter and metric reader."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, StatusCode

from kvlifecycle.clock import ManualClock
from kvlifecycle.ledger import SourceLedger, TargetLedger
from kvlifecycle.telemetry import (
    handoff_ids,
    instrument,
    parse_traceparent,
    traceparent,
)


class Otel:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def spans(self, name: str | None = None) -> list:
        found = list(self.exporter.get_finished_spans())
        return [s for s in found if name is None or s.name == name]

    def metrics(self) -> dict[str, list]:
        out: dict[str, list] = {}
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    out.setdefault(metric.name, []).extend(metric.data.data_points)
        return out

    def instrument(self, ledger):
        return instrument(ledger, self.tracer_provider, self.meter_provider)


def total(points, **attrs) -> float:
    """Sum of counter values (or histogram sums) over the points whose attributes include ``attrs``."""
    value = 0.0
    for point in points:
        if all(point.attributes.get(k) == v for k, v in attrs.items()):
            value += point.value if hasattr(point, "value") else point.sum
    return value


@pytest.fixture
def otel() -> Otel:
    return Otel()


def make_pair(otel: Otel, **target_kwargs):
    clock = ManualClock(100.0)
    source = SourceLedger(32, clock=clock, worker="p0")
    target = TargetLedger(32, clock=clock, worker="d0", **target_kwargs)
    otel.instrument(source)
    otel.instrument(target)
    return clock, source, target


def test_one_trace_spans_both_sides_with_structure_and_attributes(otel: Otel) -> None:
    clock, source, target = make_pair(otel)
    source.allocate("req-1", np.arange(4))
    source.prefill_done("req-1")
    grant = source.grant("req-1", peer="d0")
    target.reserve("req-1", np.arange(8, 12))
    clock.advance(0.25)
    target.start_load("req-1", grant.transfer, parts=2, generation=grant.generation, peer="p0")
    assert source.heartbeat(grant.transfer, grant.generation)
    target.observe_transfer(
        grant.transfer, t_post_s=0.01, t_xfer_s=0.1, nbytes=4 << 20, descriptors=4, backend="UCX", ok=True
    )
    assert target.part_done(grant.transfer, 0)
    clock.advance(0.25)
    assert target.part_done(grant.transfer, 1)
    assert source.consumer_done(grant.transfer, grant.generation)

    trace_id, virtual_root = handoff_ids(grant.transfer)
    spans = otel.spans()
    assert spans and {s.context.trace_id for s in spans} == {trace_id}

    (p_root,) = otel.spans("kv.source.handoff")
    (d_root,) = otel.spans("kv.target.load")
    assert p_root.parent.span_id == virtual_root and d_root.parent.span_id == virtual_root
    children = {}
    for span in spans:
        if span.parent is not None and span.parent.span_id in (p_root.context.span_id, d_root.context.span_id):
            children.setdefault(span.parent.span_id, []).append(span.name)
    assert sorted(children[p_root.context.span_id]) == ["kv.lease", "kv.prefill"]
    assert sorted(children[d_root.context.span_id]) == [
        "kv.load",
        "kv.part_wait",
        "kv.part_wait",
        "kv.reserved",
        "kv.transfer",
    ]
    assert p_root.attributes["kv.request_id"] == "req-1"
    assert p_root.attributes["kv.transfer_id"] == grant.transfer
    assert p_root.attributes["kv.generation"] == grant.generation
    assert p_root.attributes["kv.peer"] == "d0"
    assert p_root.attributes["kv.epoch"] == 1 and p_root.attributes["kv.blocks"] == 4
    assert p_root.attributes["kv.outcome"] == "completed"
    assert d_root.attributes["kv.outcome"] == "ready"
    assert d_root.attributes["kv.peer"] == "p0" and d_root.attributes["kv.parts"] == 2
    (xfer,) = otel.spans("kv.transfer")
    assert xfer.attributes["kv.bytes"] == 4 << 20 and xfer.attributes["kv.descriptors"] == 4
    assert xfer.attributes["kv.backend"] == "UCX" and xfer.attributes["kv.request_id"] == "req-1"
    (lease,) = otel.spans("kv.lease")
    assert [e.name for e in lease.events] == ["lease.granted", "lease.renewed", "consumer.done"]
    assert sorted(s.attributes["kv.part"] for s in otel.spans("kv.part_wait")) == [0, 1]
    assert all(s.status.status_code != StatusCode.ERROR for s in spans)

    m = otel.metrics()
    assert total(m["kv.visible_wait"], **{"kv.outcome": "ready"}) == pytest.approx(0.5)
    assert total(m["kv.transfer.post_time"]) == pytest.approx(0.01)
    assert total(m["kv.transfer.xfer_time"]) == pytest.approx(0.1)
    assert total(m["kv.transfer.bandwidth"]) == pytest.approx((4 << 20) / 0.1)
    assert total(m["kv.transfers"], **{"kv.side": "source", "kv.outcome": "completed", "kv.ok": True}) == 1
    assert total(m["kv.transfers"], **{"kv.side": "target", "kv.outcome": "ready", "kv.ok": True}) == 1
    assert total(m["kv.lease.renewals"]) == 1
    assert "kv.lease.expiries" not in m  # nothing expired: the SDK reports no points


def test_refusals_and_expiry_are_span_events_and_counters(otel: Otel) -> None:
    clock, source, _ = make_pair(otel)
    source.allocate("req-2", np.arange(3))
    source.prefill_done("req-2")
    grant = source.grant("req-2", ttl_s=1.0)
    assert not source.heartbeat(grant.transfer, grant.generation + 7)  # stale generation, lease still live
    clock.advance(2.0)
    assert not source.heartbeat(grant.transfer, grant.generation)  # past expiry: refused, released as expired
    assert not source.consumer_done(grant.transfer, grant.generation)  # late completion after the release

    (lease,) = otel.spans("kv.lease")
    names = [e.name for e in lease.events]
    assert names == ["lease.granted", "refused.stale_token", "refused", "lease.expired"]
    stale = lease.events[1]
    assert stale.attributes["kv.command"] == "heartbeat"
    assert "generation" in stale.attributes["kv.reason"]
    (root,) = otel.spans("kv.source.handoff")
    assert root.attributes["kv.outcome"] == "expired"
    assert root.status.status_code == StatusCode.ERROR
    # the completion that came too late lands in the same trace as its own span
    (late,) = otel.spans("kv.refused")
    assert late.context.trace_id == root.context.trace_id
    assert late.attributes["kv.command"] == "consumer_done"

    m = otel.metrics()
    assert total(m["kv.lease.expiries"]) == 1
    assert total(m["kv.stale_token.refusals"]) == 2
    assert total(m["kv.refusals"]) == 3
    assert total(m["kv.transfers"], **{"kv.outcome": "expired", "kv.ok": False}) == 1


def test_sweep_expiry_and_gauges(otel: Otel) -> None:
    clock, source, target = make_pair(otel)
    source.allocate("req-3", np.arange(5))
    source.prefill_done("req-3")
    grant = source.grant("req-3", ttl_s=1.0)
    target.reserve("req-3", np.arange(6))
    target.start_load("req-3", grant.transfer)
    gauges = otel.metrics()
    assert total(gauges["kv.source.pinned_blocks"]) == 5
    assert total(gauges["kv.target.loading_blocks"]) == 6
    clock.advance(1.5)
    assert source.sweep() == [grant.transfer]
    gauges = otel.metrics()
    assert total(gauges["kv.source.pinned_blocks"]) == 0
    assert total(gauges["kv.lease.expiries"]) == 1
    (lease,) = otel.spans("kv.lease")
    assert lease.events[-1].name == "lease.expired"


def test_failed_load_with_recompute_counts_a_fallback(otel: Otel) -> None:
    clock, _, target = make_pair(otel, failure_policy="recompute")
    target.reserve("req-4", np.arange(2))
    target.start_load("req-4", "p0.x.1", parts=3)
    clock.advance(0.75)
    assert target.part_done("p0.x.1", 0)
    assert target.fail("p0.x.1", "notification lost")
    target.local_fill("req-4")
    (root,) = otel.spans("kv.target.load")
    assert root.attributes["kv.outcome"] == "recompute"
    assert root.attributes["kv.outcome.detail"] == "notification lost"
    assert root.status.status_code == StatusCode.ERROR
    m = otel.metrics()
    assert total(m["kv.fallback.recompute"]) == 1
    assert total(m["kv.transfers"], **{"kv.outcome": "recompute", "kv.ok": False}) == 1
    assert total(m["kv.visible_wait"], **{"kv.outcome": "recompute"}) == pytest.approx(0.75)
    assert total(m["kv.target.loading_blocks"]) == 0


def test_remote_parent_from_traceparent(otel: Otel) -> None:
    target = TargetLedger(8, clock=ManualClock(), worker="d0")
    subscription = otel.instrument(target)
    header = "00-0123456789abcdef0123456789abcdef-00f067aa0ba902b7-01"
    subscription.set_remote_parent("p0.y.1", header)
    target.reserve("req-5", np.arange(2))
    target.start_load("req-5", "p0.y.1")
    (root,) = [s for s in otel.spans() if s.name == "kv.target.load"] or [None]
    assert root is None  # still open
    assert target.part_done("p0.y.1", 0)
    (root,) = otel.spans("kv.target.load")
    assert root.context.trace_id == 0x0123456789ABCDEF0123456789ABCDEF
    assert root.parent.span_id == 0x00F067AA0BA902B7


def test_traceparent_round_trip_and_malformed_headers() -> None:
    header = traceparent("p0.abc.3")
    context = parse_traceparent(header)
    assert (context.trace_id, context.span_id) == handoff_ids("p0.abc.3")
    assert handoff_ids("p0.abc.3") != handoff_ids("p0.abc.4")
    for bad in ("", "00-xyz", "00-" + "0" * 32 + "-" + "1" * 16 + "-01", "00-" + "g" * 32 + "-" + "1" * 16 + "-01"):
        with pytest.raises(ValueError):
            parse_traceparent(bad)


def test_no_sdk_means_dormant(otel: Otel) -> None:
    from opentelemetry.metrics import NoOpMeterProvider

    source = SourceLedger(8, clock=ManualClock(), worker="p9")
    subscription = instrument(source, NoOpTracerProvider(), NoOpMeterProvider())
    source.allocate("r", np.arange(2))
    source.prefill_done("r")
    source.grant("r")
    assert subscription.active is False and subscription.open_handoffs == 0
    assert subscription.subscribed and len(source.listeners) == 1
    subscription.detach()
    assert not subscription.subscribed and source.listeners == []


def test_detach_ends_open_spans(otel: Otel) -> None:
    source = SourceLedger(8, clock=ManualClock(), worker="p1")
    subscription = otel.instrument(source)
    source.allocate("r", np.arange(2))
    source.prefill_done("r")
    source.grant("r")
    assert subscription.open_handoffs == 1 and not otel.spans("kv.source.handoff")
    subscription.detach()
    (root,) = otel.spans("kv.source.handoff")
    assert root.attributes["kv.outcome"] == "detached"


def test_other_process_lands_in_the_same_trace(otel: Otel, tmp_path) -> None:
    """D in a separate process, with its own SDK, puts its spans in P's trace: only the transfer id travels."""
    _, source, _ = make_pair(otel)
    source.allocate("req-6", np.arange(2))
    source.prefill_done("req-6")
    grant = source.grant("req-6")
    source.consumer_done(grant.transfer, grant.generation)
    script = textwrap.dedent(f"""
        import json, numpy as np
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from kvlifecycle.ledger import TargetLedger
        from kvlifecycle.telemetry import instrument
        exporter = InMemorySpanExporter(); provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        target = TargetLedger(4, worker="d7"); instrument(target, provider)
        target.reserve("req-6", np.arange(2)); target.start_load("req-6", {grant.transfer!r})
        target.part_done({grant.transfer!r}, 0)
        print(json.dumps([[s.name, s.context.trace_id] for s in exporter.get_finished_spans()]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    remote = json.loads(out.stdout.strip().splitlines()[-1])
    (p_root,) = otel.spans("kv.source.handoff")
    assert "kv.target.load" in [name for name, _ in remote]
    assert {trace_id for _, trace_id in remote} == {p_root.context.trace_id}


def test_multi_rank_load_joins_the_first_trace_and_links_the_others(otel: Otel) -> None:
    _, _, target = make_pair(otel)
    target.reserve("req-7", np.arange(2))
    transfer = "req-7<-p0.a.1+p1.b.1"
    target.start_load("req-7", transfer, parts=2)
    target.part_done(transfer, 0)
    target.part_done(transfer, 1)
    (root,) = otel.spans("kv.target.load")
    assert root.context.trace_id == handoff_ids("p0.a.1")[0]
    assert [link.context.trace_id for link in root.links] == [handoff_ids("p1.b.1")[0]]


def test_real_handoff_over_loopback_traces_both_sides(otel: Otel) -> None:
    """Producer and Consumer (side channel on 127.0.0.1, loopback transport): one pull and one push, both traced."""
    torch = pytest.importorskip("torch")
    from kvlifecycle.transports.loopback import LoopbackTransport

    from kvlifecycle.handoff import Consumer, Producer
    from kvlifecycle.handshake import CompatInfo
    from kvlifecycle.transport import KVLayout, MemoryKind

    compat = CompatInfo(
        model_id="tiny", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, block_size=16, kv_layout="NHD"
    )
    blocks, block_bytes = 16, 2048
    src = [torch.randint(0, 256, (blocks, block_bytes), dtype=torch.uint8) for _ in range(4)]
    dst = [torch.zeros((blocks, block_bytes), dtype=torch.uint8) for _ in range(4)]

    def layout(tensors):
        return KVLayout(
            MemoryKind.DRAM, 0, blocks, tuple(t.data_ptr() for t in tensors), tuple(block_bytes for _ in tensors)
        )

    p_transport, d_transport = LoopbackTransport("p-otel"), LoopbackTransport("d-otel")
    p_transport.register(layout(src))
    d_transport.register(layout(dst))
    source = SourceLedger(blocks, worker="p-otel")
    target = TargetLedger(blocks, worker="d-otel")
    otel.instrument(source)
    otel.instrument(target)
    producer = Producer(source, p_transport, compat)
    consumer = Consumer(target, d_transport, compat)
    try:
        consumer.connect(producer.address)
        transfers = []
        for i, mode in enumerate(("pull", "push")):
            request = f"req-{mode}"
            source.allocate(request, np.arange(i * 4, i * 4 + 4))
            source.prefill_done(request)
            grant = producer.grant(request)
            target.reserve(request, np.arange(8 + i * 4, 12 + i * 4))
            if mode == "pull":
                transfers.append(consumer.pull(request, [(producer.address, grant)]))
            else:
                transfers.append(consumer.request_push(request, grant, address=producer.address))
            assert consumer.wait_idle(30.0)
        deadline = time.monotonic() + 30.0  # P sees the pull's completion notification on its service thread
        while source.leases and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        consumer.close()
        producer.close()
    for transfer in transfers:
        trace_id = handoff_ids(transfer)[0]
        names = {s.name for s in otel.spans() if s.context.trace_id == trace_id}
        assert {
            "kv.source.handoff",
            "kv.lease",
            "kv.prefill",
            "kv.target.load",
            "kv.load",
            "kv.part_wait",
            "kv.transfer",
        } <= names
        (p_root,) = [s for s in otel.spans("kv.source.handoff") if s.attributes["kv.transfer_id"] == transfer]
        assert p_root.attributes["kv.outcome"] == "completed"
    m = otel.metrics()
    assert total(m["kv.transfers"], **{"kv.side": "target", "kv.outcome": "ready"}) == 2
    # every observed data-plane transfer is both a span and a T_xfer sample (pull: D observes; push: P does)
    assert sum(p.count for p in m["kv.transfer.xfer_time"]) == len(otel.spans("kv.transfer")) >= 2
    handoff_xfers = [p for p in m["kv.transfer.xfer_time"] if p.attributes["kv.transfer.kind"] == "handoff"]
    assert sum(p.count for p in handoff_xfers) == 2
    assert sum(p.count for p in m["kv.visible_wait"]) == 2


def test_instrument_to_files_writes_spans_and_metrics(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvlifecycle.telemetry import ENV_OTEL_DIR, instrument_from_env

    monkeypatch.setenv(ENV_OTEL_DIR, str(tmp_path))
    clock = ManualClock()
    source = SourceLedger(8, clock=clock, worker="p-file")
    subscription = instrument_from_env(source)
    source.allocate("r", np.arange(2))
    source.prefill_done("r")
    grant = source.grant("r")
    source.heartbeat(grant.transfer, grant.generation)
    source.consumer_done(grant.transfer, grant.generation)
    subscription.shutdown()
    spans = [json.loads(line) for line in (tmp_path / "p-file.spans.jsonl").read_text().splitlines()]
    assert {s["name"] for s in spans} == {"kv.source.handoff", "kv.prefill", "kv.lease"}
    assert {s["context"]["trace_id"] for s in spans} == {f"0x{handoff_ids(grant.transfer)[0]:032x}"}
    metrics = [json.loads(line) for line in (tmp_path / "p-file.metrics.jsonl").read_text().splitlines()]
    names = {
        m["name"]
        for batch in metrics
        for rm in batch["resource_metrics"]
        for sm in rm["scope_metrics"]
        for m in sm["metrics"]
    }
    assert {"kv.transfers", "kv.lease.renewals", "kv.source.pinned_blocks"} <= names
    assert not subscription.subscribed


def test_dormant_until_a_global_sdk_appears_then_traces() -> None:
    """No SDK at instrument() time: dormant; once the application sets global SDK providers, the instrumentation
    switches itself on (within DORMANT_RECHECK events). Run in a child: global providers can be set only once."""
    script = textwrap.dedent("""
        import json, numpy as np
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
        from kvlifecycle.ledger import SourceLedger
        from kvlifecycle.telemetry import DORMANT_RECHECK, instrument
        source = SourceLedger(8, worker="p5")
        sub = instrument(source)
        before = sub.active
        exporter = InMemorySpanExporter(); provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        for i in range(DORMANT_RECHECK):
            source.allocate(f"warm{i}", np.arange(2)); source.prefill_done(f"warm{i}"); source.free(f"warm{i}")
        source.allocate("r", np.arange(2)); source.prefill_done("r"); g = source.grant("r")
        source.consumer_done(g.transfer, g.generation)
        print(json.dumps([before, sub.active, sorted(s.name for s in exporter.get_finished_spans())]))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    before, after, names = json.loads(out.stdout.strip().splitlines()[-1])
    assert before is False and after is True
    assert names == ["kv.lease", "kv.prefill", "kv.source.handoff"]


def test_a_slow_path_choice_is_a_span_event_and_a_counter(otel: Otel) -> None:
    from kvlifecycle.telemetry import record_path_selection

    common = {
        "peer": "d0",
        "transport": "nixl",
        "backend": "UCX",
        "reason": "DRAM->DRAM one node",
        "tracer_provider": otel.tracer_provider,
        "meter_provider": otel.meter_provider,
    }
    assert record_path_selection(gbps=0.05, probe_bytes=1 << 20, floor_gbps=1.0, **common) is True
    assert record_path_selection(gbps=3.5, probe_bytes=1 << 20, floor_gbps=1.0, **common) is False
    spans = otel.spans("kv.path.select")
    assert [s.attributes["kv.path.gbps"] for s in spans] == [0.05, 3.5]
    assert [e.name for e in spans[0].events] == ["kv.path.slow"] and not spans[1].events
    assert spans[0].status.status_code.name == "ERROR"
    metrics = otel.metrics()
    assert total(metrics["kv.path.slow"], **{"kv.path.backend": "UCX"}) == 1
    assert total(metrics["kv.path.bandwidth"]) == pytest.approx(3.55)


def test_side_channel_refusals_are_counted_by_code() -> None:
    from kvlifecycle.sidechannel import SideChannelServer, encode_frame
    from kvlifecycle.telemetry import count_side_channel_refusals

    otel = Otel()
    server = SideChannelServer({})
    try:
        count_side_channel_refusals(server, otel.meter_provider)
        for frame in (b"junk", encode_frame(b"\x91" * 100 + b"\xc0", 1), encode_frame(b"\xc1", 2)):
            server.handle_frame(frame, b"peer")
    finally:
        server.close()
    points = otel.metrics()["kv.sidechannel.refused"]
    assert total(points, **{"kv.code": "malformed"}) == 3
