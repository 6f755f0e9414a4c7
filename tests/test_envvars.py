"""Every environment variable is in the registry, the docs table is generated from it, and modules read through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvlifecycle import envvars

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("kvlifecycle", "transports", "adapters", "tests", "bench", "scripts", ".ci", "docs")
SUFFIXES = {".py", ".sh", ".md", ""}
# names that look like variables and are not: the compiled post's C macros (transports/_native_post.c)
NOT_VARIABLES = {"KVL_MAX_PARAMS", "KVL_MAX_KERNELS"}
# modules that read their variables themselves, once, into an options object
READ_DIRECTLY = {
    "transports/cuda_ipc/options.py": "the CUDA IPC transport reads KVL_CUDA_IPC_* into its options",
}
NAME = re.compile(r"\b(?:KVL|KVLIFECYCLE)_[A-Z0-9_]*[A-Z0-9]\b")
DIRECT_READ = re.compile(
    r"""(?:environ(?:\.get|\.pop|\.setdefault)?\(|environ\[|getenv\()\s*["']((?:KVL|KVLIFECYCLE)_\w+)"""
)


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for top in SCANNED:
        out += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in SUFFIXES and ".venv" not in p.parts]
    return out


def test_the_docs_table_is_generated_from_the_registry() -> None:
    doc = ROOT / "docs" / "configuration.md"
    assert doc.read_text() == envvars.markdown_table(), (
        "docs/configuration.md is stale: run `python -m kvlifecycle.envvars > docs/configuration.md`"
    )


def test_every_variable_named_anywhere_is_in_the_registry() -> None:
    known = envvars.known_names()
    unlisted: dict[str, set[str]] = {}
    for path in _files():
        for name in set(NAME.findall(path.read_text(errors="replace"))) - known - NOT_VARIABLES:
            unlisted.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert unlisted == {}, f"add these to kvlifecycle/envvars.py: {unlisted}"


def test_one_prefix_old_names_only_as_deprecated_aliases() -> None:
    deprecated = {old for v in envvars.REGISTRY.values() for old in v.deprecated}
    assert all(name.startswith("KVL_") for name in envvars.REGISTRY)
    assert all(not name.startswith("KVL_") for name in deprecated)
    code = [p for p in _files() if p.suffix in (".py", ".sh") and p.name != "envvars.py"]
    users = {str(p.relative_to(ROOT)) for p in code if deprecated & set(NAME.findall(p.read_text()))}
    assert users <= {"tests/test_envvars.py"}, f"still using a deprecated name: {users}"


def test_modules_read_kvl_variables_through_the_registry() -> None:
    direct: dict[str, list[str]] = {}
    for top in ("kvlifecycle", "transports", "adapters"):  # the installed package (scripts read the shell's)
        for path in (ROOT / top).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            if rel in READ_DIRECTLY or rel == "kvlifecycle/envvars.py":
                continue
            found = DIRECT_READ.findall(path.read_text())
            if found:
                direct[rel] = found
    assert direct == {}, f"read these through kvlifecycle.envvars: {direct}"


def test_a_deprecated_name_is_still_read_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(envvars, "_warned", set())
    env = {"KVLIFECYCLE_LOG": "json:debug"}
    with pytest.warns(FutureWarning, match=r"\$KVLIFECYCLE_LOG is deprecated: set \$KVL_LOG instead"):
        assert envvars.LOG.read(env) == "json:debug"
    assert envvars.LOG.read({**env, "KVL_LOG": "console"}) == "console"  # the new name wins


def test_logging_setup_honours_the_old_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import logging

    from kvlifecycle import logs

    monkeypatch.setattr(envvars, "_warned", set())
    monkeypatch.delenv("KVL_LOG", raising=False)
    monkeypatch.setenv("KVLIFECYCLE_LOG", "json:debug")
    with pytest.warns(FutureWarning):
        handler = logs.configure(stream=io.StringIO())
    try:
        assert logging.getLogger(logs.LOGGER_NAME).level == logging.DEBUG
    finally:
        logs.unconfigure()
    assert handler is not None


def test_a_fallback_name_is_read_silently(recwarn: pytest.WarningsRecorder) -> None:
    assert envvars.SIDE_CHANNEL_PORT.read({"VLLM_NIXL_SIDE_CHANNEL_PORT": "6100"}) == 6100
    assert envvars.SIDE_CHANNEL_PORT.read({"VLLM_NIXL_SIDE_CHANNEL_PORT": "6100", "KVL_SIDE_CHANNEL_PORT": "7"}) == 7
    assert not [w for w in recwarn if issubclass(w.category, FutureWarning)]


@pytest.mark.parametrize(
    ("var", "text", "message"),
    [
        (envvars.SIDE_CHANNEL_PORT, "57OO", r"\$KVL_SIDE_CHANNEL_PORT='57OO'"),
        (envvars.NATIVE_POST, "nope", r"\$KVL_NATIVE_POST='nope': expected 1/0"),
        (envvars.SGLANG_HEARTBEAT_S, "1s", r"\$KVL_SGLANG_HEARTBEAT_S='1s'"),
    ],
)
def test_a_malformed_value_is_refused_naming_the_variable(var: envvars.EnvVar[object], text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        var.read({var.name: text})


def test_unset_or_empty_reads_the_default() -> None:
    assert envvars.NATIVE_POST.read({}) is True
    assert envvars.NATIVE_POST.read({"KVL_NATIVE_POST": ""}) is True
    assert envvars.NATIVE_POST.read({"KVL_NATIVE_POST": "0"}) is False
    assert envvars.LOG_DIR.read({"KVL_LOG_DIR": "/tmp/x"}) == Path("/tmp/x")


def test_a_variable_outside_the_prefix_cannot_be_declared() -> None:
    with pytest.raises(ValueError, match="starts with KVL_"):
        envvars.EnvVar("KVLIFECYCLE" + "_NEW", str, None, "doc", ("x",))
