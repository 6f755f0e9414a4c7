"""``kvlifecycle doctor --etcd ENDPOINTS``: is etcd reachable, and who is registered there.

Each endpoint is asked on its own (a session of one endpoint, every call bounded by ``--etcd-timeout``), so a dead
member of a three-node etcd is named, not hidden behind the failover. The registrations come from the first
endpoint that answers: one row per P or D rank (role, instance, DP/TP rank, side-channel address, HTTP api,
agent, epoch, state) with the time its etcd lease has left, which is how long a dead rank would still be listed.

Findings beside the table: a P rank without a side-channel address (no D can reach it), an instance no rank of
which names an HTTP api (``kvlifecycle proxy --etcd`` cannot route to it), a key that does not parse.

Exit status: 0 when an endpoint answered (findings are warnings), 1 when none did.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from kvlifecycle.membership import ROOT, EtcdOptions, EtcdSession, MemberKey, MembershipError, decode_member
from kvlifecycle.membership.keys import Role, cluster_prefix


@dataclass
class EndpointCheck:
    endpoint: str
    ok: bool
    version: str = ""
    detail: str = ""
    ms: float = 0.0


@dataclass
class Row:
    role: str
    instance: str
    dp: int
    tp: int
    address: str
    api: str
    agent: str
    epoch: int
    state: str
    lease: str  # hex id, "" when the key has none
    ttl_left_s: int | None  # None: no lease, or it could not be read


@dataclass
class EtcdReport:
    cluster: str
    endpoints: list[EndpointCheck] = field(default_factory=list)
    registrations: list[Row] = field(default_factory=list)
    findings: list[str] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return any(e.ok for e in self.endpoints)


def _options(endpoint: str, cluster: str, timeout_s: float) -> EtcdOptions:
    return EtcdOptions((endpoint,), cluster=cluster, request_timeout_s=timeout_s, backoff_max_s=timeout_s)


def _lease_info(client: Any, lease_id: int) -> Any:
    return client.get_lease_info(lease_id)


def check_endpoint(endpoint: str, cluster: str, timeout_s: float) -> EndpointCheck:
    try:
        options = _options(endpoint, cluster, timeout_s)
    except ValueError as exc:
        return EndpointCheck(endpoint, False, detail=str(exc))
    session = EtcdSession(options)
    start = time.perf_counter()
    try:
        status = session.call("status", lambda c: c.status())
        return EndpointCheck(endpoint, True, str(status.version), ms=(time.perf_counter() - start) * 1e3)
    except MembershipError as exc:
        return EndpointCheck(endpoint, False, detail=str(exc), ms=(time.perf_counter() - start) * 1e3)
    finally:
        session.close()


def list_registrations(endpoint: str, cluster: str, timeout_s: float) -> tuple[list[Row], list[str]]:
    """The rows under ``cluster`` and the findings; raises :class:`MembershipError` when etcd fails meanwhile."""
    session = EtcdSession(_options(endpoint, cluster, timeout_s))
    prefix = cluster_prefix(cluster)
    rows: list[Row] = []
    findings: list[str] = []
    try:
        resp = session.call(f"list {prefix}", lambda c: c.get_prefix_response(prefix))
        ttl_of: dict[int, int | None] = {}
        for kv in resp.kvs:
            try:
                key = MemberKey.parse(kv.key)
                member = decode_member(kv.value)
            except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                findings.append(f"malformed entry {kv.key.decode(errors='replace')}: {exc}")
                continue
            lease_id = int(kv.lease)
            if lease_id and lease_id not in ttl_of:
                info = session.call("read a lease", functools.partial(_lease_info, lease_id=lease_id))
                ttl_of[lease_id] = int(info.TTL) if int(info.TTL) >= 0 else None
            rows.append(Row(key.role.value, key.instance, key.dp, key.tp, member.address, member.api, member.agent,
                            member.epoch, member.state.value, f"{lease_id:x}" if lease_id else "",
                            ttl_of.get(lease_id)))
    finally:
        session.close()
    rows.sort(key=lambda r: (r.role, r.instance, r.dp, r.tp))
    findings += _findings(rows)
    return rows, findings


def _findings(rows: list[Row]) -> list[str]:
    out = []
    instances: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        instances.setdefault((row.role, row.instance), []).append(row)
        if row.role == Role.PREFILL.value and not row.address:
            out.append(f"{row.role} {row.instance} dp {row.dp} tp {row.tp}: no side-channel address (no D can "
                       f"reach it)")
        if not row.lease:
            out.append(f"{row.role} {row.instance} dp {row.dp} tp {row.tp}: no etcd lease (it never goes away "
                       f"by itself)")
    for (role, instance), ranks in sorted(instances.items()):
        if not any(r.api for r in ranks):
            out.append(f"{role} {instance}: no rank names an HTTP api (kvlifecycle proxy --etcd cannot route "
                       f"to it)")
    return out


def collect(endpoints: list[str], cluster: str, timeout_s: float) -> EtcdReport:
    report = EtcdReport(cluster, [check_endpoint(e, cluster, timeout_s) for e in endpoints])
    for check in report.endpoints:
        if not check.ok:
            continue
        try:
            report.registrations, findings = list_registrations(check.endpoint, cluster, timeout_s)
            report.findings += findings
        except MembershipError as exc:
            report.findings.append(f"listing the registrations on {check.endpoint} failed: {exc}")
        break
    return report


def render(report: EtcdReport) -> str:
    lines = [f"etcd (cluster {report.cluster!r}, keys under {ROOT}/{report.cluster}/)"]
    for e in report.endpoints:
        lines.append(f"  {e.endpoint}: OK, etcd {e.version}, {e.ms:.0f} ms" if e.ok
                     else f"  {e.endpoint}: FAILED: {e.detail}")
    if not report.reachable:
        lines.append(f"etcd FAILED: no endpoint of {', '.join(e.endpoint for e in report.endpoints)} answered; "
                     f"check the addresses, that etcd runs, and that this host can reach it")
        return "\n".join(lines)
    headers = ["role", "instance", "dp", "tp", "address", "api", "agent", "epoch", "state", "lease", "TTL left"]
    table = [[r.role, r.instance, str(r.dp), str(r.tp), r.address or "-", r.api or "-", r.agent, str(r.epoch),
              r.state, r.lease or "-", "-" if r.ttl_left_s is None else f"{r.ttl_left_s} s"]
             for r in report.registrations]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(headers)]
    lines.append("")
    lines.append(f"{len(report.registrations)} registration(s)")
    for row in [headers, *table]:
        lines.append(("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))).rstrip())
    for finding in report.findings:
        lines.append(f"  warning: {finding}")
    lines.append("etcd OK")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    endpoints = [e.strip() for e in args.etcd.split(",") if e.strip()]
    if not endpoints:
        print("kvlifecycle doctor: --etcd needs at least one host:port", file=sys.stderr)
        return 2
    try:
        report = collect(endpoints, args.etcd_cluster, args.etcd_timeout)
    except ImportError as exc:  # the etcd client is an extra
        print(f"kvlifecycle doctor: {exc}", file=sys.stderr)
        return 2
    if args.json:
        payload: dict[str, Any] = asdict(report)
        payload["reachable"] = report.reachable
        print(json.dumps(payload, indent=2))
    else:
        print(render(report))
    return 0 if report.reachable else 1
