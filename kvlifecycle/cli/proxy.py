"""``kvlifecycle proxy``: an OpenAI-compatible front for prefill/decode servers (see kvlifecycle.tools.proxy); with
``--etcd``, over the instances registered there too (see kvlifecycle.tools.proxy_discovery)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from kvlifecycle.cli.arguments import port

if TYPE_CHECKING:
    from kvlifecycle.membership import EtcdOptions


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="prefill server(s); repeat or list several for round-robin (needed without --etcd)")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="decode server(s); repeat or list several for round-robin (needed without --etcd)")
    parser.add_argument("--etcd", metavar="ENDPOINTS",
                        help="comma-separated etcd endpoints (host:port): also route over the P and D instances "
                             "registered there, following them as they come and go")
    parser.add_argument("--etcd-cluster", default="default", metavar="NAME",
                        help="the cluster name of the etcd keys (default 'default')")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000; 0 picks one)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for an upstream connection (default 10)")
    parser.add_argument("--prefill-timeout", type=float, default=600.0, metavar="S",
                        help="seconds to wait for a prefill answer (default 600)")
    parser.add_argument("--decode-idle-timeout", type=float, default=600.0, metavar="S",
                        help="longest silence while streaming a decode answer (default 600)")
    parser.add_argument("--layerwise", nargs="+", action="extend", default=[], metavar="HOST:PORT",
                        help="layer-wise streaming: each prefill server's kvlifecycle side channel, in --prefill order")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="the proxy's log level (default INFO)")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.tools.proxy import ProxyConfig, Upstream, serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.etcd and not (args.prefill and args.decode):
        raise SystemExit("kvlifecycle proxy: give --prefill and --decode servers, or --etcd ENDPOINTS")
    try:
        config = ProxyConfig(
            prefill=tuple(Upstream.parse(text) for text in args.prefill),
            decode=tuple(Upstream.parse(text) for text in args.decode),
            connect_timeout_s=args.connect_timeout,
            prefill_timeout_s=args.prefill_timeout,
            decode_idle_timeout_s=args.decode_idle_timeout,
            layerwise=tuple(args.layerwise),
        )
        if config.layerwise and len(config.layerwise) != len(config.prefill):
            raise ValueError("--layerwise needs one side channel per --prefill server")
        etcd = _etcd_options(args) if args.etcd else None
    except ValueError as exc:
        raise SystemExit(f"kvlifecycle proxy: {exc}") from exc
    with contextlib.suppress(KeyboardInterrupt):
        if etcd is None:
            asyncio.run(serve(config, args.host, args.port))
        else:
            from kvlifecycle.tools.proxy_discovery import serve_discovered

            asyncio.run(serve_discovered(config, etcd, args.host, args.port))
    return 0


def _etcd_options(args: argparse.Namespace) -> EtcdOptions:
    from kvlifecycle.membership import EtcdOptions

    return EtcdOptions(tuple(e.strip() for e in args.etcd.split(",") if e.strip()), cluster=args.etcd_cluster)
