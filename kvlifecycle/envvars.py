"""Every environment variable kvlifecycle reads, in one registry: name, type, default, what it does, who reads it.

One prefix, ``KVL_``. Python code reads a variable through its entry here (``envvars.LOG_DIR.read()``), which
parses the value and refuses a malformed one naming the variable; scripts and the test harnesses read the same
names from the shell. ``docs/configuration.md`` is generated from this registry (``python -m kvlifecycle.envvars
> docs/configuration.md``) and ``tests/test_envvars.py`` checks that the table is in sync and that no file names
a ``KVL_`` variable the registry does not list.

A renamed variable keeps its old name as a deprecated alias: read when the new name is unset, with a one-line
warning the first time. A variable of the engine that means the same thing (vLLM's side-channel host and port,
SGLang's disaggregation timeouts and heartbeat) is honoured as a fallback, read without a warning: an operator's
engine settings stay the settings, and a ``KVL_`` variable only refines them.

Only the CUDA IPC transport reads its variables itself (``KVL_CUDA_IPC_*``, once, into its options object); they
are listed here all the same.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Generic, TypeVar

import attrs

T = TypeVar("T")

PREFIX = "KVL_"
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case)."""
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError(f"expected 1/0 (or true/false, yes/no, on/off), got {text!r}")


_TYPE_NAMES: dict[Callable[[str], object], str] = {
    str: "string",
    int: "integer",
    float: "number",
    parse_bool: "bool (1/0)",
    Path: "path",
}


def _kvl_name(instance: object, attribute: attrs.Attribute[str], name: str) -> None:
    if not name.startswith(PREFIX) or name != name.upper():
        raise ValueError(f"{name!r}: every kvlifecycle variable is upper case and starts with {PREFIX}")


@attrs.frozen
class EnvVar(Generic[T]):
    """One environment variable: ``parse`` turns its text into a value; unset (or empty) reads as ``default``."""

    name: str = attrs.field(validator=_kvl_name)
    parse: Callable[[str], T]
    default: T | None
    doc: str
    read_by: tuple[str, ...]
    default_doc: str = ""  # the default in words, where it is computed (e.g. "from the GPU's PCIe link")
    deprecated: tuple[str, ...] = ()  # former names, still read (with a warning) when this one is unset
    fallbacks: tuple[str, ...] = ()  # another project's variable with the same meaning, read silently

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES.get(self.parse, getattr(self.parse, "__name__", "string"))

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The text set for this variable (or a deprecated or fallback name of it); ``None`` when unset or empty."""
        env = os.environ if environ is None else environ
        value = env.get(self.name)
        if value:
            return value
        for old in self.deprecated:
            value = env.get(old)
            if value:
                _warn_deprecated(old, self.name)
                return value
        for other in self.fallbacks:
            value = env.get(other)
            if value:
                return value
        return None

    def read(self, environ: Mapping[str, str] | None = None) -> T | None:
        """The parsed value, or ``default``; a value that does not parse is a ``ValueError`` naming the variable."""
        text = self.raw(environ)
        if text is None:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"${self.name}={text!r}: {exc}") from None


_warned: set[str] = set()


def _warn_deprecated(old: str, new: str) -> None:
    if old not in _warned:
        _warned.add(old)
        warnings.warn(f"${old} is deprecated: set ${new} instead", FutureWarning, stacklevel=4)


def _var(name: str, parse: Callable[[str], T], default: T | None, doc: str, *read_by: str, default_doc: str = "",
         deprecated: tuple[str, ...] = (), fallbacks: tuple[str, ...] = ()) -> EnvVar[T]:
    return EnvVar(name, parse, default, doc, read_by, default_doc, deprecated, fallbacks)


# --- the library -------------------------------------------------------------------------------------------------
LOG = _var("KVL_LOG", str, None, "log format and level of `kvlifecycle.logs.configure`: `json`, `console`, "
           "`console:debug`, ...", "kvlifecycle.logs", default_doc="console, INFO", deprecated=("KVLIFECYCLE_LOG",))
OTEL_DIR = _var("KVL_OTEL_DIR", Path, None, "`instrument_from_env` writes OpenTelemetry spans and metrics as JSON "
                "lines here (needs `opentelemetry-sdk`); unset: the global providers", "kvlifecycle.telemetry",
                default_doc="unset", deprecated=("KVLIFECYCLE_OTEL_DIR",))

# --- the vLLM adapter --------------------------------------------------------------------------------------------
SIDE_CHANNEL_HOST = _var("KVL_SIDE_CHANNEL_HOST", str, None, "the host P's side channel binds and advertises "
                         "when the connector's `side_channel_host` option is not given", "kvlifecycle.adapters.vllm",
                         default_doc="127.0.0.1", fallbacks=("VLLM_NIXL_SIDE_CHANNEL_HOST",))
SIDE_CHANNEL_PORT = _var("KVL_SIDE_CHANNEL_PORT", int, None, "P's side-channel base port when the connector's "
                         "`side_channel_port` option is not given (+ DP index + TP rank)", "kvlifecycle.adapters.vllm",
                         default_doc="5700", fallbacks=("VLLM_NIXL_SIDE_CHANNEL_PORT",))
LOG_DIR = _var("KVL_LOG_DIR", Path, None, "event logs, one directory per ledger, when the connector's `log_dir` "
               "option is not given", "kvlifecycle.adapters.vllm", default_doc="no log")
ETCD_ENDPOINTS = _var("KVL_ETCD_ENDPOINTS", str, None, "etcd endpoints (`host:port,...`) where each worker registers "
                      "when the connector's `etcd_endpoints` option is not given", "kvlifecycle.adapters.vllm",
                      default_doc="no etcd")

# --- the SGLang adapter ------------------------------------------------------------------------------------------
SGLANG_HEARTBEAT_S = _var("KVL_SGLANG_HEARTBEAT_S", float, 1.0, "seconds between a decode's reads of each prefill's "
                          "epochs off its bootstrap server, and between its stream heartbeats to each prefill",
                          "kvlifecycle.adapters.sglang", fallbacks=("SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",))
SGLANG_PEER_TIMEOUT_S = _var("KVL_SGLANG_PEER_TIMEOUT_S", float, 10.0, "a prefill whose bootstrap server or stream "
                             "heartbeat answers are silent this long is dead: the decode's rooms on it fail; a "
                             "prefill ends the streams of a decode it has not heard this long (unset, where "
                             "`SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL` or "
                             "`SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE` is set: interval × failures, as SGLang "
                             "counts them)", "kvlifecycle.adapters.sglang")
SGLANG_CLAIM_TIMEOUT_S = _var("KVL_SGLANG_CLAIM_TIMEOUT_S", float, 120.0, "a prefill room no decode reserved for by "
                              "then fails; so does a decode receiver whose prefill never appeared",
                              "kvlifecycle.adapters.sglang", fallbacks=("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",))
SGLANG_SERVE_TIMEOUT_S = _var("KVL_SGLANG_SERVE_TIMEOUT_S", float, 300.0, "a reserved room the prefill has not "
                              "served by then fails on both sides", "kvlifecycle.adapters.sglang",
                              fallbacks=("SGLANG_DISAGGREGATION_WAITING_TIMEOUT",))
# SGLang's decode declares a prefill dead after this many failed heartbeats, each ``interval`` apart (at least 2 s
# and 1 failure, as SGLang clamps them); read only to derive the peer timeout.
_SGLANG_HEARTBEAT_INTERVAL = "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL"
_SGLANG_HEARTBEAT_MAX_FAILURE = "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE"


def sglang_peer_timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """``KVL_SGLANG_PEER_TIMEOUT_S``; unset, SGLang's own dead-prefill bound where the operator set either of its
    heartbeat variables (interval × max failures, defaults 5 s and 2, clamped to 2 s and 1 as SGLang does);
    else the registry's default."""
    env = os.environ if environ is None else environ
    own = SGLANG_PEER_TIMEOUT_S.raw(env)
    if own is not None or not (env.get(_SGLANG_HEARTBEAT_INTERVAL) or env.get(_SGLANG_HEARTBEAT_MAX_FAILURE)):
        return float(SGLANG_PEER_TIMEOUT_S.read(env) or 0.0)
    try:
        interval = float(env.get(_SGLANG_HEARTBEAT_INTERVAL) or 5.0)
        failures = int(env.get(_SGLANG_HEARTBEAT_MAX_FAILURE) or 2)
    except ValueError as exc:
        raise ValueError(f"${_SGLANG_HEARTBEAT_INTERVAL} / ${_SGLANG_HEARTBEAT_MAX_FAILURE}: {exc}") from None
    return max(interval, 2.0) * max(failures, 1)
SGLANG_WRITE_TIMEOUT_S = _var("KVL_SGLANG_WRITE_TIMEOUT_S", float, 60.0, "a room's writes end within the serve "
                              "bound + this of the decode's reservation (its stream's write window)",
                              "kvlifecycle.adapters.sglang")
SGLANG_VERIFY = _var("KVL_SGLANG_VERIFY", str, None, "per-block digests of each room: `none`, `sample` or `all` "
                     "(docs/design.md); on KV in host memory only", "kvlifecycle.adapters.sglang",
                     default_doc="`all` where SGLang's `--disaggregation-enable-kv-checksum` is set, else `none`")
SGLANG_LOG_DIR = _var("KVL_SGLANG_LOG_DIR", Path, None, "an event log per manager, in `<dir>/<agent>.<epoch>`",
                      "kvlifecycle.adapters.sglang", default_doc="no log")

# --- the transports ----------------------------------------------------------------------------------------------
CUDA_IPC_HOST_IDS = _var("KVL_CUDA_IPC_HOST_IDS", parse_bool, None, "1: the copy kernel reads block ids from pinned "
                         "host memory; 0: ids are copied to the device first", "kvlifecycle.transports.cuda_ipc",
                         default_doc="0 (measured faster)")
CUDA_IPC_REGION_GROUP = _var("KVL_CUDA_IPC_REGION_GROUP", int, None, "regions one kernel program copies",
                             "kvlifecycle.transports.cuda_ipc", default_doc="1; more with host ids")
CUDA_IPC_INLINE_IDS = _var("KVL_CUDA_IPC_INLINE_IDS", parse_bool, None, "1: small requests pass their block ids as "
                           "launch parameters (compiled post only); 0: they stage them like large ones",
                           "kvlifecycle.transports.cuda_ipc", default_doc="1")
CUDA_IPC_TRACE = _var("KVL_CUDA_IPC_TRACE", parse_bool, False, "1: stamp each step of a post (`stage_times(handle)` "
                      "gives µs per stage)", "kvlifecycle.transports.cuda_ipc")
NATIVE_POST = _var("KVL_NATIVE_POST", parse_bool, True, "0: the CUDA IPC transport posts through Python, never its "
                   "compiled post", "kvlifecycle.transports.native_post")
TRITON_FAST_LAUNCH = _var("KVL_TRITON_FAST_LAUNCH", parse_bool, True, "0: every copy launches through Triton's JIT "
                          "(no direct launch of the compiled kernel)", "kvlifecycle.transports.triton_copy")
CACHE_DIR = _var("KVL_CACHE_DIR", Path, None, "where the compiled post is built and cached (`<dir>/native`)",
                 "kvlifecycle.transports.native_post", default_doc="$XDG_CACHE_HOME/kvlifecycle, else "
                 "~/.cache/kvlifecycle")

# --- the tools ---------------------------------------------------------------------------------------------------
BENCH_PROFILE = _var("KVL_BENCH_PROFILE", str, None, "`kvlifecycle bench-gpu` runs under cProfile: `batched` "
                     "profiles the batched requests, any other value the lone small ones",
                     "kvlifecycle.tools.bench_gpu", default_doc="no profile")

# --- the tests and scripts (read from the shell or by the harnesses, not by the installed package) --------------
REQUIRE_ALL = _var("KVL_REQUIRE_ALL", parse_bool, False, "1: a test that would skip for a missing engine, GPU or "
                   "package fails instead (CI)", "tests/conftest.py", "tests/vllm/vllm_harness.py",
                   "tests/sglang/sglang_harness.py", "scripts/test.sh")
SKIP_ENGINES = _var("KVL_SKIP_ENGINES", parse_bool, False, "1: `scripts/test.sh` builds no engine environments "
                    "(their tests skip)", "scripts/test.sh")
VLLM_VENV = _var("KVL_VLLM_VENV", Path, None, "the vLLM virtual environment", "scripts/setup-vllm-env.sh",
                 "bench/vllm_pd.sh", "tests/vllm/vllm_harness.py", default_doc="`<repo>/.venv-vllm`")
SGLANG_VENV = _var("KVL_SGLANG_VENV", Path, None, "the SGLang virtual environment", "scripts/setup-sglang-env.sh",
                   "bench/sglang_pd.sh", "tests/sglang/sglang_harness.py", default_doc="`<repo>/.venv-sglang`")
PYTHON = _var("KVL_PYTHON", str, None, "the interpreter the SGLang environment is built from",
              "scripts/setup-sglang-env.sh", default_doc="python3.11, else python3")
MODEL_CACHE = _var("KVL_MODEL_CACHE", Path, None, "where the tiny test model is built once",
                   "tests/vllm/vllm_harness.py", "bench/vllm_pd.py", default_doc="~/.cache/kvlifecycle/models")
FUZZ_EXAMPLES = _var("KVL_FUZZ_EXAMPLES", int, 150, "examples per property of the event-log reader's fuzz tests",
                     "tests/test_log_fuzz.py")
TEST_PYTHONPATH = _var("KVL_TEST_PYTHONPATH", str, None, "put in front of the SGLang driver processes' PYTHONPATH "
                       "(tests of another checkout: tests/sglang/worktree_site)", "tests/sglang/sglang_harness.py")

TEST_STREAM_FAIL_LAYER = _var("KVL_TEST_STREAM_FAIL_LAYER", int, None, "tests: P's layer-wise streamer fails the "
                              "post of this layer of every stream (an injected transport failure)",
                              "tests/vllm/fault_site/sitecustomize.py")
TEST_STREAM_GATE_LAYER = _var("KVL_TEST_STREAM_GATE_LAYER", int, None, "tests: P's layer-wise streamer holds the "
                              "first post of this layer of its first stream until that stream's cancel reached P",
                              "tests/vllm/fault_site/sitecustomize.py")
TEST_STREAM_TRACE = _var("KVL_TEST_STREAM_TRACE", str, None, "tests: a file P's layer-wise streamer appends one line "
                         "per gate, cancel, post and release to", "tests/vllm/fault_site/sitecustomize.py")
TEST_CORRUPT_LANDED = _var("KVL_TEST_CORRUPT_LANDED", int, None, "tests: D's Consumer flips one byte of the "
                            "first landed block of each of its first n parts with digests, just before the check",
                            "tests/vllm/fault_site/sitecustomize.py", "tests/vllm/test_vllm_verify.py")

REGISTRY: Mapping[str, EnvVar[object]] = {
    v.name: v for v in globals().copy().values() if isinstance(v, EnvVar)
}


def known_names() -> frozenset[str]:
    """Every name the registry reads: current, deprecated and fallback."""
    return frozenset(n for v in REGISTRY.values() for n in (v.name, *v.deprecated, *v.fallbacks))


def markdown_table(variables: Iterable[EnvVar[object]] | None = None) -> str:
    """The docs page: one row per variable, grouped as the registry is."""
    lines = [
        "# Configuration: environment variables",
        "",
        "Generated by `python -m kvlifecycle.envvars > docs/configuration.md` from `kvlifecycle/envvars.py`; do not "
        "edit by hand. Every variable starts with `KVL_`; an unset or empty variable takes its default, and a value "
        "that does not parse is an error naming the variable. Bools are `1`/`0` (or true/false, yes/no, on/off).",
        "",
        "| variable | type | default | what it does | read by |",
        "| --- | --- | --- | --- | --- |",
    ]
    for v in REGISTRY.values() if variables is None else variables:
        default = v.default_doc or ("unset" if v.default is None else _spell(v.default))
        doc = v.doc
        if v.deprecated:
            doc += f" (formerly {', '.join(f'`{d}`' for d in v.deprecated)}, still read, with a warning)"
        if v.fallbacks:
            doc += f" (else {', '.join(f'`{f}`' for f in v.fallbacks)})"
        readers = ", ".join(f"`{r}`" for r in v.read_by)
        lines.append(f"| `{v.name}` | {v.type_name} | {default} | {doc} | {readers} |")
    return "\n".join(lines) + "\n"


def _spell(value: object) -> str:
    return ("1" if value else "0") if isinstance(value, bool) else str(value)


if __name__ == "__main__":
    print(markdown_table(), end="")
