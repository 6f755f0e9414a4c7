"""Closing a side-channel client ends the request another thread is waiting on at once (a SideChannelError), not at
the request's timeout: a Consumer that closes, or drops a lost P's link, is not held by a silent P. Real TCP on
loopback; every wait is bounded."""

from __future__ import annotations

import socket
import threading

from kvlifecycle.sidechannel import Ack, Ping, SideChannelClient, SideChannelError, SideChannelTimeout

REQUEST_TIMEOUT_S = 60.0  # far past the join's bound below: a request that ended did not end by timing out


def test_close_ends_a_request_waiting_on_a_silent_server() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (the kernel's backlog), never answers
        client = SideChannelClient(f"tcp://127.0.0.1:{silent.getsockname()[1]}", (Ack,), timeout_s=REQUEST_TIMEOUT_S)
        outcome: list[BaseException] = []

        def ask() -> None:
            try:
                client.request(Ping())
            except BaseException as exc:  # the test reports whatever ended it
                outcome.append(exc)

        waiter = threading.Thread(target=ask, daemon=True)
        waiter.start()
        conn, _ = silent.accept()  # the request is out on this connection
        try:
            assert conn.recv(1 << 16)  # its bytes reached the server, which says nothing
            client.close()
            waiter.join(10)
            assert not waiter.is_alive()
            assert len(outcome) == 1 and isinstance(outcome[0], SideChannelError)
            assert not isinstance(outcome[0], SideChannelTimeout)
        finally:
            conn.close()
    try:
        client.request(Ping(), timeout_s=1.0)
    except SideChannelError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed client sent a request")
