"""Hugging Face's Math-Verify as a second grader (`--grader math-verify`), run only in the confined workers.

Math-Verify parses LaTeX and expressions with sympy, so, as for the Qwen grader's symbolic comparisons, an item
is graded in a killable sandbox worker under the same time limit (its own signal-based timeouts are off: the
parent kills a worker that overruns). The gold answer is the raw final answer in `\\boxed{}`; the prediction is
what Math-Verify extracts from the whole output (its default extraction: LaTeX, boxed first, then expressions).
"""

from __future__ import annotations

import importlib.util
import logging

GRADERS = ("qwen", "math-verify")
INSTALL = "pip install -e '.[math-verify]' (or pip install math-verify)"


def available() -> bool:
    """Whether Math-Verify is installed."""
    return importlib.util.find_spec("math_verify") is not None


def verify_item(output: str, gt: str) -> tuple[bool, str, str]:
    """(correct, pred, gold) by Math-Verify: `pred` and `gold` are the strings it extracted ("" for none)."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # its "timeout is disabled" warnings: ours is the kill
    gold = parse("\\boxed{" + gt + "}", parsing_timeout=None)
    answer = parse(output, parsing_timeout=None)
    correct = bool(gold and answer and verify(gold, answer, timeout_seconds=None))
    return correct, _extracted(answer), _extracted(gold)


def _extracted(parsed: list) -> str:
    """The matched text of a parse (its last element, a string, when anything matched)."""
    return parsed[-1] if parsed and isinstance(parsed[-1], str) else ""
