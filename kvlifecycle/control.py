"""The handoff's control messages on the side channel (P serves them, D sends them), and their claim-token rules.

Counters and block ids are bounded at decode (msgspec constraints): a peer's hybrid logical clock of 2**64 would
otherwise be observed, ticked past what msgpack can encode, and stop every later commit of the log; a block id past
int32 would fail its conversion on a service thread.

A :class:`Heartbeat` is one of three things, by what it carries (see :mod:`kvlifecycle.claims`):

- a **claim**: ``agent`` set, no ``token``: claims consumer index ``consumer`` of the lease, answered by
  :class:`Claimed` with the per-claim token;
- a **renewal**: the claim's ``token``: renews the lease;
- a **keepalive**: neither: renews a lease nobody has claimed yet (an engine that holds a grant while its blocks
  are being reserved); refused once the lease is claimed.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from kvlifecycle.digest import BlockDigests

Counter = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]  # the ledgers' block ids are int32
Token = Annotated[bytes, msgspec.Meta(max_length=64)]


class GetGrant(msgspec.Struct, frozen=True, tag=True):
    request: str


class GrantReply(msgspec.Struct, frozen=True, tag=True):
    """A published grant (what vLLM carries in ``kv_transfer_params``)."""

    request: str
    transfer: str
    generation: Counter
    worker: str
    block_ids: list[BlockId]
    consumers: int
    ttl_s: float
    agent: str
    epoch: Counter
    tp_rank: int = 0
    # P's digest of each granted block as each consumer reads it (kvlifecycle.digest), for a transfer P verifies;
    # None: D checks nothing (verification off, a transfer not sampled, or an older P)
    digests: BlockDigests | None = None


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    transfer: str
    generation: Counter
    agent: str = ""  # the consumer's agent: P binds the lease to it, so the consumer's restart releases it
    hlc: Counter = 0  # the sender's hybrid logical clock (0: unknown): what P records next sorts after it
    consumer: Counter = 0  # which consumer of the lease this is (D TP > P TP: several D ranks read one lease)
    token: Token = b""  # the claim token, on every heartbeat after the claim
    # seconds D's clock ran from sending its claim to building this renewal (-1: a claim, a keepalive, or an older
    # D): P refuses a renewal held back past its transit bound (kvlifecycle.protocol.bounds)
    since_claim: float = -1.0


class Claimed(msgspec.Struct, frozen=True, tag=True):
    """P → D, the answer to a claim: ``token`` is what every later message about this lease must carry."""

    ok: bool
    detail: str = ""
    token: bytes = b""
    # the lease was served from P's host staging pool: read these host slots (one per granted block, in the
    # grant's order) from the host region set P offered in the handshake (``MetaReply.host_meta``), not the GPU
    # blocks. None: read the granted blocks, as an older P always answers
    host_blocks: list[BlockId] | None = None
    # P's hybrid logical clock when it served the staged copy (0: unknown): D's load, started after, sorts after it
    hlc: Counter = 0


class PushRequest(msgspec.Struct, frozen=True, tag=True):
    """D → P: write the granted blocks into mine (``blocks``), then notify ``target_request`` part ``part``."""

    transfer: str
    generation: Counter
    agent: str
    epoch: Counter
    blocks: list[BlockId]
    target_request: str
    part: int = 0
    token: Token = b""  # the claim token of this lease
    since_claim: float = -1.0  # as a Heartbeat's: a push request held back in the network is refused


class LoadFailed(msgspec.Struct, frozen=True, tag=True):
    """D → P: my read of this grant failed; release it now rather than at lease expiry. Carries the claim token
    once the lease is claimed (before that, the lease has no claimant to protect)."""

    transfer: str
    generation: Counter
    reason: str
    hlc: Counter = 0
    token: Token = b""
    # which of the lease's consumers failed (-1: unknown). A lease read by several D ranks (D TP > P TP) is
    # released only when every one of them settled, so a sibling still reading never sees its blocks reused.
    consumer: Annotated[int, msgspec.Meta(ge=-1, le=1 << 20)] = -1


class StreamRequest(msgspec.Struct, frozen=True, tag=True):
    """D → P, at D's reservation time (before P computes): write each layer of P's request ``request`` into my
    ``blocks`` (token order) as P computes it, and notify ``transfer`` per layer batch carrying ``token``. There is
    no lease yet to claim: ``token`` is D's, and P echoes it so D takes only this P's notes for the stream.
    ``write_window_s``: P posts no layer later than this after its receipt, and cancels what is in flight then
    (a duration, no shared clock; the bound D's timeout relies on: ``kvlifecycle.protocol.bounds``)."""

    request: str
    transfer: str
    agent: str
    epoch: Counter
    blocks: list[BlockId]
    layers: Annotated[int, msgspec.Meta(ge=1, le=1 << 12)]
    token: Token
    write_window_s: Annotated[float, msgspec.Meta(gt=0, le=86400.0)]
    part: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0


class StreamCancel(msgspec.Struct, frozen=True, tag=True):
    """D → P: post no further layer of this stream; P tells D (a ``failed`` note) once its writes settled."""

    request: str
    transfer: str
    token: Token
    reason: str = ""


class StreamQuery(msgspec.Struct, frozen=True, tag=True):
    """Proxy → P: has D's reservation for ``request`` arrived? (``Ack.ok``): the proxy submits the prefill once it
    has, so that D reserves first; P never waits for it."""

    request: str


REPLY_TYPES = (GrantReply, Claimed)
