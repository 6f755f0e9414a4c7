"""Control-plane messages of the kvlifecycle SGLang backend (ZMQ multipart: ``[TAG, msgpack body]``).

SGLang's own frames keep their formats where SGLang code parses them (``ABORT`` from
``CommonKVReceiver._send_abort_notification``); everything else is a typed msgspec struct behind one tag, so a
malformed or foreign frame is refused with a reason instead of half-parsed. Imports neither sglang nor torch.

:func:`decode` is total and bounded, as the side channel's decode is: the frame count, the tag, the body's size and
then its nesting depth (:func:`kvlifecycle.untrusted.check_msgpack`, before msgspec sees a byte: msgspec recurses
without a depth limit) are checked first; any bytes give a typed message or :class:`MalformedMessage`, never another
exception. The manager counts and drops what is refused, logging at a bounded rate.
"""

from __future__ import annotations

from typing import Union

import msgspec

from kvlifecycle.untrusted import UntrustedInputError, check_msgpack

TAG = b"KVL1"
MAX_BODY_BYTES = 1 << 20  # a room's page list at 4 B/page: 256k pages; anything larger is refused
MAX_DEPTH = 4  # the deepest message nests 2 levels (a struct holding a list); a little room, no more


class Register(msgspec.Struct, frozen=True, tag="reg"):
    """D → P, once per (D agent, P rank): where D's KV and aux rows live, and who D is."""

    agent: str
    epoch: int
    endpoint: str
    port: int
    nixl_metadata: bytes
    kv_ptrs: list[int]
    kv_item_lens: list[int]
    kv_num_pages: int
    aux_ptrs: list[int]
    aux_item_lens: list[int]
    aux_rows: list[int]
    page_size: int
    tp_size: int
    tp_rank: int


class RoomMeta(msgspec.Struct, frozen=True, tag="meta"):
    """D → P, once per room: the pages D reserved (push target), its aux row, and the transfer id D loads under."""

    room: int
    agent: str
    epoch: int
    transfer: str
    dst_pages: bytes  # int32 page ids
    dst_aux_index: int
    required_dst_info_num: int
    decode_prefix_len: int = 0
    is_dummy: bool = False


class Claim(msgspec.Struct, frozen=True, tag="claim"):
    """D → P: a decode receiver exists for ``room`` (metadata may follow later): P keeps the room waiting."""

    room: int
    agent: str
    epoch: int


class Heartbeat(msgspec.Struct, frozen=True, tag="hb"):
    """Both ways, every interval: the sender is alive under ``epoch``; D lists the rooms it still waits on."""

    agent: str
    epoch: int
    role: str  # "prefill" | "decode"
    endpoint: str = ""
    port: int = 0
    prefill_rank: int = 0
    rooms: list[int] = msgspec.field(default_factory=list)
    hlc: int = 0


class Status(msgspec.Struct, frozen=True, tag="status"):
    """P → D: a room's terminal (or bootstrap) status, with the transfer it concerns and P's epoch and HLC."""

    room: int
    status: int  # sglang KVPoll value
    prefill_rank: int
    agent: str
    epoch: int
    transfer: str = ""
    reason: str = ""
    hlc: int = 0


class AbortAck(msgspec.Struct, frozen=True, tag="ack"):
    """P → D: every write P posted for ``room`` has settled; D's pages may be reused."""

    room: int
    prefill_rank: int
    agent: str
    epoch: int
    generation: int = -1
    hlc: int = 0


class Refused(msgspec.Struct, frozen=True, tag="refused"):
    """P → D: P refused D's registration (``reason`` says why, e.g. a page size mismatch). D fails every room that
    waits on this prefill rank with that reason at once, instead of learning it from the rank's silence."""

    agent: str  # the refused decode agent
    epoch: int  # of the refused registration
    prefill_agent: str
    prefill_epoch: int
    prefill_rank: int
    reason: str


class GiveUp(msgspec.Struct, frozen=True, tag="giveup"):
    """D → P: D stops waiting for ``room`` (P did not serve it within D's bound). P fails the room as for an
    ABORT and acknowledges (``AbortAck``) once none of its writes towards D's pages is in flight."""

    room: int
    agent: str
    epoch: int
    endpoint: str
    port: int
    reason: str


Message = Union[Register, RoomMeta, Claim, Heartbeat, Status, AbortAck, Refused, GiveUp]  # noqa: UP007 - msgspec needs a Union

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


class MalformedMessage(ValueError):
    """A frame that claims to be ours but does not decode: refused, never half-applied."""


def encode(msg: Message) -> list[bytes]:
    body = _encoder.encode(msg)
    if len(body) > MAX_BODY_BYTES:
        raise ValueError(f"{type(msg).__name__} is {len(body)} bytes, cap is {MAX_BODY_BYTES}")
    return [TAG, body]


def is_ours(frames: list[bytes]) -> bool:
    return bool(frames) and frames[0] == TAG


def decode(frames: list[bytes]) -> Message:
    """The message in ``frames``, or :class:`MalformedMessage` saying why not; total (any frames in, no other
    exception out) and bounded (size and depth are checked before the body is decoded)."""
    if len(frames) != 2 or frames[0] != TAG:
        raise MalformedMessage(f"expected [{TAG!r}, body], got {len(frames)} frame(s)")
    body = frames[1]
    if not isinstance(body, bytes):
        raise MalformedMessage(f"a body is bytes, not {type(body).__name__}")
    if len(body) > MAX_BODY_BYTES:
        raise MalformedMessage(f"body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
    try:
        check_msgpack(body, max_depth=MAX_DEPTH)
    except UntrustedInputError as exc:
        raise MalformedMessage(f"refused before decoding: {exc}") from exc
    try:
        return _decoder.decode(body)
    except Exception as exc:  # DecodeError/ValidationError, and anything a decoder could still raise: the input's
        raise MalformedMessage(f"undecodable kvlifecycle message: {type(exc).__name__}: {exc}") from exc
