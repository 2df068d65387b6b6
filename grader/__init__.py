"""Qwen2.5-Math grading: answer extraction, normalisation and `math_equal`, quirks included.

    from grader import grade, grade_many, raw_answer
    r = grade(output, gt, bench)          # r.correct, r.pred, r.gt, r.timed_out, r.symbolic
    results = grade_many([(output, gt, bench), ...], workers=2)   # same order as the input
    results = grade_many(items, grader="math-verify")              # Hugging Face's Math-Verify instead

`gt` is the raw final answer; `raw_answer(record, bench)` derives it from a benchmark-native record
(math500 `solution`, gsm8k `answer` after `####`, aime24/amc23 `answer`, olympiadbench
`final_answer[0]`). Known benches: `BENCHES`; any other name is graded like gsm8k.

String and numeric comparisons run in the calling process. Comparisons that need sympy, and whole
items whose output and answer together exceed `IN_PROCESS_MAX_INPUT` characters (so that extraction
too is bounded), run in confined worker processes (`grader.sandbox`), each under a hard wall-clock
`timeout`; one that overruns is killed, scores incorrect and reports `timed_out=True`. With
`grader="math-verify"` every item is graded whole by Math-Verify in a worker (`grader.verify`). No text is ever
evaluated as code: strings no parser accepts are compared as strings only (`grader.symbolic`). The
workers persist between calls (started on first need); `shutdown()` stops them.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from grader.equal import math_equal
from grader.ground_truth import BENCHES, normalise_gt, raw_answer
from grader.pipeline import normalise
from grader.sandbox import Request, SymbolicPool
from grader.verify import GRADERS

__all__ = ["BENCHES", "GRADERS", "GradeResult", "grade", "grade_many", "normal_gt", "normalise_gt", "raw_answer",
           "shutdown"]

# Longer pred+gt pairs skip the in-process pass (one of its regexes backtracks cubically on long text)
# and are compared in a worker, under the time limit.
_IN_PROCESS_MAX_CHARS = 1000
# Longer output+gt pairs are graded whole in a worker (extraction runs at about 2 s per MB of boxed
# text), so that the time limit covers extraction too.
IN_PROCESS_MAX_INPUT = 20_000


@dataclass(frozen=True)
class GradeResult:
    correct: bool
    pred: str  # normalised prediction ("" when a whole-item grading timed out)
    gt: str  # normalised ground truth (likewise)
    timed_out: bool = False  # no verdict within the limit (or the worker died): scored incorrect
    symbolic: bool = False  # graded (at least in part) in a worker process


class _NeedsSymbolic(Exception):
    pass


def _defer(_a: str, _b: str) -> bool:
    raise _NeedsSymbolic


def _prepare(output: str, gt: str, bench: str, grader: str) -> GradeResult | Request:
    """A finished result when no worker is needed, else the worker request that finishes it."""
    if grader == "math-verify":
        return ("verify", output, gt)
    if len(output) + len(gt) > IN_PROCESS_MAX_INPUT:
        return ("grade", output, gt, bench)
    pred, gt_norm = normalise(output, gt, bench)
    if pred is None:
        return GradeResult(False, "", gt_norm)
    if len(pred) + len(gt_norm) > _IN_PROCESS_MAX_CHARS:
        return ("compare", pred, gt_norm)
    try:
        return GradeResult(math_equal(pred, gt_norm, _defer), pred, gt_norm)
    except _NeedsSymbolic:
        return ("compare", pred, gt_norm)


def _finish(request: Request, reply: dict | None) -> GradeResult:
    if request[0] == "compare":
        pred, gt_norm = request[1:]
    else:
        pred, gt_norm = (reply["pred"], reply["gt"]) if reply else ("", "")
    return GradeResult(bool(reply and reply["correct"]), pred, gt_norm, timed_out=reply is None, symbolic=True)


_pool = SymbolicPool()
_pool_lock = threading.Lock()
atexit.register(_pool.close)


def grade_many(items: Iterable[tuple[str, str, str]], workers: int = 1, timeout: float = 3.0,
               grader: str = "qwen") -> list[GradeResult]:
    """Grade (output, gt, bench) items by `grader` (one of GRADERS); worker requests are spread over `workers`
    processes (never more than there are requests)."""
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}: use one of {', '.join(GRADERS)}")
    prepared = [_prepare(output, gt, bench, grader) for output, gt, bench in items]
    pending = [i for i, p in enumerate(prepared) if isinstance(p, tuple)]
    if pending:
        with _pool_lock:
            replies = _pool.run([prepared[i] for i in pending], timeout, max(1, min(workers, len(pending))))
        for i, reply in zip(pending, replies):
            prepared[i] = _finish(prepared[i], reply)
    return prepared


def grade(output: str, gt: str, bench: str, timeout: float = 3.0, grader: str = "qwen") -> GradeResult:
    """Grade one model output against a raw ground-truth answer for `bench`."""
    return grade_many([(output, gt, bench)], timeout=timeout, grader=grader)[0]


def normal_gt(gt: str, bench: str, grader: str = "qwen") -> str:
    """The normal form of a raw ground-truth answer for `bench`, as `grade` reports it (`GradeResult.gt`) under
    `grader`: what a problem that was never decoded records."""
    return grade("", gt, bench, grader=grader).gt


def shutdown() -> None:
    """Stop the sympy worker processes (they restart on the next comparison that needs them)."""
    with _pool_lock:
        _pool.close()
