"""structlog helpers: bound handoff identity, JSON/console rendering on opt-in, nothing configured otherwise."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from kvlifecycle import logs
from kvlifecycle.clock import ManualClock
from kvlifecycle.ledger import SourceLedger, TargetLedger


@pytest.fixture(autouse=True)
def _clean_logging():
    root_handlers = list(logging.getLogger().handlers)
    yield
    logs.unconfigure()
    assert logging.getLogger().handlers == root_handlers


def json_lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_importing_and_logging_configures_nothing_global() -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    logs.get_logger().warning("not configured")
    assert (list(root.handlers), root.level) == before
    lib = logging.getLogger(logs.LOGGER_NAME)
    assert [type(h) for h in lib.handlers] == [logging.NullHandler]
    assert lib.propagate


def test_json_lines_carry_request_transfer_and_epoch() -> None:
    buf = io.StringIO()
    logs.configure("json", "debug", stream=buf)
    logs.handoff_logger("req-1", "p0.t.1", 3).info("lease granted", ttl_s=30.0)
    (line,) = json_lines(buf)
    assert line["event"] == "lease granted"
    assert (line["request"], line["transfer"], line["epoch"], line["ttl_s"]) == ("req-1", "p0.t.1", 3, 30.0)
    assert line["level"] == "info" and line["logger"] == "kvlifecycle" and line["timestamp"].endswith("Z")
    assert logging.getLogger() .handlers == [h for h in logging.getLogger().handlers if not hasattr(h, "_kvlifecycle")]


def test_console_rendering_and_level_filter() -> None:
    buf = io.StringIO()
    logs.configure("console", "info", stream=buf)
    log = logs.handoff_logger("req-2", "p0.t.2", "1..4")
    log.debug("dropped")
    log.info("load ready", parts=2)
    text = buf.getvalue()
    assert "dropped" not in text
    assert "load ready" in text and "request=req-2" in text and "transfer=p0.t.2" in text and "epoch=1..4" in text


def test_configure_twice_keeps_one_handler_and_rejects_bad_input() -> None:
    logs.configure("json", stream=io.StringIO())
    logs.configure("console", stream=io.StringIO())
    lib = logging.getLogger(logs.LOGGER_NAME)
    assert sum(1 for h in lib.handlers if getattr(h, "_kvlifecycle", False)) == 1
    assert lib.propagate is False
    with pytest.raises(ValueError, match="log format"):
        logs.configure("xml")
    with pytest.raises(ValueError, match="level"):
        logs.configure("json", "loud")


def test_env_var_selects_format_and_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(logs.ENV_VAR, "json:debug")
    buf = io.StringIO()
    logs.configure(stream=buf)
    logs.get_logger("x").debug("visible")
    (line,) = json_lines(buf)
    assert line["event"] == "visible" and line["logger"] == "kvlifecycle.x"


def test_unconfigured_records_are_readable_by_a_plain_handler() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    lib = logging.getLogger(logs.LOGGER_NAME)
    keep = Keep()
    lib.addHandler(keep)
    lib.setLevel(logging.INFO)
    try:
        logs.handoff_logger("req-3", "p0.t.3", 2).info("released", reason="completed")
    finally:
        lib.removeHandler(keep)
        lib.setLevel(logging.NOTSET)
    (record,) = records
    assert record.getMessage() == "released request=req-3 transfer=p0.t.3 epoch=2 reason=completed"
    assert record.kv["request"] == "req-3"


def test_event_listener_logs_every_event_with_identity() -> None:
    buf = io.StringIO()
    logs.configure("json", "debug", stream=buf)
    clock = ManualClock()
    source = SourceLedger(8, clock=clock, worker="p0")
    target = TargetLedger(8, clock=clock, worker="d0")
    logs.log_events(source)
    listener = logs.log_events(target)
    source.allocate("r", np.arange(2))
    source.allocate("r2", np.arange(2, 4))
    source.prefill_done("r")
    grant = source.grant("r")
    assert not source.heartbeat(grant.transfer, grant.generation + 1)
    target.reserve("r", np.arange(3))
    target.start_load("r", grant.transfer)
    target.part_done(grant.transfer)
    lines = json_lines(buf)
    kinds = [line["event"] for line in lines]
    assert kinds == ["SrcAllocated", "SrcAllocated", "SrcPrefillDone", "SrcGranted", "Refused", "TgtReserved",
                     "TgtLoadStarted", "TgtPartDone"]
    assert all(line["level"] == "debug" for line in lines)
    granted = lines[3]
    assert (granted["request"], granted["transfer"], granted["epoch"], granted["side"]) == (
        "r", grant.transfer, 1, "source")
    refused = lines[4]
    assert refused["reason"].startswith("stale token") and refused["request"] == "r"
    assert lines[5]["blocks"] == 3 and lines[5]["worker"] == "d0"
    assert lines[7]["request"] == "r"  # a part completion names only the transfer: the request is looked up
    listener.detach()
    target.finish("r")
    assert len(json_lines(buf)) == len(lines)


def test_event_listener_is_silent_when_debug_is_off() -> None:
    buf = io.StringIO()
    logs.configure("json", "info", stream=buf)
    source = SourceLedger(4, clock=ManualClock(), worker="p0")
    logs.log_events(source)
    source.allocate("r", np.arange(2))
    assert buf.getvalue() == ""
