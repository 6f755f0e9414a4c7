"""The notification side channel: a ZMQ ROUTER bound on a local address, one DEALER per peer. Every message is
(header, notification), the header the sender's (agent, epoch), so a restarted peer's late messages are dropped."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from kvlifecycle.transport import (
    MalformedNotificationError,
    Notification,
    TransportError,
    decode_notification,
    encode_notification,
)

from .wire import header_decoder

DRAIN_LIMIT = 100_000  # messages one drain takes at most (bounded)


class NotifyChannel:
    """One transport's end of the side channel (``endpoint`` is what its metadata offers)."""

    def __init__(self, agent: str, epoch: int, bind_host: str) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        port = self._router.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{bind_host}:{port}"
        self._header = msgspec.msgpack.encode((agent, epoch))  # every notification's first frame

    def connect(self, endpoint: str) -> Any:
        """A DEALER to a peer's ``endpoint`` (close it with ``close(0)``)."""
        dealer = self._ctx.socket(self._zmq.DEALER)
        dealer.setsockopt(self._zmq.LINGER, 0)
        dealer.setsockopt(self._zmq.SNDHWM, 10000)
        dealer.connect(endpoint)
        return dealer

    def send(self, dealer: Any, peer: str, note: Notification) -> None:
        try:
            dealer.send_multipart([self._header, encode_notification(note)], flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError as exc:
            raise TransportError(f"notification to {peer}: {exc}") from exc

    def receive(self, known_epochs: Mapping[str, int]) -> tuple[list[tuple[str, Notification]], int, int]:
        """Drain what arrived: (notifications, malformed messages dropped, messages from an older epoch dropped)."""
        zmq = self._zmq
        out: list[tuple[str, Notification]] = []
        malformed = stale = 0
        for _ in range(DRAIN_LIMIT):
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3:
                malformed += 1
                continue
            try:
                sender, sender_epoch = header_decoder.decode(frames[1])
                note = decode_notification(frames[2])
            except (msgspec.DecodeError, MalformedNotificationError):
                malformed += 1
                continue
            known = known_epochs.get(sender)
            if known is not None and sender_epoch < known:
                stale += 1
                continue
            out.append((sender, note))
        return out, malformed, stale

    def close(self) -> None:
        self._router.close(0)
