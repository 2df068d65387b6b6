"""Grading JSONL records of model outputs: the logic behind `kvrescue grade`."""

from __future__ import annotations

from dataclasses import dataclass

from grader import grade_many
from kvrescue_cli.data import BENCHES, GENERIC, raw_gt
from kvrescue_cli.errors import InputError
from kvrescue_cli.jsonl import require_field

GRADING_BENCHES = (*BENCHES, GENERIC)


@dataclass
class GradeTally:
    """What the summary table shows."""

    records: int = 0
    correct: int = 0
    timeouts: int = 0
    empty: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.records if self.records else 0.0


def check_bench(bench: str) -> None:
    """Refuse a grading treatment the grader does not define."""
    if bench not in GRADING_BENCHES:
        raise InputError(f"unknown bench '{bench}': use one of {', '.join(GRADING_BENCHES)}")


def grade_records(
    rows: list[tuple[int, dict]],
    *,
    source: str,
    bench: str,
    output_field: str = "output",
    gt_field: str = "gt",
    workers: int = 1,
    timeout: float = 3.0,
) -> tuple[list[dict], GradeTally]:
    """Each record plus pred, gt_norm, correct and timed_out; every record is checked before any is graded.

    The raw answer comes from `gt_field` when the record has it, otherwise from the benchmark's own
    fields (gsm8k `answer`, math500 `solution`, ...) as DESIGN section 6 defines.
    """
    check_bench(bench)
    items = []
    for line, record in rows:
        output = require_field(record, output_field, source, line)
        if not isinstance(output, str):
            raise InputError(f"field '{output_field}' is not a string", path=source, line=line)
        items.append((output, raw_gt(record, bench, gt_field, source, line), bench))
    results = grade_many(items, workers=workers, timeout=timeout)
    tally = GradeTally()
    graded = []
    for (_, record), result in zip(rows, results):
        graded.append({**record, "pred": result.pred, "gt_norm": result.gt, "correct": result.correct,
                       "timed_out": result.timed_out})
        tally.records += 1
        tally.correct += result.correct
        tally.timeouts += result.timed_out
        tally.empty += not result.pred
    return graded, tally
