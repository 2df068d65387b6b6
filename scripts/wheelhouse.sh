#!/usr/bin/env bash
# Build a wheelhouse for an offline GPU machine whose image already has torch and transformers: kvrescue's own wheel
# and every wheel of what `kvrescue run` imports that such an image lacks (orjson, typer and rich with their needs,
# pydantic and pydantic-core among them, latex2sympy2_extended, antlr4-python3-runtime 4.11, word2number, gguf,
# psutil), for the machine's Python and platform, which need not be this one's. docs/gpus.md says how to install it
# there without touching the image's torch.
#
#   scripts/wheelhouse.sh OUT [PYTHON_VERSION] [PLATFORMS]   # defaults: 3.12, glibc 2.28's x86_64 (comma list)
#   DRY_RUN=1 scripts/wheelhouse.sh OUT                      # print the commands only
#   WHEELHOUSE_EXTRA="ray datasets" scripts/wheelhouse.sh OUT  # also the optional ones (Ray, Hub datasets, ...)
#
# The list is pyproject.toml's dependencies less IMAGE (what the image has: torch, transformers and what they pull
# in) and less OPTIONAL (imported only by a feature that asks for it). Wheels are downloaded for the target (pip
# download --only-binary :all: --python-version --platform); word2number, which PyPI has as a source archive only,
# and kvrescue are built into pure-Python wheels here. Wheels of IMAGE's distributions that the resolver pulled in
# are removed, so that nothing installed from the wheelhouse shadows the image's own.
set -euo pipefail -o noglob  # IMAGE holds a pattern (nvidia-*) for find, not for the shell
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/wheelhouse.sh OUT [PYTHON_VERSION] [PLATFORMS]}
version=${2:-3.12}
# every manylinux tag the machine's glibc takes: pip matches each --platform exactly
platforms=${3:-manylinux_2_28_x86_64,manylinux_2_17_x86_64,manylinux2014_x86_64}
PYTHON=${PYTHON:-python3}
IMAGE="torch transformers safetensors huggingface-hub hf-xet tokenizers numpy sympy mpmath networkx jinja2 markupsafe
filelock fsspec pyyaml regex requests urllib3 idna certifi charset-normalizer tqdm packaging setuptools triton nvidia-*"
OPTIONAL="datasets accelerate matplotlib ray"
SOURCE_ONLY="word2number"
abi=cp${version/./}

run() { if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi; }

# pyproject's requirements, less IMAGE, OPTIONAL and SOURCE_ONLY (their specifiers kept), plus WHEELHOUSE_EXTRA
mapfile -t wanted < <("$PYTHON" - "$IMAGE $OPTIONAL $SOURCE_ONLY" <<'PY'
import re, sys, tomllib
left_out = {n.lower().replace("_", "-") for n in sys.argv[1].split()}
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9._-]+", requirement).group(0)
    if name.lower().replace("_", "-") not in left_out:
        print(requirement)
PY
)
read -r -a extra <<< "${WHEELHOUSE_EXTRA:-}"
platform_options=()
for p in ${platforms//,/ }; do platform_options+=(--platform "$p"); done

run mkdir -p "$out"
run "$PYTHON" -m pip download --only-binary :all: --python-version "$version" --implementation cp --abi "$abi" \
    "${platform_options[@]}" --dest "$out" "${wanted[@]}" "${extra[@]}"
run "$PYTHON" -m pip wheel --no-deps --wheel-dir "$out" $SOURCE_ONLY .
# what the image has, pulled in as a dependency of something wanted: removed (wheel names: distribution_version-...)
for name in $IMAGE; do
    run find "$out" -maxdepth 1 -iname "$(echo "$name" | tr - _)-*.whl" -delete
done
[ -n "${DRY_RUN:-}" ] || ls "$out"
