"""`math_equal`: is a normalised prediction equal to a normalised ground truth?

Qwen2.5-Math `evaluation/grader.py` behaviour: exact string, choice letter, numeric (relative tolerance
1e-4, also against gt/100 and gt*100), bracket-insensitive string, element-wise tuples/intervals and
matrices, equations, and finally symbolic equality. The symbolic test is passed in, so the cheap paths
can run in-process with a stand-in that asks for a sandboxed retry (see `grader.sandbox`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

SymbolicTest = Callable[[str, str], bool]

_LIST = re.compile(r"(\(|\[).+(\)|\])")
_MATRIX_OPEN = ("\\begin{pmatrix}", "\\begin{bmatrix}")
_MATRIX_CLOSE = ("\\end{pmatrix}", "\\end{bmatrix}")


def numeric_equal(prediction: float, reference: float) -> bool:
    return math.isclose(reference, prediction, rel_tol=1e-4)


def parse_digits(text: str) -> float | None:
    """A float from `text` with commas ignored; `x%` (or `x\\%`) reads as x/100. None when not a number."""
    text = text.replace(",", "")
    try:
        return float(text)
    except ValueError:
        pass
    if text.endswith("%"):
        text = text[:-1].removesuffix("\\")
        try:
            return float(text) / 100
        except ValueError:
            pass
    return None


def _choice_letter(text: str) -> str:
    """The last standalone choice letter in `text`, or `text` itself, trimmed."""
    text = text.strip("\n").rstrip(".").rstrip("/").strip(" ").lstrip(":")
    letters = re.findall(r"\b(A|B|C|D|E)\b", text.upper())
    pick = letters[-1] if letters else text.strip().strip(".")
    return pick.rstrip(".").rstrip("/")


def _braced_rows_to_pmatrix(text: str) -> str:
    r"""`{1,2}` -> `\begin{pmatrix}1\2\end{pmatrix}`: a gt written as a brace list against a matrix pred."""
    found = re.findall(r"\{.*,.*\}", text.strip())
    return ", ".join(
        "\\begin{pmatrix}" + m.strip("{}").replace(",", "\\") + "\\end{pmatrix}" for m in found
    )


def _is_matrix(text: str) -> bool:
    return text.startswith(_MATRIX_OPEN) and text.endswith(_MATRIX_CLOSE)


def _matrix_rows(text: str) -> list[str]:
    body = text[len("\\begin{pmatrix}") : -len("\\end{pmatrix}")]
    return [row.strip() for row in body.split("\\\\") if row.strip()]


def _matrices_equal(prediction: str, reference: str, symbolic: SymbolicTest) -> bool:
    pred_rows, ref_rows = _matrix_rows(prediction), _matrix_rows(reference)
    if len(pred_rows) != len(ref_rows):
        return False
    for pred_row, ref_row in zip(pred_rows, ref_rows):
        pred_cells, ref_cells = pred_row.split("&"), ref_row.split("&")
        if len(pred_cells) != len(ref_cells):
            return False
        if not all(math_equal(p, r, symbolic) for p, r in zip(pred_cells, ref_cells)):
            return False
    return True


def _short_lhs_equation(text: str) -> bool:
    return text.count("=") == 1 and len(text.split("=")[0].strip()) <= 2


def _as_difference(equation: str) -> str:
    lhs, rhs = equation.split("=")
    return f"{lhs.strip()} - ({rhs.strip()})"


def math_equal(prediction: str, reference: str, symbolic: SymbolicTest) -> bool:
    """The reference `math_equal(prediction, reference)` with its defaults (percentages, tolerance)."""
    if prediction.strip().lower() == reference.strip().lower():
        return True
    if reference in ("A", "B", "C", "D", "E") and _choice_letter(prediction) == reference:
        return True

    pred_num, ref_num = parse_digits(prediction), parse_digits(reference)
    if pred_num is not None and ref_num is not None:
        return any(numeric_equal(pred_num, r) for r in (ref_num / 100, ref_num, ref_num * 100))

    if not prediction:
        return False
    reference, prediction = reference.strip(), prediction.strip()
    if "pmatrix" in prediction and "pmatrix" not in reference:
        reference = _braced_rows_to_pmatrix(reference)

    # Bracket-insensitive string match: outer brackets go (unless they could be an interval's other
    # end), then every (){} anywhere; "\frac{12}{3}" and "\frac{1}{23}" collide, as in the reference.
    pred_str, ref_str = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_str, ref_str = pred_str.strip("[]()"), ref_str.strip("[]()")
    for bracket in "{}()":
        pred_str, ref_str = pred_str.replace(bracket, ""), ref_str.replace(bracket, "")
    if pred_str.lower() == ref_str.lower():
        return True

    # Tuples and intervals, element by element (bracket kinds are not compared).
    if _LIST.match(prediction) and _LIST.match(reference):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and all(
            math_equal(p, r, symbolic) for p, r in zip(pred_parts, ref_parts)
        ):
            return True
    if _is_matrix(prediction) and _is_matrix(reference) and _matrices_equal(prediction, reference, symbolic):
        return True

    if prediction.count("=") == 1 and reference.count("=") == 1:
        pred_eq, ref_eq = _as_difference(prediction), _as_difference(reference)
        if symbolic(pred_eq, ref_eq) or symbolic(f"-({pred_eq})", ref_eq):
            return True
    elif _short_lhs_equation(prediction) and "=" not in reference:
        if math_equal(prediction.split("=")[1], reference, symbolic):
            return True
    elif _short_lhs_equation(reference) and "=" not in prediction:
        if math_equal(prediction, reference.split("=")[1], symbolic):
            return True

    return symbolic(prediction, reference)
