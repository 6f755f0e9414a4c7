#!/usr/bin/env bash
# Same P/D transfers through SGLang's NIXL backend and through kvlifecycle's, in one run (see bench/sglang_pd.py).
# Usage: bench/sglang_pd.sh [--json] [--small-rooms] [--repeat N] [--rooms N] [--pages-per-room N] [--layers N]
#                           [--item-bytes N]
# --small-rooms: per-room latency of 1.5 MiB rooms, one at a time (median and p90 per backend, and their ratio).
# Creates (and caches) the SGLang venv on first use: about 6 minutes and 11 GB.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "${HERE}/.." && pwd)"
VENV="${KVL_SGLANG_VENV:-${ROOT}/.venv-sglang}"
bash "${ROOT}/scripts/setup-sglang-env.sh" >&2
exec "${VENV}/bin/python" "${HERE}/sglang_pd.py" "$@"
