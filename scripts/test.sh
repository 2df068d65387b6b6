#!/usr/bin/env bash
# Run three parts at once: the vLLM tests in .venv-vllm (`-m vllm`), the files that mostly wait (marker `waiting`:
# Ray's nodes and actors, tensor-parallel ranks, kills and timers) in one .venv process, and every other test in
# .venv (pyproject's addopts leave out the `vllm` marker); the first two parts' output is shown once the last ends.
# Each part leaves the machine's cores idle for much of its time (waits on subprocesses, Ray, vLLM's engine starts):
# the waiting files held one of the main part's two workers for about five minutes while its core idled.
# The vLLM part starts first, setting up .venv-vllm (scripts/setup_vllm.sh, minutes on a fresh clone) while .venv is
# set up (scripts/setup.sh; the two editable installs take turns, scripts/install_project.sh), then the browser for
# the `kvrescue view` test (all three idempotent). Extra arguments go to every pytest run. The main and vLLM runs
# spread their test files over $KVRESCUE_TEST_WORKERS processes (pytest-xdist, default 2; 0 runs them in pytest's
# own process), a file's tests in one process so that its module fixtures (checkpoints, engines, Ray clusters) are
# built once, the longest files first (tests/conftest.py's SLOW_FIRST; `--no-loadscope-reorder` keeps that order);
# the waiting files share one process and its Ray cluster.
set -euo pipefail
cd "$(dirname "$0")/.."
# pytest exits 5 when it collected no test (e.g. arguments naming only files of the other run): not a failure.
pytest_in() {
    local status=0
    "$@" || status=$?
    [ "$status" -eq 5 ] && status=0
    return "$status"
}
workers=(-n "${KVRESCUE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
vllm_log=$(mktemp "${TMPDIR:-/tmp}/kvrescue-vllm-tests.XXXXXX")
waiting_log=$(mktemp "${TMPDIR:-/tmp}/kvrescue-waiting-tests.XXXXXX")
vllm_part="" waiting_part=""
# the background parts are stopped if a setup fails
trap 'kill $vllm_part $waiting_part 2>/dev/null || true; rm -f "$vllm_log" "$waiting_log"' EXIT
(bash scripts/setup_vllm.sh && pytest_in .venv-vllm/bin/python -m pytest -q -m vllm "${workers[@]}" "$@") \
    >"$vllm_log" 2>&1 &
vllm_part=$!
bash scripts/setup.sh
pytest_in .venv/bin/python -m pytest -q -m "waiting and not vllm" "$@" >"$waiting_log" 2>&1 &
waiting_part=$!
bash scripts/browser.sh
status=0
pytest_in .venv/bin/python -m pytest -q -m "not vllm and not waiting" "${workers[@]}" "$@" || status=$?
waiting_status=0
wait "$waiting_part" || waiting_status=$?
echo "--- the tests that mostly wait (.venv, pytest -m waiting) ---"
cat "$waiting_log"
vllm_status=0
wait "$vllm_part" || vllm_status=$?
echo "--- the vLLM tests (.venv-vllm, pytest -m vllm) ---"
cat "$vllm_log"
[ "$status" -ne 0 ] || status=$waiting_status
[ "$status" -ne 0 ] || status=$vllm_status
exit "$status"
