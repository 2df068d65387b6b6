#!/usr/bin/env bash
# Set up .venv (idempotent) and run the main job on its embedded CPU default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvrescue grade examples/gsm8k_outputs.jsonl --bench gsm8k --out runs/example-graded.jsonl
