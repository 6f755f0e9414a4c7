"""``kvlifecycle proxy --etcd``: the P/D proxy routing over the instances registered in etcd.

The membership package follows the instances (:class:`~kvlifecycle.membership.instances.InstanceDirectory`, on its
watcher threads); this module hands each change to the proxy's event loop, where :meth:`PDProxy.set_upstreams`
swaps the server lists between two requests. The static ``--prefill`` / ``--decode`` servers stay in the lists
whatever etcd says (first, in the order given), so a proxy can front fixed servers and discovered ones together.

etcd down: the last known instances stay routed (the directory says so in one warning); at start the directory
retries in the background, and the proxy serves its static servers (or answers 503 "no ... server registered")
meanwhile. A registered instance that refuses connections is skipped per request, as a static one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvlifecycle.membership.etcd import EtcdOptions, EtcdSession
from kvlifecycle.membership.instances import Instance, InstanceDirectory, Routable
from kvlifecycle.membership.keys import Role
from kvlifecycle.tools.proxy import PDProxy, ProxyConfig, Upstream

log = logging.getLogger("kvlifecycle.proxy")


def merge_upstreams(static: tuple[Upstream, ...], instances: tuple[Instance, ...]) -> tuple[Upstream, ...]:
    out = list(static)
    for instance in instances:
        try:
            upstream = Upstream.parse(instance.api)
        except ValueError as exc:
            log.warning("instance %s registered an unusable api address: %s", instance.name, exc)
            continue
        if upstream not in out:
            out.append(upstream)
    return tuple(out)


class DiscoveringProxy:
    """A :class:`PDProxy` whose servers are the static ones plus those etcd has registered and serving."""

    def __init__(self, config: ProxyConfig, etcd: EtcdOptions) -> None:
        self.static = (config.prefill, config.decode)
        self.proxy = PDProxy(config, discovered=True)
        self.session = EtcdSession(etcd)
        self.directory = InstanceDirectory(self.session, on_change=self._on_change)
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self, host: str, port: int) -> int:
        self._loop = asyncio.get_running_loop()
        bound = await self.proxy.start(host, port)
        self.directory.start()
        return bound

    async def serve_forever(self) -> None:
        await self.proxy.serve_forever()

    async def close(self) -> None:
        await self.proxy.close()
        await asyncio.get_running_loop().run_in_executor(None, self._close_directory)

    def _close_directory(self) -> None:
        self.directory.close()
        self.session.close()

    def _on_change(self, routable: Routable) -> None:
        """On a watcher thread: compute the new lists, apply them on the proxy's loop."""
        prefill = merge_upstreams(self.static[0], routable[Role.PREFILL])
        decode = merge_upstreams(self.static[1], routable[Role.DECODE])
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check: nothing left to route
            loop.call_soon_threadsafe(self.proxy.set_upstreams, prefill, decode)


async def serve_discovered(config: ProxyConfig, etcd: EtcdOptions, host: str, port: int,
                           ready: asyncio.Event | None = None) -> None:
    proxy = DiscoveringProxy(config, etcd)
    bound = await proxy.start(host, port)
    log.info("kvlifecycle proxy on %s:%d; instances from etcd %s (cluster %s); static prefill %s; static decode %s",
             host, bound, ",".join(etcd.endpoints), etcd.cluster, ", ".join(map(str, config.prefill)) or "(none)",
             ", ".join(map(str, config.decode)) or "(none)")
    if ready is not None:
        ready.set()
    try:
        await proxy.serve_forever()
    finally:
        await proxy.close()
