"""What the simulated network carries besides the side channel's calls (:mod:`kvlifecycle.sim.peers`): the grant a
proxy carries from P to D, and transport notifications."""

from __future__ import annotations

from dataclasses import dataclass

from kvlifecycle.choices import TransferMode
from kvlifecycle.control import GrantReply
from kvlifecycle.transport import Notification


@dataclass(frozen=True, slots=True)
class GrantInfo:
    """A published grant of one P rank, as the checks know it (what a ``GrantReply`` says, and the allocation epoch
    and TP position of its blocks)."""

    request: str
    transfer: str
    generation: int
    worker: str
    block_ids: tuple[int, ...]
    consumers: int
    ttl_s: float
    agent: str
    agent_epoch: int
    epoch: int  # allocation epoch of the granted blocks
    rank: int
    ranks: int
    stream: bool = False  # what a layer-wise stream writes (no lease: P's blocks are held by its request)


@dataclass(frozen=True, slots=True)
class GrantArrived:
    """P -> D through the proxy: what vLLM carries in ``kv_transfer_params``."""

    grant: GrantInfo  # what the checks know of it
    mode: TransferMode
    reply: GrantReply  # what D's engine hands the Consumer


@dataclass(frozen=True, slots=True)
class NoteMsg:
    """A transport notification on the wire (it rides the same simulated network)."""

    note: Notification
