"""The closed sets the public API takes a choice from: which side a ledger keeps, what a failed load does, which
way the bytes move.

Each is a ``str`` enum, so the documented spellings (``"source"``, ``"recompute"``, ``"push"``) keep working and
compare equal to their members, and a ``Literal`` of those spellings, so a type checker flags a typo where it is
written. At run time :meth:`Choice.parse` turns a spelling into its member at the boundary and refuses anything
else with the set's name and its members: ``open_ledger("sourc")`` is an error, never a silent default.
(The event-log fsync policy is kept beside the log: :class:`kvlifecycle.eventlog.FsyncMode`.)
"""

from __future__ import annotations

import enum
from typing import Literal, TypeVar

_C = TypeVar("_C", bound="Choice")


class Choice(str, enum.Enum):
    """A member of a closed set of strings; ``str(member)`` is its spelling."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def parse(cls: type[_C], value: object, what: str | None = None) -> _C:
        """``value`` as a member of this set; ``ValueError`` naming ``what`` (the field) and the members if it is
        none of them."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError:
            spellings = [repr(m.value) for m in cls]
            members = " or ".join([", ".join(spellings[:-1]), spellings[-1]] if len(spellings) > 1 else spellings)
            raise ValueError(f"{what or cls.__name__} must be {members}, got {value!r}") from None


    @classmethod
    def spellings(cls) -> dict[object, str]:
        """Member or spelling -> spelling: one dict lookup where ``parse(...).value`` would cost ~0.5 µs (a member
        hashes by its name, not its spelling, so both are keys)."""
        return {**{m: str(m.value) for m in cls}, **{str(m.value): str(m.value) for m in cls}}


class Side(Choice):
    """Which side of a handoff a ledger keeps."""

    SOURCE = "source"  # prefill: the blocks are read from (pull) or written from (push) here
    TARGET = "target"  # decode: the blocks are filled here


class LoadFailurePolicy(Choice):
    """What a failed load leaves the decode side with (vLLM's ``kv_load_failure_policy``)."""

    FAIL = "fail"  # the request errors out; its blocks are freed
    RECOMPUTE = "recompute"  # the blocks go back to RESERVED and the engine computes the tokens itself


class TransferMode(Choice):
    """Which side drives the bytes."""

    PULL = "pull"  # D reads P's pinned blocks
    PUSH = "push"  # P writes into the blocks D reserved


SideName = Literal["source", "target"]
LoadFailurePolicyName = Literal["fail", "recompute"]
TransferModeName = Literal["pull", "push"]
