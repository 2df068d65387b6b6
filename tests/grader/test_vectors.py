"""The 141 worked vectors from running the official Qwen2.5-Math code (tests/data/grader_vectors.jsonl)."""

from __future__ import annotations

import json

import pytest

from grader import GradeResult, grade_many
from tests.helpers import ROOT

VECTORS_PATH = ROOT / "tests" / "data" / "grader_vectors.jsonl"

VECTORS = [json.loads(line) for line in VECTORS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def results() -> dict[str, GradeResult]:
    graded = grade_many([(v["output"], v["gt"], v["bench"]) for v in VECTORS], workers=2)
    return {v["id"]: r for v, r in zip(VECTORS, graded)}


def test_all_vectors_present() -> None:
    assert len(VECTORS) == 141


@pytest.mark.parametrize("vector", VECTORS, ids=[v["id"] for v in VECTORS])
def test_vector(vector: dict, results: dict[str, GradeResult]) -> None:
    result = results[vector["id"]]
    assert not result.timed_out, vector["why"]
    assert result.correct == vector["expected"], vector["why"]
    if "pred_norm" in vector:
        assert result.pred == vector["pred_norm"], vector["why"]
    if "gt_norm" in vector:
        assert result.gt == vector["gt_norm"], vector["why"]
