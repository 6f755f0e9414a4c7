"""``kvlifecycle explain``: each planted fault (an event sequence the real ledgers wrote through the real log writer)
is named with its cause, its chain and one sentence; logs where everything ended report nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from debug_scenarios import SCENARIOS, Pair
from test_timeline import write_logs

from kvlifecycle.cli import main
from kvlifecycle.explain import (
    COMPLETED_AFTER_RELEASE,
    IN_FLIGHT,
    LOAD_NEVER_COMPLETED,
    PINNED_PAST_LEASE,
    READ_AFTER_RELEASE,
    READ_OUTLIVED_LEASE,
    RELEASED_UNDER_READER,
    REQUEST_DID_NOT_END,
    explain_logs,
)
from kvlifecycle.ledger import open_ledger


def chain_of(finding) -> list[tuple[str, str]]:
    return [(s.worker, s.label) for s in finding.chain]


@pytest.mark.parametrize("scenario", ["clean", "cancelled", "peer_restart"])
def test_nothing_to_explain_when_everything_ended(tmp_path: Path, scenario: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    SCENARIOS[scenario](tmp_path)
    assert explain_logs([tmp_path])[1] == []
    assert main(["explain", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("nothing to explain in")


def test_a_recompute_is_no_finding_an_expiry_under_a_read_is(tmp_path: Path) -> None:
    """A failed load that fell back to recompute is handled as designed; a lease P expired while D's read under it
    ran on (D failed the load only after hearing of the expiry) is a read that outlived its lease."""
    write_logs(tmp_path)
    (finding,) = explain_logs([tmp_path])[1]
    assert finding.rule == READ_OUTLIVED_LEASE and finding.request == "req-c" and finding.worker == "p0"
    assert "its load failed (source lease expired)" in finding.sentence


def test_freed_while_a_transfer_reads(tmp_path: Path) -> None:
    SCENARIOS["freed_under_reader"](tmp_path)
    _, (finding,) = explain_logs([tmp_path])
    assert finding.rule == RELEASED_UNDER_READER and finding.request == "req-5" and finding.worker == "p0"
    assert finding.sentence.startswith("blocks 12-14 of req-5 were freed at +4.000 ms on p0 while transfer ")
    assert f"transfer {finding.transfer} (generation 1) of d0 was still reading them" in finding.sentence
    assert finding.sentence.endswith("its load completed 5.0 ms later and p0 refused its consumer_done")
    assert chain_of(finding) == [("p0", "grant"), ("d0", "load start"), ("p0", "release"), ("p0", "free"),
                                 ("d0", "part done"), ("p0", "refused consumer_done")]


def test_completed_from_blocks_reused_after_an_expiry(tmp_path: Path) -> None:
    SCENARIOS["lease_expiry"](tmp_path)
    _, (finding,) = explain_logs([tmp_path])
    assert finding.rule == COMPLETED_AFTER_RELEASE and finding.request == "req-3"
    assert "blocks 17-18 of req-3 were freed at +28.000 ms on p0" in finding.sentence
    assert "(its lease ended: expired), and given to req-4 at +29.000 ms" in finding.sentence
    assert finding.sentence.endswith("its load completed 5.0 ms later and p0 refused its consumer_done")
    assert [label for _, label in chain_of(finding)] == ["grant", "renew", "load start", "release", "free",
                                                         "allocate", "part done", "refused consumer_done"]


def test_load_never_completed(tmp_path: Path) -> None:
    SCENARIOS["load_never_completed"](tmp_path)
    _, (finding,) = explain_logs([tmp_path])  # P's lease is the same story: not a second finding
    assert finding.rule == LOAD_NEVER_COMPLETED and finding.worker == "d0" and finding.request == "req-8"
    assert "started at +3.000 ms and never completed: 1 of 2 part(s) done by the end of d0's log" in finding.sentence
    assert finding.sentence.endswith("p0 still holds its lease")
    assert ("d0", "load start") in chain_of(finding) and ("p0", "grant") in chain_of(finding)


def test_load_lost_when_d_restarted(tmp_path: Path) -> None:
    d = open_ledger("target", 8, str(tmp_path / "d"), worker="d0")
    d.reserve("r", [1, 2])
    d.start_load("r", "p0.t.1", generation=1, peer="p0")
    d.log.close()  # crash with the load in flight
    again = open_ledger("target", 8, str(tmp_path / "d"), worker="d0")
    again.reserve("s", [1, 2])
    again.cancel("s")
    again.log.close()
    _, (finding,) = explain_logs([tmp_path / "d"])
    assert finding.rule == LOAD_NEVER_COMPLETED and finding.request == "r"
    assert "0 of 1 part(s) done when d0 restarted at" in finding.sentence


def test_block_pinned_past_its_lease(tmp_path: Path) -> None:
    SCENARIOS["pinned_past_lease"](tmp_path)
    _, (finding,) = explain_logs([tmp_path])
    assert finding.rule == PINNED_PAST_LEASE and finding.request == "req-9" and finding.worker == "p0"
    assert finding.sentence.startswith(f"blocks 6-8 of req-9 are still pinned on p0 by lease {finding.transfer} "
                                       "(generation 1), which expired at +13.000 ms")
    assert "no sweep released it (its reader had settled)" in finding.sentence
    assert chain_of(finding) == [("p0", "grant"), ("p0", "renew"), ("d0", "load start"), ("d0", "part done")]


def test_read_after_release(tmp_path: Path) -> None:
    SCENARIOS["read_after_release"](tmp_path)
    _, findings = explain_logs([tmp_path])
    (finding,) = findings  # replay --check's read-after-release names the same transfer: reported once
    assert finding.rule == READ_AFTER_RELEASE and finding.worker == "d0"
    assert f"d0 started loading req-6's transfer {finding.transfer} (generation 1) at +14.000 ms, 1.0 ms after p0 " \
           "had released its lease (expired); p0 had freed blocks 20-21 at +13.000 ms" == finding.sentence


def test_a_request_that_did_not_end(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    g = pair.grant("req-1", [1, 2], [3, 4])
    pair.pull("req-1", g)
    pair.complete("req-1", g)  # handed off, and P frees it
    pair.p.allocate("req-2", [5])
    pair.p.prefill_done("req-2")  # granted never, freed never: stranded on P
    pair.d.reserve("req-3", [9])  # reserved, never loaded
    pair.close()
    _, findings = explain_logs([tmp_path])
    assert [(f.rule, f.worker, f.request) for f in findings] == [
        (REQUEST_DID_NOT_END, "p0", "req-2"), (REQUEST_DID_NOT_END, "d0", "req-3")]
    assert findings[0].sentence == ("req-2 still holds block 5 on p0 in READY since +7.000 ms (prefill done): "
                                    "prefill finished but no lease was granted and nothing freed them")
    assert findings[1].sentence.endswith("in RESERVED: no load was started (or, after a failed one, nothing filled "
                                         "them)")


@pytest.mark.parametrize("scenario", ["freed_under_reader", "lease_expiry", "load_never_completed",
                                      "pinned_past_lease", "read_after_release"])
def test_cli_exit_code_json_and_text(tmp_path: Path, scenario: str, capsys: pytest.CaptureFixture[str]) -> None:
    SCENARIOS[scenario](tmp_path)
    assert main(["explain", str(tmp_path), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and len(out["findings"]) == 1
    (view,) = out["findings"]
    assert view["chain"] and all(step["worker"] in ("p0", "d0") for step in view["chain"])
    assert main(["explain", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == f"1. [{view['rule']}] {view['sentence']}"
    chain_lines = [line for line in lines[3:] if line.lstrip().startswith("+")]
    assert len(chain_lines) == len(view["chain"])
    for line, step in zip(chain_lines, view["chain"], strict=True):
        assert line.split()[:3] == [f"+{step['t_ms']:.3f}", "ms", step["worker"]] and step["event"] in line


def test_explain_until_reports_the_open_load_as_in_flight(tmp_path: Path) -> None:
    """Until the completion arrives, the load is in flight: at that moment it is work in flight, not a fault."""
    SCENARIOS["clean"](tmp_path)
    _, found = explain_logs([tmp_path], until_offset_s=0.004)
    assert [f.rule for f in found] == [IN_FLIGHT]
    assert "was in flight" in found[0].sentence and "cut at +4.000 ms" in found[0].sentence


def test_explain_of_an_unreadable_log_is_one_line_and_exit_2(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvlifecycle explain: no event log")


def test_story_and_explain_are_core_modules_without_rich() -> None:
    """The logic is pure functions over events: no terminal library, no transport, no engine."""
    import subprocess
    import sys

    code = ("import sys, kvlifecycle.story, kvlifecycle.explain\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('rich', 'torch', 'nixl', 'vllm', 'sglang')"
            " or m.startswith(('kvlifecycle.transports', 'kvlifecycle.adapters', 'kvlifecycle.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_a_ledger_that_forgets_the_claim_is_caught(tmp_path: Path) -> None:
    """A mutant: the heartbeat no longer marks the lease claimed, so a cancel releases it under its reader. The
    ledger's own log stays well formed; explain names the release under the reader, with the claim in the chain."""
    from kvlifecycle import events as ev

    pair = Pair(tmp_path)
    renew = pair.p._handlers[ev.SrcLeaseRenewed]

    def renew_but_forget_the_claim(e: ev.SrcLeaseRenewed) -> None:
        renew(e)
        pair.p.leases[e.transfer].claimed = False

    pair.p._handlers[ev.SrcLeaseRenewed] = renew_but_forget_the_claim
    g = pair.grant("req-2", [3, 4], [7, 8])
    pair.pull("req-2", g)
    pair.ms(1)
    pair.p.cancel("req-2")  # the mutant releases at once
    pair.p.free("req-2")
    pair.ms(3)
    pair.d.part_done(g.transfer, 0)
    assert not pair.p.consumer_done(g.transfer, g.generation)  # refused: the lease is gone
    pair.d.finish("req-2")
    pair.close()
    _, (finding,) = explain_logs([tmp_path])
    assert finding.rule == RELEASED_UNDER_READER and finding.request == "req-2"
    assert ("p0", "renew") in chain_of(finding)  # D had claimed it: the release should have waited
