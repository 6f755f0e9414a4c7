"""The core imports no torch, NIXL or engine, and no transport or adapter (checked in a fresh interpreter); an
adapter speaks to P and D only through the handoff, never to the side channel (checked in its source).

The core is every module under ``kvlifecycle/`` except the tools (``kvlifecycle.cli``, ``kvlifecycle.tools``),
discovered with pkgutil: a new core module is covered without editing this test."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvlifecycle

TOOLS = ("kvlifecycle.cli", "kvlifecycle.tools", "kvlifecycle.__main__")  # __main__ runs the CLI
# the subpackages mapped under kvlifecycle by pyproject's package-dir (not core: they are what the core must not use)
MAPPED = ("kvlifecycle.transports", "kvlifecycle.adapters")
FORBIDDEN = ("torch", "nixl", "vllm", "sglang", "kvlifecycle.transports", "kvlifecycle.adapters")


def _excluded(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in (*TOOLS, *MAPPED))


def core_modules() -> list[str]:
    """``kvlifecycle`` and every module below it that is not a tool (found on disk, not imported)."""
    root = [str(Path(kvlifecycle.__file__).parent)]
    found = ["kvlifecycle"]
    for info in pkgutil.walk_packages(root, prefix="kvlifecycle."):
        if not _excluded(info.name):
            found.append(info.name)
    return sorted(found)


def test_the_core_module_list_is_discovered_not_written_down() -> None:
    modules = core_modules()
    assert {"kvlifecycle.handoff", "kvlifecycle.path_selection", "kvlifecycle.transport",
            "kvlifecycle.testing.transport_conformance"} <= set(modules)
    assert not any(_excluded(m) for m in modules)


ADAPTERS = Path(__file__).resolve().parents[1] / "adapters"  # installed as kvlifecycle.adapters
SIDE_CHANNEL = "kvlifecycle.sidechannel"
SIDE_CHANNEL_ENDS = ("SideChannelClient", "SideChannelServer")  # only the handoff opens either


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` in ``module`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    package = module.split(".")[: -node.level]
    return ".".join([*package, *([node.module] if node.module else [])])


def side_channel_uses(source: str, module: str) -> list[str]:
    """Where ``source`` (the text of ``module``) imports the side channel or names one of its ends."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node)
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("kvlifecycle.sidechannel")
        elif isinstance(node, (ast.Name, ast.Attribute)):
            name = node.id if isinstance(node, ast.Name) else node.attr
            if name in SIDE_CHANNEL_ENDS:
                found.append(f"line {node.lineno}: {name}")
            continue
        else:
            continue
        found += [f"line {node.lineno}: {name}" for name in names
                  if name == SIDE_CHANNEL or name.startswith(SIDE_CHANNEL + ".")]
    return found


def adapter_modules() -> dict[str, Path]:
    return {"kvlifecycle.adapters." + ".".join(path.relative_to(ADAPTERS).with_suffix("").parts): path
            for path in sorted(ADAPTERS.rglob("*.py"))}


def test_adapters_speak_to_peers_only_through_the_handoff() -> None:
    """The handoff (Producer, Consumer) sends and serves every side-channel message; an adapter that opened its own
    client would be a second speaker of the protocol, outside the handoff's tests."""
    modules = adapter_modules()
    assert "kvlifecycle.adapters.vllm.worker" in modules and "kvlifecycle.adapters.sglang.plugin" in modules
    offenders = {module: uses for module, path in modules.items()
                 if (uses := side_channel_uses(path.read_text(), module))}
    assert offenders == {}


@pytest.mark.parametrize("source", [
    "import kvlifecycle.sidechannel",
    "from kvlifecycle.sidechannel import SideChannelError",
    "from kvlifecycle import sidechannel",
    "from ...sidechannel import Ack",  # relative, from kvlifecycle.adapters.vllm.worker
    "import importlib\nsc = importlib.import_module('kvlifecycle.sidechannel')",
    "from kvlifecycle import handoff\nclient = handoff.SideChannelClient('tcp://127.0.0.1:1', ())",
])
def test_the_side_channel_check_finds_each_way_in(source: str) -> None:
    assert side_channel_uses(source, "kvlifecycle.adapters.vllm.worker")
    assert side_channel_uses("from kvlifecycle.handoff import Consumer, SideChannelError", "x.y") == []


def test_core_imports_nothing_heavy() -> None:
    """Every core module, imported one after another in a fresh interpreter; a forbidden import is charged to the
    module whose import pulled it in."""
    code = (
        "import importlib, json, sys\n"
        f"forbidden = {FORBIDDEN!r}\n"
        "def bad():\n"
        "    return {m for m in sys.modules if m.split('.')[0] in forbidden or m.startswith(forbidden)}\n"
        "offenders, seen = {}, set()\n"
        "for m in sys.argv[1:]:\n"
        "    importlib.import_module(m)\n"
        "    new = bad() - seen\n"
        "    if new:\n"
        "        offenders[m] = sorted(new)\n"
        "        seen |= new\n"
        "print(json.dumps(offenders))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *core_modules()], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "{}"


def test_the_packaged_conformance_suite_imports_no_torch() -> None:
    code = "import sys, kvlifecycle.testing.transport_conformance\nprint('torch' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_transports_and_adapters_are_subpackages_not_top_level_names() -> None:
    code = (
        "import importlib.util as u\n"
        "print(u.find_spec('kvlifecycle.transports') is not None, u.find_spec('kvlifecycle.adapters') is not None,"
        " u.find_spec('transports') is None)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True, cwd="/")
    assert out.stdout.split() == ["True", "True", "True"]


def test_wheel_ships_subpackages_under_kvlifecycle_only(tmp_path) -> None:
    import zipfile
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(root),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    wheel = next(tmp_path.glob("kvlifecycle-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"kvlifecycle", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}
    for module in (
        "kvlifecycle/cli/__init__.py",
        "kvlifecycle/transports/nixl.py",
        "kvlifecycle/transports/cuda_ipc/transport.py",
        "kvlifecycle/transports/cuda_ipc/_native_post.c",  # built at first use: it must ship
        "kvlifecycle/testing/transport_conformance.py",
        "kvlifecycle/adapters/vllm/connector.py",
        "kvlifecycle/adapters/sglang/plugin.py",
    ):
        assert module in names
    # every package of the tree ships (the pyproject list is explicit: a new package must be added to it)
    mapped = {"kvlifecycle": "kvlifecycle", "transports": "kvlifecycle/transports", "adapters": "kvlifecycle/adapters"}
    for top, inside in mapped.items():
        for init in (root / top).rglob("__init__.py"):
            shipped = f"{inside}/{init.relative_to(root / top).as_posix()}"
            assert shipped in names, f"{shipped} is not in the wheel: list its package in pyproject.toml"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "kvlifecycle = kvlifecycle.cli:main" in text
    assert "[sglang.srt.plugins]" in text


# --- no import circles ----------------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
# the trees the wheel maps under kvlifecycle (pyproject's package-dir), each with the name it is imported by
TREES = {"kvlifecycle": ROOT / "kvlifecycle", "kvlifecycle.transports": ROOT / "transports",
         "kvlifecycle.adapters": ROOT / "adapters"}


def source_modules() -> dict[str, Path]:
    """Every module of the three trees, by its import name."""
    found = {}
    for prefix, tree in TREES.items():
        for path in sorted(tree.rglob("*.py")):
            parts = path.relative_to(tree).with_suffix("").parts
            found[".".join((prefix, *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return found


def imported_modules(module: str, source: str, known: set[str], *, package: bool = False) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports, at its top or lazily inside a
    function (a lazy import closes a circle as surely), leaving out imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module + ".__init__" if package else module, node)
            for alias in node.names:  # ``from pkg import mod`` imports the module, ``from mod import name`` mod
                target = f"{base}.{alias.name}"
                found.add(target if target in known else base)
    return (found & known) - {module}


def import_circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: set[frozenset[str]] = set()
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    members = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        members.add(member)
                        if member == node:
                            break
                    if len(members) > 1:
                        circles.add(frozenset(members))
    return circles


def test_no_import_circles_under_the_core_the_transports_and_the_adapters() -> None:
    modules = source_modules()
    assert {"kvlifecycle.transports.select", "kvlifecycle.adapters.vllm.worker", "kvlifecycle.tools.demo"} <= set(
        modules)
    known = set(modules)
    graph = {m: imported_modules(m, p.read_text(), known, package=p.name == "__init__.py") for m, p in modules.items()}
    assert "kvlifecycle.transports.cuda_ipc.selection" in graph["kvlifecycle.transports.select"]
    assert {sorted(c)[0]: sorted(c) for c in import_circles(graph)} == {}


def test_the_circle_check_finds_a_lazy_circle() -> None:
    """A selector that imports its fast path at the top while the fast path imports it back inside a function (the
    shape the transport selection once had) is a circle; the same import under TYPE_CHECKING is not."""
    known = {"pkg.select", "pkg.fast", "pkg.report"}
    select = "from pkg.fast import FastPath\nfrom pkg import report\n"
    fast = "def take():\n    from . import select\n    return select\n"
    graph = {"pkg.select": imported_modules("pkg.select", select, known),
             "pkg.fast": imported_modules("pkg.fast", fast, known), "pkg.report": set()}
    assert graph["pkg.select"] == {"pkg.fast", "pkg.report"} and graph["pkg.fast"] == {"pkg.select"}
    assert import_circles(graph) == {frozenset({"pkg.select", "pkg.fast"})}
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import select\n"
    graph["pkg.fast"] = imported_modules("pkg.fast", typed, known)
    assert import_circles(graph) == set()
