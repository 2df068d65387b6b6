#!/usr/bin/env bash
# Set up .venv (idempotent) and run the whole test suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
# pytest exits 5 when it collected no test: that is not a failure of the code.
[ "$status" -eq 5 ] && status=0
exit "$status"
