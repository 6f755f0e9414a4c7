"""A real TCP proxy on loopback in front of a side channel, which can go silent: once silenced it still accepts and
reads every connection (a peer whose process hangs, or a link that drops every packet: TCP stays open, nothing
comes back) but forwards nothing either way, or (one way) forwards D's requests and drops P's replies. For the
tests of what D does while a P does not answer."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading

from kvlifecycle.sidechannel import parse_address


class SilentProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (a ``tcp://HOST:PORT`` address) until :meth:`silence`."""

    def __init__(self, target: str) -> None:
        self._target = parse_address(target)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self.silent = False
        self.one_way = False  # silent for P's replies only: D's requests still reach P
        self.swallowed = 0  # bytes D sent after the silence (requests that will never be answered)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="silent-proxy", daemon=True)
        self._thread.start()

    def silence(self, *, replies_only: bool = False) -> None:
        self.one_way = replies_only
        self.silent = True

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._sel.select(timeout=0.02):
                if key.data is None:
                    self._accept()
                    continue
                sock, other, upstream = key.fileobj, key.data[0], key.data[1]
                assert isinstance(sock, socket.socket)
                try:
                    data = sock.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._close(sock, other)
                    continue
                if self.silent and (upstream or not self.one_way):
                    if not upstream:
                        self.swallowed += len(data)
                    continue
                with contextlib.suppress(OSError):
                    other.sendall(data)

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError:
            return
        try:
            server = socket.create_connection(self._target, timeout=1.0)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setblocking(True)
            sock.settimeout(1.0)
        self._sel.register(client, selectors.EVENT_READ, (server, False))
        self._sel.register(server, selectors.EVENT_READ, (client, True))

    def _close(self, *socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(sock)
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for key in list(self._sel.get_map().values()):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            sock.close()
        self._sel.close()
