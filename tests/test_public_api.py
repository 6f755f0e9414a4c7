"""``kvlifecycle`` exports what an embedder uses, each name importable without torch, NIXL or an engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hidden_modules import env_hiding

import kvlifecycle

HEAVY = ("torch", "nixl", "vllm", "sglang", "triton")
EMBEDDER_NEEDS = {
    "ledgers": {"SourceLedger", "TargetLedger", "open_ledger", "Grant", "Released", "LedgerError", "EventLog"},
    "handoff": {"Producer", "Consumer", "HandoffOptions", "CompatInfo"},
    "transport": {"Transport", "KVLayout", "BlockView", "MemoryKind", "XferOp", "XferStatus", "Notification",
                  "TransportError"},
    "instrumentation": {"instrument", "instrument_to_files", "instrument_from_env", "Instrumentation"},
    "logging": {"configure_logging", "unconfigure_logging", "log_events"},
    "closed sets": {"Side", "LoadFailurePolicy", "TransferMode", "FsyncMode"},
}

PROBE = """
import json, sys
import kvlifecycle
failed = {}
for name in kvlifecycle.__all__:
    try:
        getattr(kvlifecycle, name)
    except Exception as exc:
        failed[name] = f"{type(exc).__name__}: {exc}"
heavy = sorted(m for m in sys.modules if m.split(".")[0] in %r or m.startswith(("kvlifecycle.transports",
                                                                                   "kvlifecycle.adapters")))
print(json.dumps({"failed": failed, "heavy": heavy}))
"""


def test_every_export_imports_without_torch_or_nixl(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PROBE % (HEAVY,)], capture_output=True, text=True, timeout=120,
                         env=env_hiding(tmp_path, *HEAVY), check=True, cwd=tmp_path)
    result = json.loads(out.stdout)
    assert result == {"failed": {}, "heavy": []}


def test_the_exports_cover_what_an_embedder_uses() -> None:
    exported = set(kvlifecycle.__all__)
    missing = {area: names - exported for area, names in EMBEDDER_NEEDS.items() if names - exported}
    assert missing == {}
    assert len(kvlifecycle.__all__) == len(exported)
    assert exported <= set(dir(kvlifecycle))


def test_a_lazy_export_is_the_object_of_its_module() -> None:
    from kvlifecycle import handoff, logs, telemetry

    assert kvlifecycle.Producer is handoff.Producer
    assert kvlifecycle.configure_logging is logs.configure
    assert kvlifecycle.instrument is telemetry.instrument
    try:
        kvlifecycle.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("an unknown attribute must raise AttributeError")
