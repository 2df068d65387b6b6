"""Ground truth per benchmark: the raw final answer of a record, and its normalised form."""

from __future__ import annotations

from typing import Any

from grader.extract import extract_answer, last_boxed, strip_string

BENCHES = ("math500", "gsm8k", "aime24", "amc23", "olympiadbench")


def raw_answer(record: dict[str, Any], bench: str) -> str:
    """The raw final answer of a benchmark-native record.

    math500: the last `\\boxed{}` content of `solution`; gsm8k: the text after `####` in `answer`;
    aime24: `answer`; amc23: `str(answer)` (a float, so `27.0`); olympiadbench:
    `final_answer[0]` without surrounding `$`; any other bench: `str(answer)`.
    Raises KeyError when the field is missing and ValueError when it has no answer in it.
    """
    if bench == "math500":
        solution = record["solution"]
        if "boxed" not in solution:
            raise ValueError("math500 solution has no \\boxed{} answer")
        return last_boxed(solution)
    if bench == "gsm8k":
        parts = record["answer"].split("####")
        if len(parts) != 2:
            raise ValueError("gsm8k answer must contain '####' exactly once")
        return parts[1]
    if bench == "olympiadbench":
        return record["final_answer"][0].strip("$")
    return str(record["answer"])


def normalise_gt(raw: str, bench: str) -> str:
    """math500: `\\boxed{raw}` through the prediction pipeline; every other bench: two `strip_string` passes."""
    if bench == "math500":
        return strip_string(extract_answer("\\boxed{" + raw + "}"))
    return strip_string(strip_string(raw))
