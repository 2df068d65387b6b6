#!/usr/bin/env bash
# Create (or reuse) .venv in the repository root and install kvrescue into it (editable, with the dev extra), with the
# repository root on its path (scripts/checkout_on_path.sh: the tests' and benchmarks' kit).
# torch goes in first so the rest resolves against it; set KVRESCUE_TORCH to pick another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "${KVRESCUE_TORCH:-torch==2.13.0}"
stamp=.venv/.kvrescue-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! .venv/bin/python -c "import kvrescue, grader" 2>/dev/null; then
    bash scripts/install_project.sh .venv dev
    touch "$stamp"
fi
bash scripts/checkout_on_path.sh .venv
