#!/usr/bin/env bash
# Set up .venv and the browser for the `kvrescue view` test (both idempotent), run the whole test suite but the
# vLLM tests (pyproject's addopts leave out the `vllm` marker), then set up .venv-vllm (scripts/setup_vllm.sh)
# and run the vLLM tests there (`-m vllm`). Extra arguments go to both pytest runs. Each run spreads its test files
# over $KVRESCUE_TEST_WORKERS processes (pytest-xdist, default 2; 0 runs them in pytest's own process), a file's
# tests in one process so that its module fixtures (checkpoints, engines, Ray clusters) are built once.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh
# pytest exits 5 when it collected no test (e.g. arguments naming only files of the other run): not a failure.
pytest_in() {
    local status=0
    "$@" || status=$?
    [ "$status" -eq 5 ] && status=0
    return "$status"
}
workers=(-n "${KVRESCUE_TEST_WORKERS:-2}" --dist loadfile)
status=0
pytest_in .venv/bin/python -m pytest -q "${workers[@]}" "$@" || status=$?
bash scripts/setup_vllm.sh
vllm_status=0
pytest_in .venv-vllm/bin/python -m pytest -q -m vllm "${workers[@]}" "$@" || vllm_status=$?
[ "$status" -ne 0 ] || status=$vllm_status
exit "$status"
