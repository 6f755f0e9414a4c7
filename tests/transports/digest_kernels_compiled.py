"""Run by ``test_digest_kernels_compiled.py`` in a Python that has Triton (the vLLM venv), no GPU needed: the GPU
digester's wide kernels compiled for an H100 (sm_90, as a launch specialises them: 16-byte aligned pointers) with
Triton's own ``ptxas``, and their machine code read back with its ``cuobjdump``. Prints one JSON object: per kernel
and ``LOADS_FIRST``, the order of the tile's global loads and stores and the local memory (spills) per thread."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from kvlifecycle.transports import digest_gpu
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
# the tile's accesses: 16-byte loads past L1 (.cg) and streaming 16-byte stores (.cs), nothing else in the kernels
TILE_LOAD, TILE_STORE = "LDG.E.128.STRONG.GPU", "STG.E.EF.128"


def compile_for_h100(fn: triton.runtime.JITFunction, constants: dict[str, object], num_warps: int) -> bytes:
    pointers = {name for name in fn.arg_names if name.endswith("_ptr")}
    signature = {name: "constexpr" if name in constants else "*i32" if name == "arrived_ptr" else
                 "*i64" if name in pointers else "i64" for name in fn.arg_names}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
                       attrs={(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
                              if name in pointers})
    return triton.compile(source, target=TARGET, options={"num_warps": num_warps}).asm["cubin"]


def read_back(cubin: bytes) -> dict[str, object]:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    ops = [m.group(1) for m in re.finditer(r"\b((?:LDG|STG)\.[\w.]+)", sass)]
    local = re.search(r"LOCAL:(\d+)", usage)
    return {"tile": ["L" if op == TILE_LOAD else "S" for op in ops if op in (TILE_LOAD, TILE_STORE)],
            "local_bytes": int(local.group(1)) if local else -1}


def main() -> None:
    one_launch = {"ROWS": 32, "NROWS": 32, "REGIONS": 64, "SPLIT": 1, "ALIGN": 2, "COPY": True, "CACHE": 1}
    kernels = {
        "one_launch": (digest_gpu._xxh3_one_launch_kernel, one_launch, 4),
        "one_launch_inline": (digest_gpu._xxh3_one_launch_inline_kernel, one_launch, 4),
        "rows_wide": (digest_gpu._xxh3_rows_wide_kernel, {"ROWS": 16, "ALIGN": 2, "COPY": True, "CACHE": 1}, 4),
    }
    out = {f"{name} loads_first={first}": read_back(compile_for_h100(fn, {**constants, "LOADS_FIRST": first}, warps))
           for name, (fn, constants, warps) in kernels.items() for first in (True, False)}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
