"""The real-vLLM test harness itself, without vLLM: a server stays in the test's session (one scheduler autogroup)
in a process group of its own, and a failed test's report carries the connector's lines of the servers' logs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import vllm_harness as h

DECODE_LOG = """\
(APIServer pid=1) INFO 12-04 06:41:40 [async_llm.py:578] Added request cmpl-kvl-1-0-bfafbc20.
(Worker_TP1 pid=3) WARNING 12-04 06:42:26 [worker.py:547] request r: no grant from tcp://127.0.0.1:1 yet (x)
(Worker_TP1 pid=3) WARNING 12-04 06:32:40 [cpu_worker.py:114] libtcmalloc is not found in LD_PRELOAD.
(APIServer pid=1) ERROR 12-04 06:42:26 [serving.py:203] Request cmpl-kvl-1 failed with an internal error
"""


def test_the_digest_keeps_the_connector_lines_of_logs_written_since_the_test_began(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    fresh = h.ManagedProcess(name="decode", argv=[], env={}, log_path=tmp_path / "decode.log")
    stale = h.ManagedProcess(name="single", argv=[], env={}, log_path=tmp_path / "single.log")
    fresh.log_path.write_text(DECODE_LOG)
    stale.log_path.write_text("(Worker pid=9) WARNING 12-04 06:00:00 [worker.py:1] an older test's line\n")
    os.utime(stale.log_path, (1_000.0, 1_000.0))
    monkeypatch.setattr(h, "started_processes", [stale, fresh])
    digest = h.failure_digest(since=2_000.0).splitlines()
    assert digest == ["decode: (Worker_TP1 pid=3) WARNING 12-04 06:42:26 [worker.py:547] request r: no grant from "
                      "tcp://127.0.0.1:1 yet (x)",
                      "decode: (APIServer pid=1) ERROR 12-04 06:42:26 [serving.py:203] Request cmpl-kvl-1 failed "
                      "with an internal error"]
    assert h.failure_digest(since=2_000.0, max_lines=1).splitlines() == digest[-1:]


def test_a_server_gets_its_own_process_group_in_the_tests_session(tmp_path: Path, monkeypatch) -> None:
    """Its own group, so that ``stop`` and ``kill`` reach its engine and workers; the test's session, so the test's
    scheduler autogroup: a session of its own starved the other server on shared cores (ManagedProcess says how)."""
    monkeypatch.setattr(h, "started_processes", [])
    child = h.ManagedProcess(name="sleeper", argv=[sys.executable, "-c", "import time; time.sleep(60)"],
                             env=dict(os.environ), log_path=tmp_path / "sleeper.log").start()
    try:
        assert child.proc is not None
        assert os.getpgid(child.proc.pid) == child.proc.pid != os.getpgid(0)
        assert os.getsid(child.proc.pid) == os.getsid(0)
        assert h.started_processes == [child]  # what a failed test digests
    finally:
        child.stop(timeout_s=10)
    assert not child.alive
