#!/usr/bin/env bash
# Create (or reuse) the main virtual environment, <repo>/.venv: CPU torch, NIXL 1.5.1, kvlifecycle (editable)
# with its dev extras. Idempotent and quick on a second run.
#
# torch is pinned to 2.13.0: on these machines pip takes the CPU wheel lying on disk; an unpinned torch drags in
# a multi-GB CUDA build. nixl is pinned to 1.5.1 (the 1.5.2 meta package wants a nixl-cu12 that does not exist).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
log() { printf '[setup %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }
source scripts/installer.sh

if [[ ! -x .venv/bin/python ]]; then
    log "creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c 'import torch, nixl._api, kvlifecycle.transports' 2>/dev/null \
    || [[ pyproject.toml -nt .venv/.kvl-setup-stamp ]]; then
    log "installing torch==2.13.0 (CPU), nixl==1.5.1 and kvlifecycle[transports,dev]"
    kvl_installer .venv
    "${INSTALL[@]}" -q "torch==2.13.0"
    "${INSTALL[@]}" -q -e ".[transports,dev]" "torch==2.13.0"
    touch .venv/.kvl-setup-stamp
fi
log "ready: $(.venv/bin/python -c 'import torch, nixl, kvlifecycle; print("torch", torch.__version__)')"
