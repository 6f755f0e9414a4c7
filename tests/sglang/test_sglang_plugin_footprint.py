"""Registering the SGLang plugin adds the one backend name and changes nothing else observable: SGLang's other
backends, the classes its lookup returns for each, and its CLI choices are the same before and after, apart from
``kvlifecycle``. Real SGLang, in its environment: one process without the plugin, one that loads it as SGLang's
processes do (before the disaggregation modules are imported: the hook is installed at their import)."""

from __future__ import annotations

import json
import subprocess

import sglang_harness as h

PROBE = r"""
import json, sys
if sys.argv[1] == "with-plugin":
    from sglang.srt.plugins import load_plugins
    load_plugins()
from sglang.srt.arg_groups import choices
from sglang.srt.disaggregation import utils
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend

def lookup(backend, kind):
    try:
        cls = utils.get_kv_class(backend, kind)
    except Exception as exc:  # what SGLang says for a backend without that class is part of its behaviour
        return f"{type(exc).__name__}: {exc}"
    return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"

def snapshot():
    members = {m.name: m.value for m in TransferBackend}
    classes = {f"{m.value}/{k.name}": lookup(m, k) for m in TransferBackend for k in KVClassType}
    return {"members": members, "classes": classes, "choices": list(choices.DISAGG_TRANSFER_BACKEND_CHOICES),
}

print(json.dumps(snapshot()))
"""


def test_register_adds_one_backend_name_and_changes_nothing_else() -> None:
    h.require_sglang()
    runs = {}
    for mode, plugins in (("without-plugin", "none_installed"), ("with-plugin", "kvlifecycle")):
        env = {**h.base_env(), "SGLANG_PLUGINS": plugins}
        done = subprocess.run([str(h.SGLANG_PY), "-c", PROBE, mode], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[mode] = json.loads(done.stdout.splitlines()[-1])
    before, after = runs["without-plugin"], runs["with-plugin"]
    assert "kvlifecycle" not in before["choices"] and "kvlifecycle" not in before["members"].values()
    added = {k: v for k, v in after["members"].items() if k not in before["members"]}
    assert added == {"KVLIFECYCLE": "kvlifecycle"}
    assert {k: after["members"][k] for k in before["members"]} == before["members"]
    assert after["choices"] == [*before["choices"], "kvlifecycle"] or \
        sorted(after["choices"]) == sorted([*before["choices"], "kvlifecycle"])
    assert {k: after["classes"][k] for k in before["classes"]} == before["classes"]
    new = {k: v for k, v in after["classes"].items() if k not in before["classes"]}
    assert new and all(k.startswith("kvlifecycle/") for k in new)
    assert new["kvlifecycle/MANAGER"].startswith("kvlifecycle.adapters.sglang")
