"""`kvrescue grade`: boxed answers graded, from a JSONL or (`--runs`) from run folders again."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table
from rich.text import Text

from kvrescue.cli.shared import GRADER_HELP, check_output_file, console, one_line_errors, write_jsonl_atomically
from kvrescue.errors import InputError
from kvrescue.printable import printable

MAX_GRADE_WORKERS = 256
MAX_GRADE_TIMEOUT_S = 86400  # a day: far beyond any comparison, and within what the workers' waits can count


@one_line_errors
def grade(
    source: str = typer.Argument("-", help="JSONL of model outputs, or - for stdin"),
    bench: Optional[str] = typer.Option(None, help="grading treatment: math500, gsm8k, aime24, amc23, olympiadbench or "
                                        "generic (needed for JSONL input)"),
    output_field: str = typer.Option("output", help="field holding the model output"),
    gt_field: str = typer.Option("gt", help="field holding the raw answer (else derived from the benchmark's fields)"),
    workers: int = typer.Option(1, min=1, max=MAX_GRADE_WORKERS, help="grading processes (at most one per record "
                                "that needs one)"),
    timeout: float = typer.Option(3.0, help=f"seconds per symbolic comparison (at most {MAX_GRADE_TIMEOUT_S})"),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="write JSONL here instead of stdout"),
    grader: str = typer.Option("qwen", help=GRADER_HELP),
    runs: Optional[list[Path]] = typer.Option(None, "--runs", help="grade these run folders (or folders above them) "
                                              "again instead of a JSONL, without decoding; repeatable"),
) -> None:
    """Grade boxed answers with the Qwen2.5-Math grader logic; JSONL out, a summary table on stderr."""
    from kvrescue.grading import check_bench, grade_records
    from kvrescue.jsonl import read_jsonl

    if not (math.isfinite(timeout) and 0 < timeout <= MAX_GRADE_TIMEOUT_S):
        raise InputError(f"--timeout {timeout}: need a positive number of seconds, at most {MAX_GRADE_TIMEOUT_S}")
    check_output_file(out, "--out")
    if runs:
        if source != "-" or bench is not None:
            raise InputError("--runs grades run folders: give no JSONL and no --bench (each run has its own)")
        return regrade(runs, grader, workers, timeout, out)
    if bench is None:
        raise InputError("--bench is needed to grade a JSONL (math500, gsm8k, aime24, amc23, olympiadbench, generic)")
    check_bench(bench)
    rows = read_jsonl(source)
    name = "<stdin>" if source == "-" else source
    if not rows:
        raise InputError("no records to grade (an empty input)", path=name)
    graded, tally = grade_records(rows, source=name, bench=bench, output_field=output_field,
                                  gt_field=gt_field, workers=workers, timeout=timeout, grader=grader)
    write_jsonl_atomically(graded, out)
    table = Table(title=f"grade: {name} ({bench}, {grader} grader)")
    for column in ("records", "correct", "accuracy", "timeouts", "empty predictions"):
        table.add_column(column, justify="right")
    table.add_row(str(tally.records), str(tally.correct), f"{100 * tally.accuracy:.1f}%", str(tally.timeouts),
                  str(tally.empty))
    console.print(table)


def regrade(runs: list[Path], grader: str, workers: int, timeout: float, out: Path | None) -> None:
    """`kvrescue grade --runs`: the traces graded again, as JSONL, and a table per folder of both verdicts."""
    from kvrescue.grading import regrade_runs
    from kvrescue.report.numbers import agreement

    records, tallies, notes = regrade_runs(runs, grader, workers, timeout)
    for note in notes:
        console.print(f"  {printable(note)}", highlight=False, soft_wrap=True, markup=False)
    write_jsonl_atomically(records, out)
    table = Table(title=f"grade --runs: {grader} against the recorded verdicts")
    for column in ("folder", "recorded", "problems", "recorded acc", f"{grader} acc", "both", "only recorded",
                   f"only {grader}", "neither"):
        table.add_column(column, justify="left" if column in ("folder", "recorded") else "right", overflow="fold")
    for t in tallies:
        n = len(t.pairs)
        acc = lambda i: f"{100 * sum(p[i] for p in t.pairs) / n:.1f}%" if n else "n/a"  # noqa: E731
        table.add_row(Text(printable(t.folder)), Text(printable(t.recorded)), str(n), acc(0), acc(1),
                      *map(str, agreement(t.pairs)))
    console.print(table)
