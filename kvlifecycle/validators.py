"""attrs validators for the public value and configuration types: each refuses a bad value where it is made, with
the field's name (``num_blocks must be >= 1, got -4``), instead of letting it fail later somewhere else.

A numpy integer is an integer here (block counts and addresses come from arrays); a bool is not a number, and
neither is a string (``"30"`` from a JSON config is a type error, not thirty seconds).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeGuard

import attrs
import numpy as np

Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


def _is_integer(value: object) -> TypeGuard[int | np.integer]:
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def _is_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def integer(minimum: int) -> Validator:
    """A whole number of at least ``minimum``."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not _is_integer(value):
            raise TypeError(f"{attribute.name} must be an integer, got {value!r} ({type(value).__name__})")
        if value < minimum:
            raise ValueError(f"{attribute.name} must be >= {minimum}, got {value}")

    return check


def integers(minimum: int) -> Validator:
    """A non-empty tuple of whole numbers, each at least ``minimum`` (one entry per region)."""

    def check(instance: object, attribute: attrs.Attribute[Any], values: object) -> None:
        if not isinstance(values, tuple) or not values:
            raise ValueError(f"{attribute.name} needs one entry per region, got {values!r}")
        for i, value in enumerate(values):
            if not _is_integer(value):
                raise TypeError(f"{attribute.name}[{i}] must be an integer, got {value!r} ({type(value).__name__})")
            if value < minimum:
                raise ValueError(f"{attribute.name}[{i}] must be >= {minimum}, got {value}")

    return check


def plain_int(value: Any) -> Any:
    """Converter: a numpy integer becomes the Python int it holds (msgspec and torch want those); anything else is
    left for the validator to judge."""
    return int(value) if isinstance(value, np.integer) else value


def plain_ints(values: Any) -> Any:
    """Converter: any sequence (a list, a numpy array) becomes a tuple of :func:`plain_int` entries."""
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        return values
    return tuple(plain_int(v) for v in values)


def number(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A real number (an int is one)."""
    if not _is_number(value):
        raise TypeError(f"{attribute.name} must be a number, got {value!r} ({type(value).__name__})")


def positive(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A number greater than zero (a duration, a rate)."""
    number(instance, attribute, value)
    if not (_is_number(value) and value > 0):
        raise ValueError(f"{attribute.name} must be positive, got {value!r}")


def port(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    """A TCP port; 0 lets the system pick one."""
    if not _is_integer(value) or not 0 <= value < 65536:
        raise ValueError(f"{attribute.name} must be a port number (0-65535), got {value!r}")


def optional(validator: Validator) -> Validator:
    return attrs.validators.optional(validator)


text = attrs.validators.instance_of(str)
optional_text = attrs.validators.optional(text)
flag = attrs.validators.instance_of(bool)
callback = attrs.validators.optional(attrs.validators.is_callable())
