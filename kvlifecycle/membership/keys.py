"""The etcd key space of kvlifecycle: one key per P or D worker rank, its value the rank's live address and agent epoch.

    /kvlifecycle/v1/<cluster>/<role>/<instance>/<dp>/<tp>  ->  Member (JSON)

``role`` is ``prefill`` or ``decode``; ``instance`` names the engine instance (a vLLM/SGLang server); ``dp`` and
``tp`` are the rank's data- and tensor-parallel ranks. Each key is attached to its worker's etcd lease, so the key
lives exactly as long as the worker keeps that lease alive: the lease is the liveness of the agent epoch written in
the value. ``v1`` is the key-space version: a change of the value's meaning gets a new prefix, so mixed versions
never read each other's keys.

Value history: v1 — address, agent, epoch, state (``serving`` | ``draining``), transport; then ``api`` (the engine
instance's HTTP server, for a router), optional with an empty default: a reader that predates a field ignores it
(msgspec skips unknown fields), so it needs no new prefix.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

import msgspec

ROOT = "/kvlifecycle/v1"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class MemberState(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"  # takes no new grant; live leases finish, then the key is deleted


class Member(msgspec.Struct, frozen=True):
    """What a registered rank publishes."""

    address: str  # the side channel, e.g. tcp://10.0.0.7:5600
    agent: str  # the transport agent name
    epoch: int  # the agent epoch: a restart is a new epoch
    state: MemberState = MemberState.SERVING
    transport: str = "nixl"
    api: str = ""  # host:port of the instance's OpenAI-compatible server, on the rank that hosts it; "" for none


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Member)


def encode_member(member: Member) -> bytes:
    return _encoder.encode(member)


def decode_member(raw: bytes) -> Member:
    """Raises :class:`msgspec.DecodeError` / :class:`msgspec.ValidationError` on a value that is not a Member."""
    return _decoder.decode(raw)


def _check_name(what: str, value: str) -> str:
    if not _NAME.match(value):
        raise ValueError(f"{what} {value!r}: use letters, digits and . _ : - (no '/'), at most 128 characters")
    return value


def cluster_prefix(cluster: str) -> str:
    return f"{ROOT}/{_check_name('cluster', cluster)}/"


def role_prefix(cluster: str, role: Role) -> str:
    return f"{cluster_prefix(cluster)}{Role(role).value}/"


def instance_prefix(cluster: str, role: Role, instance: str) -> str:
    """The keys of every DP and TP rank of one engine instance."""
    return f"{role_prefix(cluster, role)}{_check_name('instance', instance)}/"


@dataclass(frozen=True, slots=True, order=True)
class MemberKey:
    cluster: str
    role: Role
    instance: str
    dp: int = 0
    tp: int = 0

    def __post_init__(self) -> None:
        _check_name("cluster", self.cluster)
        _check_name("instance", self.instance)
        object.__setattr__(self, "role", Role(self.role))
        if self.dp < 0 or self.tp < 0:
            raise ValueError(f"ranks must be >= 0, got dp={self.dp} tp={self.tp}")

    @property
    def path(self) -> str:
        return f"{role_prefix(self.cluster, self.role)}{self.instance}/{self.dp}/{self.tp}"

    @classmethod
    def parse(cls, path: str | bytes) -> MemberKey:
        text = path.decode() if isinstance(path, bytes) else path
        if not text.startswith(ROOT + "/"):
            raise ValueError(f"{text!r} is not under {ROOT}/")
        parts = text[len(ROOT) + 1:].split("/")
        if len(parts) != 5 or not parts[3].isdigit() or not parts[4].isdigit():
            raise ValueError(f"{text!r} is not <cluster>/<role>/<instance>/<dp>/<tp>")
        return cls(parts[0], Role(parts[1]), parts[2], int(parts[3]), int(parts[4]))

    def __str__(self) -> str:
        return self.path
