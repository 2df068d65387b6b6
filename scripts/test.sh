#!/usr/bin/env bash
# Set up .venv and the browser for the `kvrescue view` test (both idempotent), then run the whole test suite;
# extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/browser.sh
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
# pytest exits 5 when it collected no test: that is not a failure of the code.
[ "$status" -eq 5 ] && status=0
exit "$status"
