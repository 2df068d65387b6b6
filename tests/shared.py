"""Where the sibling ../shared folder (benchmarks, grader vectors) is; tests that need it skip without it."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
BENCHMARKS = SHARED / "benchmarks"


def need_shared(path: Path = SHARED) -> Path:
    """`path`, or skip the calling test with the reason it is missing."""
    if not path.exists():
        pytest.skip(f"{path} is not present (tests read ../shared beside the repository)")
    return path
