#!/usr/bin/env bash
# Run two parts at once: the whole test suite but the vLLM tests in .venv (pyproject's addopts leave out the `vllm`
# marker), and the vLLM tests in .venv-vllm (`-m vllm`), whose output is shown once the first part ends (each part
# leaves the machine's cores idle for much of its time: waits on subprocesses, Ray, vLLM's engine starts). .venv is set
# up first (scripts/setup.sh; not beside .venv-vllm's setup: both editable installs write kvrescue.egg-info here), then
# the vLLM part starts, setting up .venv-vllm (scripts/setup_vllm.sh, minutes on a fresh clone) while the browser for
# the `kvrescue view` test is set up (all three idempotent). Extra arguments go to both pytest runs. Each run
# spreads its test files over $KVRESCUE_TEST_WORKERS processes (pytest-xdist, default 2; 0 runs them in pytest's own
# process), a file's tests in one process so that its module fixtures (checkpoints, engines, Ray clusters) are built
# once, the longest files first (tests/conftest.py's SLOW_FIRST; `--no-loadscope-reorder` keeps that order).
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
bash scripts/setup.sh
(bash scripts/setup_vllm.sh && pytest_in .venv-vllm/bin/python -m pytest -q -m vllm "${workers[@]}" "$@") \
    >"$vllm_log" 2>&1 &
vllm_part=$!
trap 'kill "$vllm_part" 2>/dev/null || true; rm -f "$vllm_log"' EXIT  # stopped if the browser's setup fails
bash scripts/browser.sh
status=0
pytest_in .venv/bin/python -m pytest -q "${workers[@]}" "$@" || status=$?
vllm_status=0
wait "$vllm_part" || vllm_status=$?
echo "--- the vLLM tests (.venv-vllm, pytest -m vllm) ---"
cat "$vllm_log"
[ "$status" -ne 0 ] || status=$vllm_status
exit "$status"
