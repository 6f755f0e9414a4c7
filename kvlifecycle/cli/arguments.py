"""How every verb answers bad input: one line on stderr and exit status 2, never a traceback.

- :class:`OneLineErrorParser` makes argparse's usage errors one line (argparse prints the usage first).
- :func:`validate_numbers` checks numbers where they are parsed: a count, size, bound or index given as a bare
  ``int``/``float`` is never negative, NaN or infinite, and one whose default is positive is never zero (a zero
  there means nothing: zero requests, a zero-size probe). An option where zero or a sign means something gives its
  own ``type`` (:func:`non_negative_int`, :func:`non_negative_float`, :func:`port`), which this leaves alone.
- :data:`USER_ERRORS` are what a verb raises for its input or its environment (a path it cannot use, a value out
  of range, an optional package that is missing): ``main`` prints them in one line (:func:`describe_user_error`).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn

# which extra brings the package a verb found missing (pyproject.toml's [project.optional-dependencies])
EXTRA_OF_MODULE = {"torch": "torch", "nixl": "transports", "matplotlib": "viz", "pyetcd": "etcd",
                   "google": "etcd", "opentelemetry": "otel", "pytest": "testing", "zmq": "torch"}

USER_ERRORS: tuple[type[BaseException], ...] = (OSError, ValueError, ImportError, LookupError)


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser, with a usage error in one line (``--help`` still prints the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def describe_user_error(exc: BaseException) -> str:
    """One line for a user error: the path an OSError is about, the extra that brings a missing package."""
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        root = exc.name.split(".")[0]
        extra = EXTRA_OF_MODULE.get(root)
        hint = f": pip install 'kvlifecycle[{extra}]'" if extra else ""
        return f"needs the {root!r} package, which is not installed{hint}"
    if isinstance(exc, OSError) and exc.strerror:
        where = f": {exc.filename}" if exc.filename else ""
        return f"{exc.strerror}{where}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _number(kind: Callable[[str], float], low: float, strict: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        value = kind(text)  # a ValueError here is argparse's "invalid int value"
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low:g}, got {text!r}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message ("invalid int value")
    return parse


def non_negative_int(text: str) -> int:
    """An int that may be 0 (0 meaning "none" or "off" where the option says so)."""
    return int(_number(int, 0, False)(text))


def non_negative_float(text: str) -> float:
    """A finite float that may be 0 (a threshold of 0 turns its check off where the option says so)."""
    return float(_number(float, 0, False)(text))


def port(text: str) -> int:
    """A TCP port, 0 to let the system pick one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {text!r}")
    return value


def validate_numbers(parser: argparse.ArgumentParser) -> None:
    """Give every bare ``int``/``float`` option of ``parser`` (and its sub-parsers) the range check above."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                validate_numbers(sub)
            continue
        if action.type not in (int, float):
            continue
        default = action.default
        positive = isinstance(default, (int, float)) and not isinstance(default, bool) and default > 0
        action.type = _number(action.type, 0, positive)
