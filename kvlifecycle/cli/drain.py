"""``kvlifecycle drain --etcd ENDPOINTS --instance NAME``: scale a prefill instance in without failing a request.

Marks every rank of the instance ``draining`` in etcd (see kvlifecycle.membership.drain): ``kvlifecycle proxy
--etcd`` and D route nothing new to it at once, and each P rank, following its own key, stops taking new work,
lets its live leases finish (bounded by its ``drain_timeout_s``) and deletes its key. ``--wait S`` waits (bounded)
until the instance has left etcd, so a script can stop the engine after it.

Exit status: 0 marked (and, with ``--wait``, gone); 1 no such instance, or still registered after ``--wait``;
2 etcd unreachable or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--etcd", required=True, metavar="ENDPOINTS",
                        help="comma-separated etcd endpoints (host:port)")
    parser.add_argument("--etcd-cluster", default="default", metavar="NAME",
                        help="the cluster name of the etcd keys (default 'default')")
    parser.add_argument("--instance", required=True, metavar="NAME",
                        help="the prefill engine instance to drain (its name in etcd: vLLM's engine_id)")
    parser.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="wait at most S seconds for the instance to leave etcd (default 0: do not wait)")
    parser.add_argument("--etcd-timeout", type=float, default=2.0, metavar="S",
                        help="timeout of each etcd call (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    from kvlifecycle.membership import EtcdOptions, EtcdSession, MembershipError, order_drain, wait_departed
    from kvlifecycle.membership.etcd import EtcdUnavailableError

    try:
        options = EtcdOptions(tuple(e.strip() for e in args.etcd.split(",") if e.strip()), cluster=args.etcd_cluster,
                              request_timeout_s=args.etcd_timeout, backoff_max_s=max(args.etcd_timeout, 0.1))
    except ValueError as exc:
        print(f"kvlifecycle drain: {exc}", file=sys.stderr)
        return 2
    session = EtcdSession(options)
    try:
        ranks = order_drain(session, args.instance)
        left = wait_departed(session, args.instance, timeout_s=args.wait) if args.wait > 0 else None
    except EtcdUnavailableError as exc:
        print(f"kvlifecycle drain: {exc}", file=sys.stderr)
        return 2
    except (MembershipError, ValueError, ImportError) as exc:  # ImportError: the etcd client is an extra
        print(f"kvlifecycle drain: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ImportError) else 1
    finally:
        session.close()
    keys = [rank.key.path for rank in ranks]
    if args.json:
        print(json.dumps({"instance": args.instance, "draining": keys, "departed": left}))
    else:
        for key in keys:
            print(f"draining {key}")
        if left is not None:
            print(f"{args.instance}: {'left etcd' if left else f'still registered after {args.wait:g} s'}")
    return 1 if left is False else 0
