#!/usr/bin/env bash
# P/D on real vLLM (CPU): vLLM's NixlConnector vs KVLifecycleConnector in one run (see bench/vllm_pd.py).
# Usage: bench/vllm_pd.sh [--json] [--slow-decode --staging [--p-kv-blocks 16] [--stage-after-ms 10] [--staging-pool-blocks 128]] [--verify all|sample] [--layerwise [--prompt-lengths 512,1500,4000]] [--requests N] [--prompt-tokens N] [--output-tokens N] [--tp-shapes 2x2,2x1,1x2]
# Creates (or reuses) <repo>/.venv-vllm with scripts/setup-vllm-env.sh; setup chatter goes to stderr.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVL_VLLM_VENV:-$REPO_ROOT/.venv-vllm}"
"$REPO_ROOT/scripts/setup-vllm-env.sh" >&2
export KVL_VLLM_VENV="$VENV"
exec "$VENV/bin/python" "$REPO_ROOT/bench/vllm_pd.py" "$@"
