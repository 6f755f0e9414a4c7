"""``kvlifecycle proxy --etcd`` against a real etcd: it routes over the P and D instances registered there, follows
them as they come, drain and go, and keeps the last known set (saying so) while etcd is down.

The P and D servers are small HTTP doubles on 127.0.0.1 (the real-vLLM run across hosts is in
test_vllm_etcd.py); the registrations are the membership package's own, under real etcd leases.
Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import etcd_harness as eh
import pytest

from kvlifecycle.membership import EtcdOptions, EtcdSession, Member, MemberKey, MemberState, Registration, Role
from kvlifecycle.membership.instances import Instance, routable_instances
from kvlifecycle.tools.proxy import ProxyConfig, Upstream
from kvlifecycle.tools.proxy_discovery import DiscoveringProxy, merge_upstreams

pytestmark = pytest.mark.multihost

TTL_S = 2
CLUSTER = "proxy"


def wait_for(predicate: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return predicate()


class Double:
    """A prefill double answers kv_transfer_params naming itself; a decode double answers JSON naming itself and
    the prefill whose params it got."""

    def __init__(self, role: str, name: str) -> None:
        self.role, self.name, self.port, self.hits = role, name, 0, 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        body = json.loads(await reader.readexactly(length))
        self.hits += 1
        if self.role == "prefill":
            answer: dict = {"choices": [{"text": "x"}], "kv_transfer_params": {"from": self.name}}
        else:
            answer = {"choices": [{"text": f"{body['kv_transfer_params']['from']}->{self.name}"}]}
        payload = json.dumps(answer).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        await writer.drain()
        writer.close()


@contextmanager
def proxy_on_etcd(server: eh.EtcdServer, doubles: list[Double],
                  static: tuple[str, str] | None = None) -> Iterator[tuple[DiscoveringProxy, int]]:
    """The discovering proxy and the doubles on one event loop in a thread; yields the proxy and its port.
    ``static``: the names of a prefill and a decode double given as static servers."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}
    options = EtcdOptions((server.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S, request_timeout_s=1.0,
                          backoff_max_s=0.5)

    async def main() -> None:
        for double in doubles:
            srv = await asyncio.start_server(double.handle, "127.0.0.1", 0)
            double.port = srv.sockets[0].getsockname()[1]
        fixed = [tuple(Upstream("127.0.0.1", d.port) for d in doubles if d.name == name) for name in static or ()]
        prefill, decode = fixed if fixed else ((), ())
        proxy = DiscoveringProxy(ProxyConfig(prefill, decode, connect_timeout_s=2.0, prefill_timeout_s=10.0,
                                             decode_idle_timeout_s=10.0), options)
        state["port"] = await proxy.start("127.0.0.1", 0)
        state["proxy"] = proxy
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(20)
    try:
        yield state["proxy"], state["port"]
    finally:
        asyncio.run_coroutine_threadsafe(state["proxy"].close(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def complete(port: int) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            return resp.status, raw.decode(errors="replace")
        return resp.status, json.loads(raw)["choices"][0]["text"]
    finally:
        conn.close()


def register(session: EtcdSession, role: Role, double: Double, epoch: int = 1) -> Registration:
    key = MemberKey(CLUSTER, role, double.name)
    member = Member("tcp://127.0.0.1:1" if role is Role.PREFILL else "", double.name, epoch,
                    api=f"127.0.0.1:{double.port}")
    registration = Registration(session, key, member)
    registration.register()
    return registration


def routed(proxy: DiscoveringProxy) -> tuple[set[int], set[int]]:
    config = proxy.proxy.config
    return {u.port for u in config.prefill}, {u.port for u in config.decode}


def test_an_instance_is_routable_with_an_api_and_no_rank_draining() -> None:
    def rank(instance: str, tp: int, api: str = "", state: MemberState = MemberState.SERVING) -> tuple:
        return MemberKey("c", Role.PREFILL, instance, 0, tp), Member("tcp://h:1", f"{instance}{tp}", 1, state, api=api)

    peers = dict([rank("b", 0, "h:80"), rank("b", 1), rank("a", 1, "h:81"), rank("a", 0, "h:82"),
                  rank("c", 0, "h:83"), rank("c", 1, state=MemberState.DRAINING), rank("d", 0)])
    assert routable_instances(Role.PREFILL, peers) == (Instance(Role.PREFILL, "a", "h:82", 2),
                                                       Instance(Role.PREFILL, "b", "h:80", 2))


def test_registered_instances_are_routed_and_followed_as_they_come_drain_and_go(
        local_etcd: eh.EtcdServer) -> None:
    p0, p1, d0 = Double("prefill", "p0"), Double("prefill", "p1"), Double("decode", "d0")
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S,
                                      request_timeout_s=1.0))
    with proxy_on_etcd(local_etcd, [p0, p1, d0]) as (proxy, port):
        assert wait_for(proxy.directory.started.is_set, 10)
        status, text = complete(port)
        assert status == 503 and "no decode server registered" in text  # nothing registered yet
        regs = [register(session, Role.PREFILL, p0), register(session, Role.DECODE, d0)]
        try:
            assert wait_for(lambda: routed(proxy) == ({p0.port}, {d0.port}), 4 * TTL_S)
            assert complete(port) == (200, "p0->d0")
            regs.append(register(session, Role.PREFILL, p1))  # scale-out: a new P instance gets traffic
            joined = time.monotonic()
            assert wait_for(lambda: routed(proxy) == ({p0.port, p1.port}, {d0.port}), 4 * TTL_S, poll_s=0.001)
            joined_s = time.monotonic() - joined
            answers = {complete(port) for _ in range(4)}
            assert answers == {(200, "p0->d0"), (200, "p1->d0")}
            regs[0].set_state(MemberState.DRAINING)  # a draining P gets nothing new
            assert wait_for(lambda: routed(proxy) == ({p1.port}, {d0.port}), 4 * TTL_S)
            hits = p0.hits
            assert {complete(port) for _ in range(3)} == {(200, "p1->d0")} and p0.hits == hits
            regs[2].close()  # p1 dies: its lease runs out, it leaves the routes
            died = time.monotonic()
            assert wait_for(lambda: routed(proxy) == (set(), {d0.port}), 4 * TTL_S)
            print(f"\nproxy --etcd: a new P routed {joined_s * 1e3:.0f} ms after it registered; a dead P unrouted "
                  f"{time.monotonic() - died:.2f}s after its last keep-alive (etcd lease TTL {TTL_S}s)")
            status, text = complete(port)
            assert status == 503 and "no prefill server registered" in text
            regs[0].deregister()
        finally:
            for reg in regs:
                reg.close()
            session.close()


def test_etcd_down_keeps_the_last_known_instances_says_so_and_recovers(
        local_etcd: eh.EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvlifecycle.membership")
    p0, d0, d1 = Double("prefill", "p0"), Double("decode", "d0"), Double("decode", "d1")
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S,
                                      request_timeout_s=1.0, backoff_max_s=0.5))
    with proxy_on_etcd(local_etcd, [p0, d0, d1]) as (proxy, port):
        regs = [register(session, Role.PREFILL, p0), register(session, Role.DECODE, d0)]
        try:
            assert wait_for(lambda: routed(proxy) == ({p0.port}, {d0.port}), 4 * TTL_S)
            local_etcd.stop()
            assert wait_for(lambda: "etcd unavailable: routing over the last known 1 prefill and 1 decode "
                                    "instance(s)" in caplog.text, 30)
            time.sleep(TTL_S + 1)  # past the TTL: an etcd outage removes no one
            assert routed(proxy) == ({p0.port}, {d0.port})
            assert complete(port) == (200, "p0->d0")
            local_etcd.start()
            assert wait_for(lambda: "etcd reachable again" in caplog.text, 30)
            regs.append(register(session, Role.DECODE, d1))  # discovery works again after the outage
            assert wait_for(lambda: routed(proxy) == ({p0.port}, {d0.port, d1.port}), 6 * TTL_S)
        finally:
            for reg in regs:
                reg.close()
            session.close()


def test_etcd_down_at_start_serves_the_static_servers_then_follows_etcd_once_it_answers(
        local_etcd: eh.EtcdServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvlifecycle.membership")
    p0, d0, p1 = Double("prefill", "p0"), Double("decode", "d0"), Double("prefill", "p1")
    local_etcd.stop()
    with proxy_on_etcd(local_etcd, [p0, d0, p1], static=("p0", "d0")) as (proxy, port):
        assert wait_for(lambda: "etcd unavailable at start (try 1)" in caplog.text, 10)
        assert complete(port) == (200, "p0->d0")  # the static servers answer meanwhile
        local_etcd.start()
        assert wait_for(proxy.directory.started.is_set, 30)
        session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S,
                                          request_timeout_s=1.0))
        reg = register(session, Role.PREFILL, p1)
        try:
            assert wait_for(lambda: routed(proxy) == ({p0.port, p1.port}, {d0.port}), 4 * TTL_S)
            assert {complete(port) for _ in range(4)} == {(200, "p0->d0"), (200, "p1->d0")}
        finally:
            reg.close()
            session.close()


def test_the_static_servers_stay_routed_beside_the_discovered_ones() -> None:
    static = (Upstream("10.0.0.1", 80),)
    found = (Instance(Role.DECODE, "a", "10.0.0.1:80", 1), Instance(Role.DECODE, "b", "10.0.0.2:81", 1),
             Instance(Role.DECODE, "c", "no-port", 1))
    assert merge_upstreams(static, found) == (Upstream("10.0.0.1", 80), Upstream("10.0.0.2", 81))


@contextmanager
def doubles_running(doubles: list[Double]) -> Iterator[None]:
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    async def main() -> None:
        for double in doubles:
            srv = await asyncio.start_server(double.handle, "127.0.0.1", 0)
            double.port = srv.sockets[0].getsockname()[1]
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(main()), loop.run_forever()), daemon=True)
    thread.start()
    assert ready.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_the_cli_routes_over_etcd_and_refuses_to_start_with_nothing_to_route(local_etcd: eh.EtcdServer,
                                                                          tmp_path: Path) -> None:
    refused = subprocess.run([sys.executable, "-m", "kvlifecycle", "proxy"], capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode != 0 and "--etcd ENDPOINTS" in refused.stderr
    p0, d0 = Double("prefill", "p0"), Double("decode", "d0")
    port = eh.free_port()
    log = tmp_path / "proxy.log"
    session = EtcdSession(EtcdOptions((local_etcd.endpoint,), cluster=CLUSTER, lease_ttl_s=TTL_S,
                                      request_timeout_s=1.0))
    with doubles_running([p0, d0]), open(log, "wb") as out:
        proxy = subprocess.Popen([sys.executable, "-m", "kvlifecycle", "proxy", "--port", str(port), "--etcd",
                                  local_etcd.endpoint, "--etcd-cluster", CLUSTER], stdout=out,
                                 stderr=subprocess.STDOUT)
        regs = [register(session, Role.PREFILL, p0), register(session, Role.DECODE, d0)]
        try:
            def answered() -> bool:
                try:
                    return complete(port) == (200, "p0->d0")
                except OSError:
                    return False

            assert wait_for(answered, 60), log.read_text()
            assert "routable instances: prefill p0@127.0.0.1:" in log.read_text()
        finally:
            proxy.terminate()
            proxy.wait(30)
            for reg in regs:
                reg.close()
            session.close()
