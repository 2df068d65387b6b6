#!/usr/bin/env bash
# A shell pipeline over kvrescue's JSONL: run a custom problem set on the CPU demo models, pull the
# outputs out of the traces, re-grade them as a stream, and count the correct ones (plain Python, so jq is not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
KV=.venv/bin/kvrescue
$KV run --preset cpu-demo --bench examples/custom_problems.jsonl --problem-field prompt --answer-field final \
    --method kvrescue --budget 64 --n 2 --out runs/examples
cat runs/examples/custom_problems/*/traces.jsonl \
    | .venv/bin/python -c 'import sys, json; [print(json.dumps({"idx": t["idx"], "output": t["output"], "gt": t["gt"]})) for t in map(json.loads, sys.stdin)]' \
    | $KV grade - --bench generic \
    | .venv/bin/python -c 'import sys, json; rows = [json.loads(l) for l in sys.stdin]; print(sum(r["correct"] for r in rows), "of", len(rows), "correct")'
