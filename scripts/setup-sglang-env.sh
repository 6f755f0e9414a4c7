#!/usr/bin/env bash
# Create (or refresh) the SGLang virtual environment used by tests/sglang and bench/sglang_pd.sh.
#
# sglang==0.5.23 pins torch 2.14.1, which clashes with the main venv's torch 2.13 (CPU), so SGLang lives
# in its own venv: <repo>/.venv-sglang. Idempotent: a venv that already imports the pinned versions is
# left alone (a stamp file records what was installed). Paths are relative to this script, so it works
# in any fresh clone, as root on CI. First install: about 1 min (through uv: scripts/installer.sh) and 11 GB.
#
# Usage: scripts/setup-sglang-env.sh [--force]
#   KVL_SGLANG_VENV   override the venv path (default: <repo>/.venv-sglang)
#   KVL_PYTHON        interpreter to build the venv from (default: python3.11, else python3)
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/.." && pwd)"
VENV="${KVL_SGLANG_VENV:-${REPO_ROOT}/.venv-sglang}"
SGLANG_VERSION="0.5.23"
NIXL_VERSION="1.5.1"
TORCH_VERSION="2.14.1"
STAMP="${VENV}/.kvl-setup-stamp"
WANT_STAMP="sglang==${SGLANG_VERSION} nixl==${NIXL_VERSION} torch==${TORCH_VERSION} repo=${REPO_ROOT}"

force=0
[[ "${1:-}" == "--force" ]] && force=1

log() { printf '[setup-sglang-env %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

pick_python() {
    if [[ -n "${KVL_PYTHON:-}" ]]; then echo "${KVL_PYTHON}"; return; fi
    for candidate in python3.11 python3; do
        if command -v "${candidate}" >/dev/null 2>&1; then command -v "${candidate}"; return; fi
    done
    log "no python3 interpreter found"; exit 1
}

venv_ok() {
    [[ -x "${VENV}/bin/python" && -f "${STAMP}" ]] || return 1
    [[ "$(cat "${STAMP}")" == "${WANT_STAMP}" ]] || return 1
    # The stamp alone could lie after a partial delete: ask the interpreter too.
    "${VENV}/bin/python" - <<PY >/dev/null 2>&1
import importlib.metadata as md
assert md.version("sglang") == "${SGLANG_VERSION}"
assert md.version("nixl") == "${NIXL_VERSION}"
assert md.version("torch").split("+")[0] == "${TORCH_VERSION}"
import kvlifecycle, nixl._api  # noqa: F401
eps = [ep.name for ep in md.entry_points(group="sglang.srt.plugins")]
assert "kvlifecycle" in eps, eps
PY
}

if [[ ${force} -eq 0 ]] && venv_ok; then
    log "up to date: ${VENV}"
    exit 0
fi

start=$(date +%s)
PY="$(pick_python)"
if [[ ! -x "${VENV}/bin/python" ]]; then
    log "creating ${VENV} with ${PY}"
    "${PY}" -m venv "${VENV}"
fi
rm -f "${STAMP}"
export PIP_NO_INPUT=1
source "${SCRIPT_DIR}/installer.sh"
kvl_installer "${VENV}"
log "installing sglang==${SGLANG_VERSION} (torch==${TORCH_VERSION}), nixl==${NIXL_VERSION} with ${INSTALL[0]##*/}"
"${INSTALL[@]}" -q "torch==${TORCH_VERSION}" "sglang==${SGLANG_VERSION}" "nixl==${NIXL_VERSION}"
log "installing kvlifecycle (editable) from ${REPO_ROOT}"
# Our light deps resolve beside SGLang's; torch stays where it is.
"${INSTALL[@]}" -q -e "${REPO_ROOT}[dev]" "torch==${TORCH_VERSION}"
echo "${WANT_STAMP}" > "${STAMP}"
if ! venv_ok; then
    log "install finished but the venv check failed; run: ${VENV}/bin/python -c 'import sglang, nixl._api, kvlifecycle'"
    exit 1
fi
log "done in $(( $(date +%s) - start )) s; size $(du -sh "${VENV}" | cut -f1)"
