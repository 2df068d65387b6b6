#!/usr/bin/env bash
# Set up .venv (idempotent), then the main job on its embedded CPU default: evicted best-of-N, KV-Rescue
# and full-cache best-of-N on 4 bundled GSM8K problems with SmolLM2-135M, then the report and the HTML explorer.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvrescue run --preset cpu-demo --bench gsm8k --limit 4 \
    --method bon,kvrescue,full --budget 64 --n 2 --out runs/demo
.venv/bin/kvrescue report runs/demo
.venv/bin/kvrescue view runs/demo --out runs/demo.html
echo "What the demo shows: SmolLM2-135M as both base and helper on four problems checks the pipeline end to end; it says nothing about the method's accuracy (that needs the Qwen2.5-Math models and a PRM on a GPU)."
