"""Structured logs (structlog) with the handoff's request id, transfer id and epoch bound on every line.

The library logs through the standard-library logger ``kvlifecycle`` (which carries only a ``NullHandler``) and
configures nothing: without the application's say-so nothing is printed and no global state changes. Each record's
message is a readable ``event key=value ...`` line, and the structured fields ride along as ``record.kv`` (a dict)
for the application's own formatter.

:func:`configure` is the opt-in: it attaches one handler (JSON lines or console rendering) to the ``kvlifecycle``
logger, or to the root logger only when asked with ``root=True``. :func:`log_events` subscribes a ledger listener
that logs every event at DEBUG (free when DEBUG is off: one level check per event).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import structlog
from structlog.stdlib import BoundLogger
from structlog.typing import EventDict, Processor, WrappedLogger

from kvlifecycle import envvars
from kvlifecycle import events as ev

if TYPE_CHECKING:
    from kvlifecycle.ledger import SourceLedger, TargetLedger

LOGGER_NAME = "kvlifecycle"
LogFormat = Literal["console", "json"]  # a closed set: any other spelling is refused
FORMATS: tuple[str, ...] = get_args(LogFormat)
ENV_VAR = envvars.LOG.name  # e.g. "json", "console:debug"

logging.getLogger(LOGGER_NAME).addHandler(logging.NullHandler())


def _logfmt_value(value: object) -> str:
    text = str(value)
    return f'"{text}"' if (" " in text or not text) else text


def _to_stdlib(_logger: WrappedLogger, _method: str, event_dict: EventDict) -> tuple[tuple[str], dict[str, Any]]:
    """Final processor: a readable message for any handler, the fields as ``record.kv`` for ours."""
    fields = dict(event_dict)
    event = str(fields.get("event", ""))
    exc_info = fields.pop("exc_info", None)
    rest = " ".join(f"{k}={_logfmt_value(v)}" for k, v in fields.items() if k != "event")
    kwargs: dict[str, Any] = {"extra": {"kv": fields}}
    if exc_info:
        kwargs["exc_info"] = exc_info
    return ((f"{event} {rest}" if rest else event),), kwargs


_PROCESSORS: list[Processor] = [
    structlog.stdlib.filter_by_level,  # first: a disabled level costs one check
    structlog.contextvars.merge_contextvars,  # the application's bound context (e.g. its own request id)
    _to_stdlib,
]


def get_logger(name: str = LOGGER_NAME, **context: Any) -> BoundLogger:
    """A structlog logger over the stdlib logger ``name`` (a child of ``kvlifecycle`` by default), ``context``
    bound. Independent of structlog's global configuration, which stays the application's."""
    if name != LOGGER_NAME and not name.startswith(LOGGER_NAME + "."):
        name = f"{LOGGER_NAME}.{name}"
    logger: BoundLogger = structlog.wrap_logger(logging.getLogger(name), processors=_PROCESSORS,
                                                wrapper_class=BoundLogger, context_class=dict,
                                                cache_logger_on_first_use=False, **context)
    return logger


def handoff_logger(request: str | None = None, transfer: str | None = None, epoch: int | str | None = None,
                   logger: BoundLogger | None = None, **more: Any) -> BoundLogger:
    """A logger with the handoff's identity bound: every line it writes names the request, transfer and epoch."""
    base = logger if logger is not None else get_logger()
    bound = {"request": request, "transfer": transfer, "epoch": epoch, **more}
    return base.bind(**{k: v for k, v in bound.items() if v is not None})


def epoch_label(epochs: np.ndarray) -> int | str:
    """One epoch when a request's blocks share it, else ``lo..hi`` (logs are no place for a block array)."""
    if epochs.size == 0:
        return ""
    lo, hi = int(epochs.min()), int(epochs.max())
    return lo if lo == hi else f"{lo}..{hi}"


class _Formatter(logging.Formatter):
    """Renders ``record.kv`` (or, for foreign records, the plain message) with a structlog renderer."""

    def __init__(self, fmt: str) -> None:
        super().__init__()
        self.fmt = fmt
        if fmt == "json":
            self._render: Callable[[WrappedLogger, str, EventDict], str | bytes] = structlog.processors.JSONRenderer(
                sort_keys=False
            )
        else:
            self._render = structlog.dev.ConsoleRenderer(colors=False, sort_keys=False)
        self._stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)

    def format(self, record: logging.LogRecord) -> str:
        fields = dict(getattr(record, "kv", None) or {"event": record.getMessage()})
        event_dict: EventDict = {"timestamp": None, "level": record.levelname.lower(),
                                      "event": fields.pop("event", ""), "logger": record.name}
        event_dict.update(fields)
        event_dict = self._stamp(None, "", event_dict)
        if record.exc_info:
            event_dict["exception"] = self.formatException(record.exc_info)
        rendered = self._render(None, record.levelname.lower(), event_dict)
        return rendered if isinstance(rendered, str) else rendered.decode()  # bytes only from a bytes serializer


def configure(fmt: LogFormat | None = None, level: int | str = "INFO", *, stream: IO[str] | None = None,
              root: bool = False, logger_name: str = LOGGER_NAME) -> logging.Handler:
    """Opt in to kvlifecycle's log output: ``fmt`` ``"json"`` (one JSON object a line) or ``"console"``.

    Attaches one handler to the ``kvlifecycle`` logger (replacing one an earlier call attached) and stops its
    records propagating, so they are not printed twice; the root logger is touched only with ``root=True``.
    ``fmt`` and ``level`` default from ``$KVL_LOG`` (``json``, ``console:debug``, ...). Returns the handler.
    """
    env_fmt, _, env_level = (envvars.LOG.read() or "").partition(":")
    chosen = fmt or env_fmt or "console"
    if chosen not in FORMATS:
        raise ValueError(f"log format must be one of {FORMATS}, got {chosen!r}")
    if env_level and level == "INFO":
        level = env_level
    numeric = logging.getLevelName(level.upper()) if isinstance(level, str) else int(level)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    target = logging.getLogger() if root else logging.getLogger(logger_name)
    for old in [h for h in target.handlers if getattr(h, "_kvlifecycle", False)]:
        target.removeHandler(old)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter(chosen))
    handler._kvlifecycle = True  # type: ignore[attr-defined]  # our mark: a later configure() replaces this one
    target.addHandler(handler)
    target.setLevel(numeric)
    if not root:
        target.propagate = False
    return handler


def unconfigure(root: bool = False, logger_name: str = LOGGER_NAME) -> None:
    """Undo :func:`configure`: remove its handler and let records propagate again."""
    target = logging.getLogger() if root else logging.getLogger(logger_name)
    for old in [h for h in target.handlers if getattr(h, "_kvlifecycle", False)]:
        target.removeHandler(old)
    if not root:
        target.propagate = True
        target.setLevel(logging.NOTSET)


# --- ledger events as log lines --------------------------------------------------------------------------------


class EventLogger:
    """A ledger listener that writes each event as one DEBUG line with request, transfer and epoch bound."""

    def __init__(self, ledger: SourceLedger | TargetLedger, logger: BoundLogger | None = None,
                 level: int = logging.DEBUG) -> None:
        self.ledger = ledger
        self.level = level
        self.logger = (logger or get_logger("events")).bind(side=ledger.side, worker=ledger.worker)
        wrapped = getattr(self.logger, "_logger", None)
        self._stdlib = wrapped if isinstance(wrapped, logging.Logger) else None
        self._requests: dict[str, str] = {}  # transfer -> request, for events that name only the transfer
        ledger.listeners.append(self)

    def __call__(self, event: ev.Event) -> None:
        if self._stdlib is not None and not self._stdlib.isEnabledFor(self.level):
            return
        fields: dict[str, Any] = {"hlc": event.hlc, "at": round(event.at, 6)}
        for name in event.__struct_fields__:
            if name in ("hlc", "at"):
                continue
            value = getattr(event, name)
            fields["blocks" if name == "blocks" else name] = (
                len(value) // 4 if name == "blocks" else value  # a count, not the array
            )
        request = fields.pop("request", None) or None
        transfer = fields.pop("transfer", None) or None
        epoch: int | str | None = None
        ledger = self.ledger
        if transfer is not None:
            if request is not None:
                self._requests[transfer] = request
            else:
                request = self._requests.get(transfer)
            live = getattr(ledger, "leases" if ledger.side == "source" else "loads", {})
            if transfer not in live:  # settled: forget it (bounded memory)
                self._requests.pop(transfer, None)
        if request is not None:
            req = ledger.requests.get(request)
            if req is not None:
                epoch = epoch_label(req.epochs)
        handoff_logger(request, transfer, epoch, logger=self.logger).log(self.level, type(event).__name__, **fields)

    def detach(self) -> None:
        if self in self.ledger.listeners:
            self.ledger.listeners.remove(self)


def log_events(ledger: SourceLedger | TargetLedger, logger: BoundLogger | None = None,
               level: int = logging.DEBUG) -> EventLogger:
    """Subscribe a listener that logs every event of ``ledger`` (DEBUG by default); ``.detach()`` ends it."""
    return EventLogger(ledger, logger, level)
