#!/usr/bin/env bash
# Install kvrescue into the venv $1, editable, with the extras $2 (comma-separated, may be empty): its requirements
# first (pyproject.toml's), then the project itself without them while holding a lock on pyproject.toml. The
# editable install writes kvrescue.egg-info into the checkout, so two at once could mix their files; the rest of a
# setup (downloads, unpacking, byte-compiling: nearly all of its time) needs no lock, and scripts/test.sh sets up
# .venv and .venv-vllm at once.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
requirements=$(mktemp "${TMPDIR:-/tmp}/kvrescue-requirements.XXXXXX")
trap 'rm -f "$requirements"' EXIT
"$venv/bin/python" - "${2:-}" >"$requirements" <<'PY'
import sys
import tomllib

with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)["project"]
extras = [name for name in sys.argv[1].split(",") if name]
print("\n".join(project["dependencies"] + [r for name in extras for r in project["optional-dependencies"][name]]))
PY
"$venv/bin/pip" install -q -r "$requirements"
"$venv/bin/python" - "$venv/bin/pip" <<'PY'
import fcntl
import subprocess
import sys

with open("pyproject.toml", "rb") as lock:  # released when this process ends, however it ends
    fcntl.flock(lock, fcntl.LOCK_EX)
    sys.exit(subprocess.call([sys.argv[1], "install", "-q", "--no-deps", "-e", "."]))
PY
