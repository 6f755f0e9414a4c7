#!/usr/bin/env bash
# The type check (mypy, configured in pyproject.toml's [tool.mypy]): strict for the core, checked for the tools,
# transports and adapters. scripts/test.sh runs it before pytest; it prints one summary line and fails on any error.
#
#   bash scripts/typecheck.sh [python]     python: the interpreter whose environment holds mypy (default .venv)
#
# mypy checks the installed names. transports/ and adapters/ become kvlifecycle.transports and kvlifecycle.adapters
# through package-dir, which an editable install resolves with an import hook that mypy cannot follow; two links in
# .mypy_cache/pkgmap (mypy_path) give it the same mapping, and error paths are written back to the real files.
# The cache (.mypy_cache) makes a second run take seconds; the first analyses torch and numpy as well.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${1:-.venv/bin/python}"
PKGMAP=.mypy_cache/pkgmap/kvlifecycle
mkdir -p "$PKGMAP"
ln -sfn ../../../transports "$PKGMAP/transports"
ln -sfn ../../../adapters "$PKGMAP/adapters"

set +e
output="$("$PYTHON" -m mypy 2>&1)"
status=$?
set -e
output="${output//$PKGMAP\//}"  # .mypy_cache/pkgmap/kvlifecycle/transports/x.py -> transports/x.py
if [[ $status -eq 0 ]]; then
    echo "scripts/typecheck.sh: mypy: ${output##*$'\n'}"
else
    printf '%s\n' "$output"
    echo "scripts/typecheck.sh: mypy failed (exit $status): fix the errors above before the tests run" >&2
fi
exit $status
