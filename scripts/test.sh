#!/usr/bin/env bash
# The test command (README, and what .ci/run calls): set up every part this machine can run, then run the tests.
#
#   main venv (.venv)          scripts/setup.sh          core, NIXL (DRAM) transports, CLI
#   vLLM venv (.venv-vllm)     scripts/setup-vllm-env.sh     real vLLM on CPU (cached after the first run)
#   SGLang venv (.venv-sglang) scripts/setup-sglang-env.sh   real SGLang on CPU (cached after the first run)
#   etcd server               scripts/setup-etcd.sh         the multi-host tests (Debian etcd-server)
#
# KVL_SKIP_ENGINES=1 skips the two engine environments for a quick core run (their tests then skip).
# In CI (CI=true) nothing may be skipped: KVL_REQUIRE_ALL=1 turns such skips into failures.
# The type check (scripts/typecheck.sh, mypy) runs right after the main setup, while the engine environments build:
# a type error fails the run before any test.
# Extra arguments go to pytest (one run, as given). Without any, the tests marked `background` (deterministic
# CPU work with no wall-clock bound: the 10,000-seed simulation) run in a second pytest at the lowest CPU priority
# beside the rest, on the cycles the real engines leave idle (waiting on leases, on each other, between steps), and
# their summary is printed at the end. An idle core is all they get: multi-process NIXL tests beside such a load
# measured no slower than alone. pytest's "no tests ran" (exit 5) is a failure here, in either run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# The two engine environments are independent installs (scripts/installer.sh: uv, most of it writing bytecode):
# they build side by side, from the start, while the main environment, the type check and etcd are made; each
# into its own log, printed when it ends.
engine_jobs=()
engine_logs=()
if [[ "${KVL_SKIP_ENGINES:-0}" != "1" ]]; then
    trap 'kill "${engine_jobs[@]}" 2>/dev/null || true' EXIT
    for env in vllm sglang; do
        engine_logs+=("$(mktemp)")
        bash "scripts/setup-$env-env.sh" >"${engine_logs[-1]}" 2>&1 &
        engine_jobs+=("$!")
    done
fi
bash scripts/setup.sh
bash scripts/typecheck.sh
bash scripts/setup-etcd.sh
engine_failed=0
for i in "${!engine_jobs[@]}"; do
    wait "${engine_jobs[$i]}" || engine_failed=1
    cat "${engine_logs[$i]}" >&2
    rm -f "${engine_logs[$i]}"
done
trap - EXIT
[[ $engine_failed -eq 0 ]] || { echo "scripts/test.sh: an engine environment failed to build (its log is above)" >&2; exit 1; }
if [[ "${CI:-}" == "true" ]]; then
    export KVL_REQUIRE_ALL=1
fi
no_tests() {  # pytest's exit status 5: no test ran
    [[ $1 -ne 5 ]] || echo "scripts/test.sh: pytest collected no tests ($2): failing" >&2
}
set +e
if [[ $# -gt 0 ]]; then
    .venv/bin/python -m pytest -ra --durations=30 "$@"
    status=$?
    no_tests $status "pytest $*"
    [[ $status -ne 5 ]] || status=1
    exit $status
fi
background_log=$(mktemp)
# a per-test timeout of 2400 s, not 600: at the lowest priority the run may wait long for a core, and it has no
# bound of its own to miss (the simulation's time is simulated)
nice -n 19 .venv/bin/python -m pytest -ra --durations=10 -p no:cacheprovider --timeout 2400 -m background \
    >"$background_log" 2>&1 &
background_job=$!
trap 'kill "$background_job" 2>/dev/null || true' EXIT
.venv/bin/python -m pytest -ra --durations=30 -m "not background"
status=$?
wait "$background_job"
background_status=$?
trap - EXIT
echo "=== the background tests (-m background, nice 19) ==="
cat "$background_log"
rm -f "$background_log"
set -e
no_tests $status "-m 'not background'"
no_tests $background_status "-m background"
for s in $status $background_status; do
    if [[ $s -ne 0 ]]; then
        [[ $s -ne 5 ]] || s=1
        exit $s
    fi
done
exit 0
