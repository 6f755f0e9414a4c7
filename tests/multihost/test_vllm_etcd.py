"""Real vLLM on two hosts found through etcd: P (vllm serve with KVLifecycleConnector, pull mode) in one network
namespace, D in another, a real etcd on a third; the workers register themselves (``etcd_endpoints`` and
``api_address`` in ``kv_connector_extra_config``) and ``kvlifecycle proxy --etcd`` routes over what is registered,
with no static server list. Greedy outputs through it equal a single instance's; ``kvlifecycle doctor --etcd``
lists both instances with their api and agent epoch; ``kvlifecycle drain`` scales P in with requests in flight
(none fails, P leaves once its leases ended, a P started afterwards gets the traffic); a D killed mid-load loses
its leases on P through etcd, long before their TTL; a P killed with SIGKILL leaves the routes once its etcd
lease runs out, and D invalidates it.

A second proxy on the front host is given P and D on its command line (no etcd): through it too, greedy outputs
equal the single instance's, and D, given one prompt with the params of another, answers the other's
continuation, which it can only know from the KV it read from P's host.

The hosts' settings are vllm_hosts.py's (NIXL over UCX TCP on the veth, HMAC on, one OpenMP thread per instance;
the single instance is the session's, tests/conftest.py, on 127.0.0.1 outside the namespaces, on P's core). Needs
root, etcd (scripts/setup-etcd.sh), the vLLM venv and the tiny model; under KVL_REQUIRE_ALL=1 it fails instead
of skipping. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import etcd_harness as eh
import netns_harness as nh
import pytest
from test_hosts import shape
from vllm_hosts import (
    HERE,
    HTTP_PORT,
    MAX_TOKENS,
    PROXY_PORT,
    SIDE_CHANNEL_PORT,
    START_TIMEOUT_S,
    STATIC_PROXY_PORT,
    Served,
    http,
    kvl_config,
    reference,
    start_vllm,
)

from kvlifecycle import events as ev
from kvlifecycle.eventlog import LogError, read_events

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))
import vllm_harness as vh  # beside the single-host vLLM tests

pytestmark = [pytest.mark.multihost, pytest.mark.vllm, pytest.mark.slow]

CLUSTER = "vllm-hosts"
LEASE_TTL_S = 3  # the workers' etcd lease: a killed P leaves the routes within this (plus etcd's expiry tick)
UNROUTE_BOUND_S = 4 * LEASE_TTL_S + 10  # bounded wait: TTL, etcd's lease expiry check, the proxy's watch
SHUTDOWN_TIMEOUT_S = 20  # D's vllm serve --shutdown-timeout: how long its workers get at SIGTERM
BLOCK_LEASE_TTL_S = 300  # P's block leases: anything that ends one within a test ended it before its TTL
DRAIN_TIMEOUT_S = 240  # an ordered drain waits this long (at most) for P's leases


@dataclass
class EtcdHosts:
    prefill: Served
    decode: Served
    single: vh.VLLMServer  # the session's reference instance (tests/conftest.py), outside the namespaces
    proxy: Served
    front: nh.Host
    etcd: eh.EtcdServer
    events: Path
    cluster: nh.Cluster
    model: Path
    logs: Path
    lent: dict[str, str]
    started: list[Served] = field(default_factory=list)  # servers the tests started; stopped at the end too


def lend_etcd_client(work: Path) -> dict[str, str]:
    """The vLLM venv's own etcd client when it has one (scripts/setup-vllm-env.sh installs ``kvlifecycle[etcd]``);
    an older venv gets this interpreter's through PYTHONPATH (the same Python; vLLM brings grpcio and protobuf)."""
    probe = subprocess.run([str(vh.VLLM_PYTHON), "-c", "import pyetcd"], capture_output=True, timeout=120,
                           env=vh.base_env())
    if probe.returncode == 0:
        return {}
    spec = importlib.util.find_spec("pyetcd")
    assert spec is not None and spec.origin is not None
    lent = work / "etcd-client"
    lent.mkdir()
    (lent / "pyetcd").symlink_to(Path(spec.origin).parent)
    return {"PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(lent)) if p)}


def etcd_kv_config(role: str, events: Path, host: nh.Host, etcd: eh.EtcdServer, engine_id: str) -> dict:
    kv = kvl_config(role, events, host.address)
    kv["engine_id"] = engine_id  # the instance's name in etcd
    kv["kv_connector_extra_config"].update(etcd_endpoints=etcd.endpoint, etcd_cluster=CLUSTER,
                                           etcd_lease_ttl_s=LEASE_TTL_S, api_address=f"{host.address}:{HTTP_PORT}",
                                           lease_ttl_s=BLOCK_LEASE_TTL_S, drain_timeout_s=DRAIN_TIMEOUT_S)
    return kv


def start_prefill(hosts: EtcdHosts, name: str, host: nh.Host) -> Served:
    return start_vllm(name, host, hosts.model, hosts.logs, 0,
                      etcd_kv_config("kv_producer", hosts.events, host, hosts.etcd, name), env_extra=hosts.lent)


def start_decode(hosts: EtcdHosts, name: str, host: nh.Host) -> Served:
    # vLLM's default --shutdown-timeout 0 force-kills the workers at SIGTERM, before their connector can leave
    return start_vllm(name, host, hosts.model, hosts.logs, 1,
                      etcd_kv_config("kv_consumer", hosts.events, host, hosts.etcd, "d0"), env_extra=hosts.lent,
                      extra_args=("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)))


def wait_until_ready(front: nh.Host, servers: list[Served], timeout_s: float) -> None:
    """Each vLLM server answers /health; the proxy's /health is 200 once it routes a P and a D it can reach."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        proxy_port = {"proxy": PROXY_PORT, "static-proxy": STATIC_PROXY_PORT}.get(server.name)
        url = server.url if proxy_port is None else f"{front.address}:{proxy_port}"
        while http(front, "get", url, "/health", timeout_s=5).get("status") != 200:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited while starting:\n{server.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{server.name} not ready after {timeout_s:.0f} s:\n{server.tail()}")
            time.sleep(3)


def stop(server: Served) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, signal.SIGTERM)  # its own process group: its engine and workers too


@pytest.fixture(scope="module")
def etcd_hosts(swept: list[str], vllm_single: vh.VLLMServer,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdHosts]:
    vh.require_vllm()
    model = vh.build_tiny_model(vh.MODEL_CACHE)
    logs = tmp_path_factory.mktemp("vllm-etcd")
    events = logs / "events"
    lent = lend_etcd_client(logs)
    with nh.cluster() as cluster:
        etcd_host, p_host, d_host = cluster.add_host("etcd"), cluster.add_host("p"), cluster.add_host("d")
        front = cluster.add_host("front")
        etcd = eh.EtcdServer(logs / "etcd", host=etcd_host)
        etcd.start()
        proxy_log = logs / "proxy.log"
        proxy = Served("proxy", front, front.popen(
            [sys.executable, "-m", "kvlifecycle", "proxy", "--host", front.address, "--port", str(PROXY_PORT),
             "--etcd", etcd.endpoint, "--etcd-cluster", CLUSTER], env=None, log=proxy_log), proxy_log)
        hosts = EtcdHosts(proxy, proxy, vllm_single, proxy, front, etcd, events, cluster, model, logs, lent)
        hosts.prefill, hosts.decode = start_prefill(hosts, "p0", p_host), start_decode(hosts, "decode", d_host)
        static_log = logs / "static-proxy.log"
        static_proxy = Served("static-proxy", front, front.popen(  # given P and D on its command line
            [sys.executable, "-m", "kvlifecycle", "proxy", "--host", front.address, "--port", str(STATIC_PROXY_PORT),
             "--prefill", hosts.prefill.url, "--decode", hosts.decode.url], env=None, log=static_log), static_log)
        servers = [hosts.prefill, hosts.decode, proxy, static_proxy]
        try:
            started = time.monotonic()
            wait_until_ready(front, servers, START_TIMEOUT_S)
            print(f"\nP and D up and both instances routed through etcd in "
                  f"{time.monotonic() - started:.0f} s")
            yield hosts
        finally:
            servers += hosts.started
            for server in reversed(servers):
                stop(server)
            for server in servers:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    server.proc.wait(30)
            etcd.close()


def doctor(hosts: EtcdHosts) -> dict:
    out = hosts.front.run([sys.executable, "-m", "kvlifecycle", "doctor", "--etcd", hosts.etcd.endpoint,
                           "--etcd-cluster", CLUSTER, "--etcd-timeout", "2", "--json"], timeout_s=90)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def proxy_health(hosts: EtcdHosts) -> dict:
    answer = http(hosts.front, "get", f"{hosts.front.address}:{PROXY_PORT}", "/health", timeout_s=10)
    assert isinstance(answer.get("body"), dict), answer
    return answer


@pytest.mark.parametrize(("proxy_port", "num_tokens"), [(PROXY_PORT, 5), (PROXY_PORT, 300), (STATIC_PROXY_PORT, 64)],
                         ids=["etcd-5", "etcd-300", "static-64"])
def test_output_through_a_proxy_across_hosts_equals_a_single_instance(etcd_hosts: EtcdHosts, proxy_port: int,
                                                                      num_tokens: int) -> None:
    """Through the proxy that reads etcd, and through the one given P and D on its command line."""
    prompt = vh.prompt_of_length(num_tokens, offset=700 + num_tokens)
    text = reference(etcd_hosts, prompt)
    got = http(etcd_hosts.front, "stream", f"{etcd_hosts.front.address}:{proxy_port}", "/v1/completions",
               vh.completion_body(prompt, MAX_TOKENS, stream=True))
    assert got["status"] == 200, got
    assert got["text"] == text
    assert len(text.split()) == MAX_TOKENS
    if proxy_port == PROXY_PORT:
        health = proxy_health(etcd_hosts)["body"]  # routed from etcd alone: the proxy was given no server
        assert health == {"prefill": {etcd_hosts.prefill.url: True}, "decode": {etcd_hosts.decode.url: True}}


def test_doctor_lists_both_instances_with_their_api_and_agent_epoch(etcd_hosts: EtcdHosts) -> None:
    report = doctor(etcd_hosts)
    rows = {(r["role"], r["instance"], r["dp"], r["tp"]): r for r in report["registrations"]}
    assert set(rows) == {("prefill", "p0", 0, 0), ("decode", "d0", 0, 0)}, report
    p0, d0 = rows[("prefill", "p0", 0, 0)], rows[("decode", "d0", 0, 0)]
    assert p0["address"] == f"tcp://{etcd_hosts.prefill.host.address}:{SIDE_CHANNEL_PORT}"
    assert (p0["api"], d0["api"]) == (etcd_hosts.prefill.url, etcd_hosts.decode.url)
    assert p0["epoch"] > 0 and d0["epoch"] > 0 and p0["agent"] != d0["agent"]
    assert (p0["state"], d0["state"]) == ("serving", "serving")
    assert 0 < p0["ttl_left_s"] <= LEASE_TTL_S
    assert report["findings"] == []


def test_decode_on_its_host_really_uses_the_kv_from_the_prefill_host(etcd_hosts: EtcdHosts) -> None:
    """D gets prompt B with the params of prompt A (same length, same last token): it answers A's continuation,
    which it can only know from the KV it read from P's host."""
    n = 96
    prompt_a = vh.prompt_of_length(n, offset=5)
    words_b = vh.prompt_of_length(n, offset=2222).split()
    words_b[-1] = prompt_a.split()[-1]
    prompt_b = " ".join(words_b)
    ref_a, ref_b = reference(etcd_hosts, prompt_a), reference(etcd_hosts, prompt_b)
    assert ref_a != ref_b
    prefill = http(etcd_hosts.front, "post", etcd_hosts.prefill.url, "/v1/completions",
                   vh.completion_body(prompt_a, 1, kv_transfer_params={"do_remote_decode": True}))
    assert prefill["status"] == 200, prefill
    params = prefill["body"]["kv_transfer_params"]
    assert params["remote_host"] == etcd_hosts.prefill.host.address, params
    answer = http(etcd_hosts.front, "post", etcd_hosts.decode.url, "/v1/completions",
                  vh.completion_body(prompt_b, MAX_TOKENS, kv_transfer_params=params))
    assert answer["status"] == 200, answer
    assert answer["body"]["choices"][0]["text"] == ref_a


def test_both_hosts_event_logs_replay_clean(etcd_hosts: EtcdHosts) -> None:
    dirs = vh.event_dirs(etcd_hosts.events, "source") + vh.event_dirs(etcd_hosts.events, "target")
    assert len(dirs) >= 2, dirs
    rc, report = vh.replay_json(*dirs)
    assert rc == 0, report.get("violations", report)


def source_events(hosts: EtcdHosts, engine: str) -> list[ev.Event]:
    """The events P ``engine``'s ledger has logged so far (its log is live: a torn tail is left out)."""
    out: list[ev.Event] = []
    for directory in sorted(hosts.events.glob(f"source-{engine}-tp0-*")):
        with contextlib.suppress(LogError):
            out += read_events(directory)
    return out


def grants(events: list[ev.Event]) -> list[ev.SrcGranted]:
    return [e for e in events if isinstance(e, ev.SrcGranted)]


def releases(events: list[ev.Event]) -> dict[str, str]:
    """transfer -> the reason its lease ended."""
    return {e.transfer: e.reason for e in events if isinstance(e, ev.SrcLeaseReleased)}


def wait_for(predicate: Callable[[], object], timeout_s: float, poll_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def client(hosts: EtcdHosts, name: str, verb: str, address: str, body: dict) -> tuple[subprocess.Popen[bytes], Path]:
    """One request from the front host in the background; its answer is the last line of the returned log."""
    host, port = address.rsplit(":", 1)
    log = hosts.logs / f"{name}.out"
    proc = hosts.front.popen([sys.executable, str(HERE / "netns_http.py"), verb, host, port, "/v1/completions",
                              json.dumps(body), "400"], log=log)
    return proc, log


def answer_of(proc: subprocess.Popen[bytes], log: Path) -> dict:
    proc.wait(450)
    return json.loads(log.read_text().strip().splitlines()[-1])


def registered(hosts: EtcdHosts, role: str) -> list[dict]:
    return [r for r in doctor(hosts)["registrations"] if r["role"] == role]


def test_a_drained_p_finishes_its_requests_in_flight_leaves_and_a_new_p_gets_the_traffic(
        etcd_hosts: EtcdHosts) -> None:
    """Scale-in on demand with one P: ``kvlifecycle drain`` while three requests are in flight through the proxy
    (their KV still on its way to D over P's slowed link). None fails; new requests get the proxy's 503 at once;
    P leaves etcd once its leases ended (alive: it drained, it did not die); a P started afterwards gets the
    traffic. P0 is stopped after this one; P1 serves the tests that follow."""
    hosts = etcd_hosts
    p0 = hosts.prefill
    prompts = [vh.prompt_of_length(600, offset=900 + 37 * i) for i in range(3)]
    expected = [reference(hosts, prompt) for prompt in prompts]
    before = len(grants(source_events(hosts, "p0")))
    shape(p0.host, "2mbit", exempt=hosts.etcd.address)  # each request's 2.4 MB of KV takes seconds to reach D
    try:
        inflight = [client(hosts, f"drain-client-{i}", "stream", f"{hosts.front.address}:{PROXY_PORT}",
                           vh.completion_body(prompt, MAX_TOKENS, stream=True)) for i, prompt in enumerate(prompts)]
        # all three routed to P0 and granted: they are in flight, D reading their KV
        assert wait_for(lambda: len(grants(source_events(hosts, "p0"))) >= before + 3, 240), p0.tail()
        events = source_events(hosts, "p0")
        ours = [g.transfer for g in grants(events)[before:]]
        live_at_order = [t for t in ours if t not in releases(events)]
        out = hosts.front.run([sys.executable, "-m", "kvlifecycle", "drain", "--etcd", hosts.etcd.endpoint,
                               "--etcd-cluster", CLUSTER, "--instance", "p0", "--json"], timeout_s=60)
        ordered = time.monotonic()
        assert out.returncode == 0, out.stdout + out.stderr
        assert json.loads(out.stdout)["draining"] == [f"/kvlifecycle/v1/{CLUSTER}/prefill/p0/0/0"]
        assert live_at_order, "the drain came after every lease had ended: nothing was in flight"
        # the proxy routes nothing new to a draining P: a new request gets a clear 503 at once
        assert wait_for(lambda: proxy_health(hosts)["body"]["prefill"] == {}, 30)
        late = http(hosts.front, "post", f"{hosts.front.address}:{PROXY_PORT}", "/v1/completions",
                    vh.completion_body("while p0 drains", 4))
        assert late["status"] == 503 and "no prefill server registered" in json.dumps(late["body"]), late
        answers = [answer_of(*c) for c in inflight]
    finally:
        shape(p0.host, None)
    assert [a["status"] for a in answers] == [200, 200, 200], answers  # none of the in-flight requests failed
    assert [a["text"] for a in answers] == expected
    line = f"/kvlifecycle/v1/{CLUSTER}/prefill/p0/0/0 drained: 0 lease(s) left"
    assert wait_for(lambda: line in p0.tail(400), DRAIN_TIMEOUT_S), p0.tail(60)
    print(f"\nkvlifecycle drain with {len(live_at_order)} of 3 leases live: all 3 answered, P0 had left etcd "
          f"{time.monotonic() - ordered:.1f} s after the order (polled once the answers were in)")
    assert "a drain was ordered through etcd" in p0.tail(400)
    assert p0.proc.poll() is None  # P0 left etcd by draining, not by dying
    assert registered(hosts, "prefill") == []
    ended = releases(source_events(hosts, "p0"))
    assert [ended.get(t) for t in ours] == ["completed"] * 3, ended
    stop(p0)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p0.proc.wait(30)
    # scale-out: a new P host joins and gets the traffic
    p1 = start_prefill(hosts, "p1", hosts.cluster.add_host("p1"))
    hosts.started.append(p1)
    wait_until_ready(hosts.front, [p1, hosts.proxy], START_TIMEOUT_S)
    assert proxy_health(hosts)["body"]["prefill"] == {p1.url: True}
    got = http(hosts.front, "stream", f"{hosts.front.address}:{PROXY_PORT}", "/v1/completions",
               vh.completion_body(prompts[0], MAX_TOKENS, stream=True))
    assert got["status"] == 200 and got["text"] == expected[0], got
    assert len(grants(source_events(hosts, "p1"))) == 1  # P1 prefilled it
    hosts.prefill = p1


def test_a_d_killed_mid_load_loses_its_leases_on_p_through_etcd_long_before_their_ttl(
        etcd_hosts: EtcdHosts) -> None:
    """D is SIGKILLed while it reads a request's KV from P (P's link slowed, D's claim seen in P's log). P's vLLM
    watches the decode keys: the lease ends as ``peer_restarted`` once D's etcd key goes, not at its 300 s TTL,
    and P's next step gives vLLM the blocks back. D is restarted for the tests that follow."""
    hosts = etcd_hosts
    p = hosts.prefill
    [d_row] = registered(hosts, "decode")
    prompt = vh.prompt_of_length(1500, offset=3100)
    before = len(grants(source_events(hosts, p.name)))
    prefill = http(hosts.front, "post", p.url, "/v1/completions",
                   vh.completion_body(prompt, 1, kv_transfer_params={"do_remote_decode": True}))
    assert prefill["status"] == 200, prefill
    [orphan] = grants(source_events(hosts, p.name))[before:]
    shape(p.host, "1mbit", exempt=hosts.etcd.address)  # D's read of the 6 MB takes about a minute
    try:
        params = prefill["body"]["kv_transfer_params"]
        reader = client(hosts, "orphan-client", "post", hosts.decode.url,
                        vh.completion_body(prompt, MAX_TOKENS, kv_transfer_params=params))

        def claimed() -> bool:
            return any(isinstance(e, ev.SrcLeaseRenewed) and e.transfer == orphan.transfer and e.claims
                       and e.peer == d_row["agent"] for e in source_events(hosts, p.name))

        assert wait_for(claimed, 120), hosts.decode.tail()
        assert orphan.transfer not in releases(source_events(hosts, p.name))  # mid-load
        os.killpg(hosts.decode.proc.pid, signal.SIGKILL)
        killed = time.time()
        assert wait_for(lambda: orphan.transfer in releases(source_events(hosts, p.name)), 4 * LEASE_TTL_S + 20)
        ended_after_s = time.time() - killed
        reader[0].wait(60)
    finally:
        shape(p.host, None)
    assert releases(source_events(hosts, p.name))[orphan.transfer] == "peer_restarted"  # not "expired"
    line = f"D {d_row['agent']} (epoch {d_row['epoch']}) lost: released 1 lease(s) bound to it"
    assert line in p.tail(400), p.tail(60)
    print(f"\nvLLM D SIGKILLed mid-load: P's lease (TTL {BLOCK_LEASE_TTL_S} s) ended {ended_after_s:.1f} s later, "
          f"through etcd (etcd lease TTL {LEASE_TTL_S} s)")
    decode = start_decode(hosts, "decode-2", hosts.decode.host)
    hosts.started.append(decode)
    hosts.decode = decode
    wait_until_ready(hosts.front, [decode, hosts.proxy], START_TIMEOUT_S)
    got = http(hosts.front, "stream", f"{hosts.front.address}:{PROXY_PORT}", "/v1/completions",
               vh.completion_body(prompt, MAX_TOKENS, stream=True))
    assert got["status"] == 200 and got["text"] == reference(hosts, prompt), got
    def freed() -> bool:
        return any(isinstance(e, ev.SrcFreed) and e.request == orphan.request for e in source_events(hosts, p.name))

    assert wait_for(freed, 30), "vLLM never got the orphan's blocks back"


def test_a_killed_p_leaves_the_routes_and_d_invalidates_it(etcd_hosts: EtcdHosts) -> None:
    """P stays dead after this one."""
    agent = next(r["agent"] for r in doctor(etcd_hosts)["registrations"] if r["role"] == "prefill")
    os.killpg(etcd_hosts.prefill.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    deadline = killed + UNROUTE_BOUND_S
    while proxy_health(etcd_hosts)["body"]["prefill"] and time.monotonic() < deadline:
        time.sleep(0.2)
    unrouted_s = time.monotonic() - killed
    health = proxy_health(etcd_hosts)
    assert health["body"]["prefill"] == {} and health["status"] == 503, health
    print(f"\nvLLM P killed: out of the proxy's routes {unrouted_s:.1f} s later (etcd lease TTL {LEASE_TTL_S} s)")
    assert [r["instance"] for r in doctor(etcd_hosts)["registrations"]] == ["d0"]
    answer = http(etcd_hosts.front, "post", f"{etcd_hosts.front.address}:{PROXY_PORT}", "/v1/completions",
                  vh.completion_body("after P died", 4))
    assert answer["status"] == 503 and "no prefill server registered" in json.dumps(answer["body"]), answer
    deadline = time.monotonic() + 30
    while f"peer {agent}" not in etcd_hosts.decode.tail(400) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"peer {agent} (epoch <=" in etcd_hosts.decode.tail(400)  # Consumer.invalidate_peer's line
    assert "invalidated (etcd lease gone)" in etcd_hosts.decode.tail(400)


def test_a_stopped_d_leaves_etcd_on_its_way_out(etcd_hosts: EtcdHosts) -> None:
    """Runs last. SIGTERM to D's API server, as an operator stops it: vLLM shuts its worker down (given a
    --shutdown-timeout), whose connector deletes D's key instead of leaving it to the lease."""
    os.kill(etcd_hosts.decode.proc.pid, signal.SIGTERM)
    line = f"KVLifecycleConnector: /kvlifecycle/v1/{CLUSTER}/decode/d0/0/0 left etcd"
    deadline = time.monotonic() + 60
    while line not in etcd_hosts.decode.tail(200) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert line in etcd_hosts.decode.tail(200)
    assert doctor(etcd_hosts)["registrations"] == []
