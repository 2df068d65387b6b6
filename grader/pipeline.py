"""One item's grading from start to finish: extraction, normalisation, comparison.

The same steps run in the calling process (with a stand-in symbolic test that asks for a worker) and
in a sandbox worker (with the sympy test).
"""

from __future__ import annotations

from grader.equal import SymbolicTest, math_equal
from grader.extract import cut_at_stop_words, prediction
from grader.ground_truth import normalise_gt


def normalise(output: str, gt: str, bench: str) -> tuple[str | None, str]:
    """(normalised prediction, normalised gt); the prediction is None when the harness keeps none
    (an empty output, or the literal "error")."""
    gt_norm = normalise_gt(gt, bench)
    if cut_at_stop_words(output) in ("", "error"):
        return None, gt_norm
    return prediction(output, gt_norm), gt_norm


def grade_item(output: str, gt: str, bench: str, symbolic: SymbolicTest) -> tuple[bool, str, str]:
    """(correct, pred, gt_norm) for one model output."""
    pred, gt_norm = normalise(output, gt, bench)
    if pred is None:
        return False, "", gt_norm
    return math_equal(pred, gt_norm, symbolic), pred, gt_norm
