"""``kvlifecycle proxy``: an OpenAI-compatible front for prefill/decode servers (see kvlifecycle.tools.proxy)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", action="extend", required=True, metavar="HOST:PORT",
                        help="prefill server(s); repeat or list several for round-robin")
    parser.add_argument("--decode", nargs="+", action="extend", required=True, metavar="HOST:PORT",
                        help="decode server(s); repeat or list several for round-robin")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0 picks one)")
    parser.add_argument("--connect-timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for an upstream connection (default 10)")
    parser.add_argument("--prefill-timeout", type=float, default=600.0, metavar="S",
                        help="seconds to wait for a prefill answer (default 600)")
    parser.add_argument("--decode-idle-timeout", type=float, default=600.0, metavar="S",
                        help="longest silence while streaming a decode answer (default 600)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.tools.proxy import ProxyConfig, Upstream, serve

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ProxyConfig(
            prefill=tuple(Upstream.parse(text) for text in args.prefill),
            decode=tuple(Upstream.parse(text) for text in args.decode),
            connect_timeout_s=args.connect_timeout,
            prefill_timeout_s=args.prefill_timeout,
            decode_idle_timeout_s=args.decode_idle_timeout,
        )
    except ValueError as exc:
        raise SystemExit(f"kvlifecycle proxy: {exc}") from exc
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(config, args.host, args.port))
    return 0
