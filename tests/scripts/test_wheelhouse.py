"""scripts/wheelhouse.sh's commands (DRY_RUN: nothing downloaded here): binary wheels for the target Python and
platform of what an image with torch and transformers lacks, word2number and kvrescue built here, and the image's own
distributions removed from the wheelhouse."""

import os
import shlex
import subprocess

from tests.helpers import ROOT


def commands(*args: str, **env: str) -> list[list[str]]:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "wheelhouse.sh"), *args], capture_output=True, text=True,
                          env={**os.environ, "DRY_RUN": "1", **env}, check=True)
    return [shlex.split(line) for line in done.stdout.splitlines()]


def test_the_wheelhouse_holds_what_the_image_lacks_for_the_target_python_and_platform(tmp_path):
    mkdir, download, build, *removals = commands(str(tmp_path / "wh"), "3.12")
    assert mkdir == ["mkdir", "-p", str(tmp_path / "wh")]
    at = download.index("download")
    options, wanted = download[at + 1:download.index("--dest")], download[download.index("--dest") + 2:]
    assert " ".join(options) == ("--only-binary :all: --python-version 3.12 --implementation cp --abi cp312 "
                                 "--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 "
                                 "--platform manylinux2014_x86_64")
    assert sorted(wanted) == sorted(["typer>=0.12", "rich>=13", "orjson", "antlr4-python3-runtime==4.11.*",
                                     "latex2sympy2_extended", "gguf", "psutil"])
    assert build[build.index("wheel"):] == ["wheel", "--no-deps", "--wheel-dir", str(tmp_path / "wh"), "word2number", "."]
    removed = {r[r.index("-iname") + 1] for r in removals}
    assert {"torch-*.whl", "transformers-*.whl", "numpy-*.whl", "sympy-*.whl", "nvidia_*-*.whl"} <= removed
    assert not removed & {f"{name}-*.whl" for name in ("typer", "rich", "pydantic", "pydantic_core", "orjson")}


def test_another_python_platform_and_the_optional_packages(tmp_path):
    download = commands(str(tmp_path), "3.11", "manylinux_2_17_aarch64", WHEELHOUSE_EXTRA="ray datasets")[1]
    assert download[download.index("--python-version") + 1] == "3.11" and download[download.index("--abi") + 1] == "cp311"
    assert [download[i + 1] for i, a in enumerate(download) if a == "--platform"] == ["manylinux_2_17_aarch64"]
    assert download[-2:] == ["ray", "datasets"]
