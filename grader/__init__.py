"""Qwen2.5-Math grading: answer extraction, normalisation and `math_equal`, quirks included.

    from grader import grade, grade_many, raw_answer
    r = grade(output, gt, bench)          # r.correct, r.pred, r.gt, r.timed_out, r.symbolic
    results = grade_many([(output, gt, bench), ...], workers=2)   # same order as the input

`gt` is the raw final answer; `raw_answer(record, bench)` derives it from a benchmark-native record
(math500 `solution`, gsm8k `answer` after `####`, aime24/amc23 `answer`, olympiadbench
`final_answer[0]`). Known benches: `BENCHES`; any other name is graded like gsm8k.

String and numeric comparisons run in the calling process. Comparisons that need sympy run in worker
processes (`grader.sandbox`), each under a hard wall-clock `timeout`; one that overruns is killed,
scores incorrect and reports `timed_out=True`. The workers persist between calls (started on first
need); `shutdown()` stops them.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from grader.equal import math_equal
from grader.extract import cut_at_stop_words, prediction
from grader.ground_truth import BENCHES, normalise_gt, raw_answer
from grader.sandbox import SymbolicPool

__all__ = ["BENCHES", "GradeResult", "grade", "grade_many", "normalise_gt", "raw_answer", "shutdown"]

# Longer pred+gt pairs skip the in-process pass (one of its regexes backtracks cubically on long text)
# and are compared in a worker, under the time limit.
_IN_PROCESS_MAX_CHARS = 1000


@dataclass(frozen=True)
class GradeResult:
    correct: bool
    pred: str  # normalised prediction
    gt: str  # normalised ground truth
    timed_out: bool = False
    symbolic: bool = False  # the verdict needed the sympy path (in a worker process)


class _NeedsSymbolic(Exception):
    pass


def _defer(_a: str, _b: str) -> bool:
    raise _NeedsSymbolic


def _prepare(output: str, gt: str, bench: str) -> GradeResult | tuple[str, str]:
    """A finished result when no sympy is needed, else the normalised (pred, gt) pair to compare."""
    gt_norm = normalise_gt(gt, bench)
    if cut_at_stop_words(output) in ("", "error"):  # the harness keeps no prediction for these
        return GradeResult(False, "", gt_norm)
    pred = prediction(output, gt_norm)
    if len(pred) + len(gt_norm) > _IN_PROCESS_MAX_CHARS:
        return pred, gt_norm
    try:
        return GradeResult(math_equal(pred, gt_norm, _defer), pred, gt_norm)
    except _NeedsSymbolic:
        return pred, gt_norm


_pool = SymbolicPool()
_pool_lock = threading.Lock()
atexit.register(_pool.close)


def grade_many(items: Iterable[tuple[str, str, str]], workers: int = 1, timeout: float = 3.0) -> list[GradeResult]:
    """Grade (output, gt, bench) items; sympy comparisons are spread over `workers` processes."""
    prepared = [_prepare(output, gt, bench) for output, gt, bench in items]
    pending = [i for i, p in enumerate(prepared) if isinstance(p, tuple)]
    if pending:
        with _pool_lock:
            verdicts = _pool.compare([prepared[i] for i in pending], timeout, max(1, workers))
        for i, verdict in zip(pending, verdicts):
            pred, gt_norm = prepared[i]
            prepared[i] = GradeResult(bool(verdict), pred, gt_norm, timed_out=verdict is None, symbolic=True)
    return prepared


def grade(output: str, gt: str, bench: str, timeout: float = 3.0) -> GradeResult:
    """Grade one model output against a raw ground-truth answer for `bench`."""
    return grade_many([(output, gt, bench)], timeout=timeout)[0]


def shutdown() -> None:
    """Stop the sympy worker processes (they restart on the next comparison that needs them)."""
    with _pool_lock:
        _pool.close()
