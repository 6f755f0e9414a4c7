"""One writer per log directory: an OS lock (``flock``) on ``.writer.lock`` in the directory, held for the writer's
lifetime.

The kernel drops the lock when the holder's file is closed, which includes the process dying (SIGKILL too), so a
killed writer never blocks its successor. The file names its holder (pid and host) for the refusal a second writer
gets; its content is advisory, the lock is the ``flock``. Readers take no lock (they never modify a log's files).
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

LOCK_NAME = ".writer.lock"  # not a segment name (seg-*.kvl): segment listings never see it


class LockHeld(Exception):
    """Another open file holds the directory's writer lock; :attr:`holder` is what its lock file says."""

    def __init__(self, path: Path, holder: str) -> None:
        super().__init__(f"{path} is held by {holder}")
        self.path = path
        self.holder = holder


class WriterLock:
    """The exclusive ``flock`` on a directory's lock file, taken at construction (never waits)."""

    def __init__(self, directory: Path) -> None:
        self._fd: int | None = None  # first: __del__ runs on a lock whose constructor raised, too
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise LockHeld(self.path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        try:  # advisory content: who holds it (a failure to write it, e.g. a full disk, does not matter)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid={os.getpid()} host={socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the lock go (closing the file releases it); idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # a writer dropped without close() lets its directory go
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "an unknown process (its lock file names nobody yet)"
