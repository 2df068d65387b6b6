#!/usr/bin/env bash
# Set up .venv (idempotent), then the main job on its embedded CPU default: evicted best-of-N, KV-Rescue
# and full-cache best-of-N on 4 bundled GSM8K problems with SmolLM2-135M, then the report and the HTML explorer.
# The caps (16 steps of at most 192 tokens, 2,048 tokens of context) bound the demo's time: with the paper's
# defaults (1,024 steps of 512, 4,096) one `full` problem of a 135M model was seen still decoding after an hour.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/kvrescue run --preset cpu-demo --bench gsm8k --limit 4 \
    --method bon,kvrescue,full --budget 64 --n 2 \
    --max-steps 16 --max-step-tokens 192 --context-cap 2048 --out runs/demo
.venv/bin/kvrescue report runs/demo
.venv/bin/kvrescue view runs/demo --out runs/demo.html
echo "What the demo shows: SmolLM2-135M as both base and helper on four problems checks the pipeline end to end; it says nothing about the method's accuracy (that needs the Qwen2.5-Math models and a PRM on a GPU)."
