"""A transport double over the real loopback transport: posts stay PENDING (no byte moves) until let go, and
releasing one while pending cancels it, as NIXL cancels a released request. For the tests of what a late or
cancelled transfer may and may not do to a block."""

from __future__ import annotations

import threading

from kvlifecycle.transports.loopback import LoopbackTransport

from kvlifecycle.transport import TransferHandle, XferOp, XferStatus


class Gated:
    """A real loopback transport whose posts wait behind a gate: a transfer stays PENDING (no byte moves) until the
    gate opens; releasing it while pending cancels it (it never moves a byte, as a cancelled NIXL request)."""

    def __init__(self, inner: LoopbackTransport) -> None:
        self.inner = inner
        self.gate_open = False
        self.hold_done = False  # a transfer that moved its bytes (and notified) still polls PENDING meanwhile
        self.pending: dict[int, tuple] = {}
        self.cancelled = 0
        self._done: dict[int, TransferHandle] = {}
        self._ids = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def post(self, op, plan, local_blocks, remote_blocks, **kwargs) -> TransferHandle:
        with self._lock:
            self._ids += 1
            handle = TransferHandle(-self._ids, XferOp(op), plan.peer, 0, kwargs.get("transfer", ""))
            self.pending[handle.id] = (op, plan, local_blocks, remote_blocks, kwargs)
        return handle

    def poll(self, handle: TransferHandle) -> XferStatus:
        with self._lock:
            if handle.id in self.pending and self.gate_open:
                op, plan, local, remote, kwargs = self.pending.pop(handle.id)
                self._done[handle.id] = self.inner.post(op, plan, local, remote, **kwargs)
            if handle.id in self.pending or self.hold_done:
                return XferStatus.PENDING
            return self.inner.poll(self._done[handle.id])

    def error(self, handle: TransferHandle):
        return self.inner.error(self._done[handle.id]) if handle.id in self._done else None

    def stats(self, handle: TransferHandle):
        return self.inner.stats(self._done[handle.id]) if handle.id in self._done else None

    def release(self, handle: TransferHandle) -> None:
        with self._lock:
            if self.pending.pop(handle.id, None) is not None:
                self.cancelled += 1
            elif handle.id in self._done:
                self.inner.release(self._done.pop(handle.id))

    def let_go(self) -> int:
        """Move the held transfers' bytes now, whatever the gate. Returns how many."""
        with self._lock:
            held, self.pending = self.pending, {}
            for handle_id, (op, plan, local, remote, kwargs) in held.items():
                self._done[handle_id] = self.inner.post(op, plan, local, remote, **kwargs)
        return len(held)
