"""The multi-host worker (:mod:`host_worker`) with what the partition tests need on top: P reuses released blocks at
once (the adversary a read that outlives its lease would meet), D records when it released each pending read, and
D can hold a read's completion notification back (the last byte landed, P not told yet).

Every time here is ``time.monotonic()``: the namespaces share the host's CLOCK_MONOTONIC, so a time taken in P's
process and one taken in D's are on one clock (the ledgers' ``at`` is that clock too).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from host_worker import MemberWorker

from kvlifecycle.tools.workers import worker_main

REUSE_EVERY_S = 0.002


class PartitionWorker(MemberWorker):
    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self._reuser: threading.Thread | None = None
        self._stop_reuse = threading.Event()
        self.reused: list[list[Any]] = []  # [request, reused as, monotonic time]
        self.read_releases: dict[str, list[Any]] = {}  # transfer -> [monotonic time, status at release]
        self.held: list[tuple[str, Any]] = []  # (P agent, notification) held back
        self._hold = False
        self._track_reads()

    # -- P: a released lease's blocks are freed and allocated again at once --------------------------------------
    def reuse_released(self) -> None:
        """From now on, every lease P releases has its blocks freed and allocated to a new request at once, with
        new bytes written into them: what a read still in flight would then read."""
        import torch

        def loop() -> None:
            n = 0
            while not self._stop_reuse.wait(REUSE_EVERY_S):
                for rel in self.ledger.take_released():
                    blocks = [int(b) for b in self.ledger.requests[rel.request].blocks]
                    self.ledger.free(rel.request)
                    n += 1
                    again = f"reuse{n}-{rel.request}"
                    self.ledger.allocate(again, blocks)
                    idx = torch.tensor(blocks, dtype=torch.long)
                    for t in self.kv:
                        t[idx] = 0xA5  # the new owner's bytes
                    self.reused.append([rel.request, again, time.monotonic(), rel.reason])

        self._reuser = threading.Thread(target=loop, name="reuser", daemon=True)
        self._reuser.start()

    def reuses(self) -> list[list[Any]]:
        return list(self.reused)

    # -- D: when each pending read was released; notifications held back -----------------------------------------
    def _track_reads(self) -> None:
        if self.cfg.side != "consumer":
            return
        from kvlifecycle.transport import XferStatus

        transport = self.transport
        post, release = transport.post, transport.release

        def tracked_release(handle: Any) -> None:
            status = transport.poll(handle)
            if status is XferStatus.PENDING:  # a read still in flight: this release cancels it
                self.read_releases[handle.transfer] = [time.monotonic(), status.name]
            release(handle)

        def held_post(*args: Any, **kwargs: Any) -> Any:
            note = kwargs.get("notification")
            if self._hold and note is not None:
                self.held.append((args[1].peer, note))
                kwargs["notification"] = None
            return post(*args, **kwargs)

        transport.release = tracked_release
        transport.post = held_post

    def releases(self) -> dict[str, list[Any]]:
        return dict(self.read_releases)

    def hold_notifications(self, hold: bool = True) -> None:
        """Reads posted from now on complete without telling P (their notifications are kept here)."""
        self._hold = hold

    def send_held(self) -> int:
        """Send the held notifications now (late: P may have expired their leases meanwhile)."""
        held, self.held = self.held, []
        for peer, note in held:
            with contextlib.suppress(Exception):  # a lost peer: the notification is moot
                self.transport.send_notification(peer, note)
        return len(held)

    def set_read_bound_fraction(self, fraction: float) -> None:
        """A mutant for the tests that must catch it: D's read bound at ``fraction`` of the TTL after its last
        acknowledged renewal (the real one is 0.9)."""
        from kvlifecycle.protocol import bounds

        bounds.READ_DEADLINE_FRACTION = fraction

    def stop(self) -> dict[str, Any]:
        self._stop_reuse.set()
        if self._reuser is not None:
            self._reuser.join(5)
        return super().stop()


def main() -> None:
    fd, cfg_hex = int(sys.argv[1]), sys.argv[2]
    worker_main(bytes.fromhex(cfg_hex), Connection(fd), PartitionWorker)


if __name__ == "__main__":
    main()
