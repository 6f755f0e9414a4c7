"""Which of the package's extras are installed here, and what each missing one would enable: what
``kvlifecycle doctor --extras`` prints (pyproject.toml's [project.optional-dependencies] and README, "Install into
your engine", name the same sets)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import TypedDict


@dataclass(frozen=True)
class Extra:
    name: str
    modules: tuple[str, ...]  # import names the extra brings; present when every one is importable
    enables: str


EXTRAS = (
    Extra("transports", ("nixl",), "the NIXL transport (UCX; DRAM and VRAM) and `kvlifecycle doctor`'s probes"),
    Extra("torch", ("torch", "zmq"), "the loopback and CUDA IPC transports; with transports: `demo`, "
          "`bench transport`, `bench load`, `bench gpu`"),
    Extra("vllm", ("nixl",), "the vLLM connector (vLLM itself is the engine's install)"),
    Extra("sglang", ("nixl", "zmq"), "the SGLang backend (SGLang itself is the engine's install)"),
    Extra("etcd", ("pyetcd", "google.protobuf"), "membership across hosts, `proxy --etcd`, `doctor --etcd`, `drain`"),
    Extra("otel", ("opentelemetry.sdk",), "traces and metrics written to files (KVL_OTEL_DIR)"),
    Extra("viz", ("matplotlib",), "`timeline --png`"),
    Extra("testing", ("pytest",), "kvlifecycle.testing: the transport conformance suite"),
)


class ExtraStatus(TypedDict):
    extra: str
    present: bool
    missing: list[str]  # the extra's modules that are not importable here
    enables: str


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def extras_status() -> list[ExtraStatus]:
    """One row per extra: its name, whether it is present, the modules missing and what it enables."""
    rows: list[ExtraStatus] = []
    for extra in EXTRAS:
        missing = [m for m in extra.modules if not _importable(m)]
        rows.append({"extra": extra.name, "present": not missing, "missing": missing, "enables": extra.enables})
    return rows


def render_extras(rows: list[ExtraStatus]) -> str:
    lines = ["extras (pip install 'kvlifecycle[NAME,...]'):"]
    for row in rows:
        state = "present" if row["present"] else f"missing ({', '.join(row['missing'])})"
        lines.append(f"  {row['extra']:<11} {state:<28} {row['enables']}")
    return "\n".join(lines)
