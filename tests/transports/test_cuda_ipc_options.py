"""The CUDA IPC transport's options: read from the environment in one place, validated where they are made, and
no other module of the package reads a ``KVL_`` variable (no GPU needed)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvlifecycle.transports.cuda_ipc import REGION_GROUP_HOST_IDS, CudaIpcOptions
from kvlifecycle.transports.cuda_ipc import options as options_module

PACKAGE = Path(options_module.__file__).parent


def test_defaults_without_any_variable() -> None:
    opts = CudaIpcOptions.from_env({})
    assert opts == CudaIpcOptions()
    assert (opts.host_ids, opts.inline_ids, opts.trace, opts.compiled_post, opts.fast_launch) == (
        False, True, False, True, True)
    assert opts.effective_region_group == 1
    assert opts.copier_kwargs() == {"region_group": 1, "inline_ids": True, "fast_launch": True,
                                    "compiled_post": True}


def test_every_variable_lands_in_its_option_and_a_given_keyword_wins() -> None:
    env = {"KVL_CUDA_IPC_HOST_IDS": "1", "KVL_CUDA_IPC_INLINE_IDS": "0", "KVL_CUDA_IPC_TRACE": "1",
           "KVL_NATIVE_POST": "0", "KVL_TRITON_FAST_LAUNCH": "0"}
    opts = CudaIpcOptions.from_env(env)
    assert (opts.host_ids, opts.inline_ids, opts.trace, opts.compiled_post, opts.fast_launch) == (
        True, False, True, False, False)
    assert opts.effective_region_group == REGION_GROUP_HOST_IDS  # host ids read once for several regions
    assert CudaIpcOptions.from_env({**env, "KVL_CUDA_IPC_REGION_GROUP": "3"}).effective_region_group == 3
    assert CudaIpcOptions.from_env(env, host_ids=False, chunk_bytes=8192).copier_kwargs()["chunk_bytes"] == 8192
    assert CudaIpcOptions.from_env(env, host_ids=False).host_ids is False
    assert opts.replace(trace=None).trace is True  # None keeps the field


@pytest.mark.parametrize(("env", "match"), [
    ({"KVL_CUDA_IPC_HOST_IDS": "yes please"}, "KVL_CUDA_IPC_HOST_IDS"),
    ({"KVL_CUDA_IPC_REGION_GROUP": "eight"}, "KVL_CUDA_IPC_REGION_GROUP"),
    ({"KVL_CUDA_IPC_REGION_GROUP": "0"}, "region_group"),
])
def test_a_bad_value_is_refused_with_its_name(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CudaIpcOptions.from_env(env)


def test_fields_are_validated_and_frozen() -> None:
    with pytest.raises(TypeError, match="trace"):
        CudaIpcOptions(trace="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_bytes"):
        CudaIpcOptions(chunk_bytes=-4096)
    with pytest.raises(AttributeError):
        CudaIpcOptions().trace = True  # type: ignore[misc]


def _reads_environment(tree: ast.AST) -> list[int]:
    """Lines that touch ``os.environ`` or ``os.getenv``."""
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os"
            and node.attr in ("environ", "getenv")]


def test_only_the_options_module_reads_the_transports_variables() -> None:
    """The compiled post's build cache (``KVL_CACHE_DIR``, ``CC``) is the one other reader, at module level."""
    readers = {}
    for path in sorted(PACKAGE.glob("*.py")):
        text = path.read_text()
        lines = _reads_environment(ast.parse(text))
        if lines:
            readers[path.name] = lines
        if path.name != "options.py":
            assert "KVL_CUDA_IPC_" not in text.replace("``KVL_CUDA_IPC_", ""), path.name
    assert set(readers) == {"options.py", "native_post.py"}
    tree = ast.parse((PACKAGE / "native_post.py").read_text())
    in_classes = [n for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in _reads_environment(c)]
    assert in_classes == []
