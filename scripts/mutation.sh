#!/usr/bin/env bash
# Mutation testing of the policy modules (detector, eviction, bounded cache, report numbers, run folders):
# mutmut changes one thing at a time in them ([tool.mutmut] in pyproject.toml) and runs the tests that cover
# the mutated function; a mutant no test kills is a behaviour no test checks. Extra arguments go to
# `mutmut run` (e.g. a name pattern: 'kvrescue.detect*'). Takes tens of minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -c "import mutmut" 2>/dev/null || .venv/bin/pip install -q "mutmut==3.8.1"
export OMP_NUM_THREADS=1
# mutmut copies the tree into mutants/ once and never refreshes a copy that exists, so after any change its
# mutants would import stale modules (and map coverage onto old line numbers): start from a fresh copy.
rm -rf mutants
.venv/bin/mutmut run --max-children "${MUTATION_JOBS:-2}" "$@" || true
.venv/bin/mutmut results
