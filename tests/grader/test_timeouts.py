"""Pathological inputs: every comparison ends within its wall-clock limit and never takes a batch down."""

from __future__ import annotations

import time

import pytest

from grader import grade, grade_many

TIMEOUT = 2.0
# Worker start-up (importing sympy) is not counted in the limit; allow for it and for a loaded machine.
BOUND_S = TIMEOUT + 20.0

TOWER = ("\\boxed{9^{9^{9^{9}}}}", "5", "math500")
LONG = ("\\boxed{" + "+".join(f"x_{{{i}}}^{{{i % 7 + 2}}}" for i in range(600))[:5000] + "}", "x", "math500")
UNBALANCED = ("so \\boxed{\\sqrt{\\frac{(}{}}}}}}} and \\frac{1}{2", "\\frac{1}{2}", "math500")
PATHOLOGICAL = {"power_tower": TOWER, "five_thousand_chars": LONG, "unbalanced_braces": UNBALANCED}
# Each case is wrong, and reaches the symbolic comparison. The tower always times out; the unbalanced braces
# fail to parse at once; the long sum times out here but may finish in time on a fast machine.
TIMES_OUT = {"power_tower": True, "five_thousand_chars": None, "unbalanced_braces": False}


@pytest.mark.parametrize("case", sorted(PATHOLOGICAL))
def test_pathological_input_returns_within_bound(case: str) -> None:
    output, gt, bench = PATHOLOGICAL[case]
    start = time.monotonic()
    result = grade(output, gt, bench, timeout=TIMEOUT)
    assert time.monotonic() - start < BOUND_S
    assert result.correct is False and result.symbolic
    if TIMES_OUT[case] is not None:
        assert result.timed_out == TIMES_OUT[case]
    if case == "unbalanced_braces":
        assert result.pred == "\\sqrt{\\frac{(}{}}"  # the last boxed, brace-balanced


def test_power_tower_times_out_and_the_next_comparison_still_works() -> None:
    assert len(LONG[0]) > 5000
    result = grade(*TOWER, timeout=TIMEOUT)
    assert result.timed_out and not result.correct and result.symbolic
    after = grade("\\boxed{x^2+2x+1}", "(x+1)^2", "math500", timeout=TIMEOUT)
    assert after.correct and after.symbolic and not after.timed_out


def test_batch_with_pathological_items_grades_the_rest() -> None:
    good = [
        ("\\boxed{x^2+2x+1}", "(x+1)^2", "math500"),
        ("\\boxed{18}", "18", "gsm8k"),
        ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", "math500"),
        ("\\boxed{0.5}", "\\frac{1}{2}", "math500"),
        ("\\boxed{y^2}", "x^2", "math500"),
    ]
    items = [good[0], TOWER, good[1], LONG, good[2], UNBALANCED, good[3], TOWER, good[4]]
    start = time.monotonic()
    results = grade_many(items, workers=2, timeout=TIMEOUT)
    assert time.monotonic() - start < 3 * BOUND_S
    assert [r.correct for r in results[0::2]] == [True, True, True, True, False]
    assert not any(r.timed_out for r in results[0::2])
    assert results[1].timed_out and results[7].timed_out
