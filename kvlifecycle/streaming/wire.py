"""What a stream's two sides share: its options and the payload of its per-layer notification.

A layer batch's notification (kind ``layers``) travels with the batch's WRITE, so it reaches D only after those
bytes landed. It names block *positions* ``[lo, hi)`` in D's reserved list rather than ids: four small integers
whatever the prompt length, where a list of ids would outgrow the notification cap (4 KiB) past ~800 blocks. A
stream's end that is not a completion is a ``failed`` note, sent only once no write of the stream is in flight.
:class:`StreamOptions` refuses, when made, a stream timeout too short for its write window (the bound in
:mod:`kvlifecycle.protocol.bounds`).
"""

from __future__ import annotations

from typing import Annotated

import attrs
import msgspec
import numpy as np

from kvlifecycle import validators as v
from kvlifecycle.claims import TOKEN_BYTES
from kvlifecycle.control import Counter, Token
from kvlifecycle.protocol.bounds import check_stream_window, default_write_window

NOTE_LAYERS = "layers"  # a layer batch landed: payload = token + LayerBatch
NOTE_FAILED = "failed"  # the stream ended without completing, every write settled: payload = token + reason


@attrs.frozen(kw_only=True)
class StreamOptions:
    """How a stream's sides run; validated when made."""

    # regions per model layer, in the registration order (a K/V-outer layer is two regions, K then V; fused KV one)
    regions_per_layer: int = attrs.field(default=1, validator=v.integer(1))
    # P keeps a reservation for a request it has not begun this long, at most its write window (D's stream then
    # times out or is cancelled); at least the window
    reservation_ttl_s: float = attrs.field(default=60.0, validator=v.positive)
    # D fails a stream that made no progress this long (P died, or its notes are lost); it must exceed the write
    # window + the settle bound (kvlifecycle.protocol.bounds), so no write of P lands after D freed the blocks
    stream_timeout_s: float = attrs.field(default=60.0, validator=v.positive)
    service_poll_s: float = attrs.field(default=0.0005, validator=v.positive)  # while writes are in flight
    idle_poll_s: float = attrs.field(default=0.005, validator=v.positive)
    # D's stream request asks P to post no layer later than this after its receipt (default: 0.8 of the timeout)
    write_window_s: float = attrs.field(
        default=attrs.Factory(lambda self: default_write_window(self.stream_timeout_s), takes_self=True),
        validator=v.positive)
    # liveness: D sends each P one StreamHeartbeat naming its open streams this often; P ends the streams of a D
    # it has not heard for peer_timeout_s, D ends those of a P that has not answered for as long
    heartbeat_interval_s: float = attrs.field(default=1.0, validator=v.positive)
    peer_timeout_s: float = attrs.field(default=10.0, validator=v.positive)

    def __attrs_post_init__(self) -> None:
        check_stream_window(write_window_s=self.write_window_s, stream_timeout_s=self.stream_timeout_s,
                            reservation_ttl_s=self.reservation_ttl_s)
        if self.peer_timeout_s <= self.heartbeat_interval_s:
            raise ValueError(f"peer_timeout_s ({self.peer_timeout_s:g}) must exceed heartbeat_interval_s "
                             f"({self.heartbeat_interval_s:g}): a live peer would time out between two beats")


MAX_HEARTBEAT_STREAMS = 4096  # open streams one heartbeat may name (a D holds far fewer with one P)


class StreamHeartbeat(msgspec.Struct, frozen=True, tag=True):
    """D → P, every ``heartbeat_interval_s``: D agent ``agent`` (``epoch``) is alive and holds the streams whose
    tokens are ``tokens``. P's ``Ack`` is D's proof that P is alive; ``detail`` carries P's agent epoch."""

    agent: str
    epoch: Counter
    tokens: Annotated[list[Token], msgspec.Meta(max_length=MAX_HEARTBEAT_STREAMS)]


Position = Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)]


Digest = Annotated[int, msgspec.Meta(ge=0)]  # a u64: msgpack carries no larger integer


class LayerBatch(msgspec.Struct, frozen=True, array_like=True):
    """Layers ``[first_layer, first_layer + num_layers)`` of D's blocks at positions ``[lo, hi)`` landed.

    ``digest`` (appended; None from a P that does not verify this stream): P's
    :func:`~kvlifecycle.digest.batch_digest` of the batch's blocks over the batch's layers' regions, checked by D
    before the layers count as landed."""

    first_layer: Position
    num_layers: Position
    lo: Position
    hi: Position
    digest: Digest | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(LayerBatch)


def encode_batch(token: bytes, batch: LayerBatch) -> bytes:
    return token + _encoder.encode(batch)


def decode_batch(payload: bytes) -> tuple[bytes, LayerBatch]:
    """``(token, batch)``; ``ValueError`` for a payload that is not one (the sender's fault: counted, dropped)."""
    try:
        return payload[:TOKEN_BYTES], _decoder.decode(payload[TOKEN_BYTES:])
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a layer batch: {exc}") from exc


def layer_regions(layers: int, regions_per_layer: int) -> list[np.ndarray]:
    """The region indices of each layer: layer ``l`` owns ``[l * rpl, (l + 1) * rpl)``."""
    return [np.arange(layer * regions_per_layer, (layer + 1) * regions_per_layer, dtype=np.int32)
            for layer in range(layers)]
