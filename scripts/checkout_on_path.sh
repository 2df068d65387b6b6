#!/usr/bin/env bash
# Put the repository root on the path of the venv $1 (a .pth file; idempotent): the tests' and benchmarks' kit,
# kvrescue_testkit, and the benchmarks' folders import from the checkout there, as with `PYTHONPATH=$PWD` where
# nothing is installed. Neither is in kvrescue's wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
site=$("$1/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
[ "$(cat "$site/kvrescue-checkout.pth" 2>/dev/null)" = "$PWD" ] || echo "$PWD" > "$site/kvrescue-checkout.pth"
