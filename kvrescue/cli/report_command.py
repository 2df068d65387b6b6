"""`kvrescue report`: the paper's tables from run folders, on stdout."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from kvrescue.cli.shared import K_HELP, console, one_line_errors, parse_ks, png_path, stdout
from kvrescue.errors import InputError
from kvrescue.printable import printable


@one_line_errors
def report(
    run_dirs: list[Path] = typer.Argument(..., help="run folders, or folders above them (e.g. runs/)"),
    format: str = typer.Option("table", "--format", help="table (rich), md, latex (booktabs), csv (one tidy "
                               "long-format table) or json; on stdout"),
    plot: Optional[Path] = typer.Option(None, "--plot", help="write accuracy vs budget (Figure 5) to this PNG"),
    k: str = typer.Option("1,4,8", "--k", help=K_HELP),
    explain: bool = typer.Option(False, "--explain", help="then, in words, what each run did: steps committed by "
                                 "each model, the base cache against B, the detector's stops"),
) -> None:
    """The paper's tables (accuracy, recovery, cost, ablation, helper share, oracle, calibration) from run folders."""
    from kvrescue import report as rep

    if format not in ("table", "md", "latex", "csv", "json"):
        raise InputError(f"unknown --format '{format}': use table, md, latex, csv or json")
    if plot is not None:
        plot = png_path(plot, "--plot")
    ks = parse_ks(k)
    runs, notes = rep.load_runs(run_dirs)
    tables = rep.build_tables(runs, notes, ks)
    if plot is not None:  # first: a plot that cannot be written stops the command before any table
        console.print(f"wrote {rep.plot(runs, plot)}", highlight=False)
    if format == "table":
        rep.print_rich(tables, stdout)
    elif format == "json":
        sys.stdout.buffer.write(rep.to_json(tables, runs, notes))
    else:
        sys.stdout.write({"md": rep.to_markdown, "latex": rep.to_latex, "csv": rep.to_csv}[format](tables))
    if format == "csv":  # CSV has no place for the notes: stderr, as the table format prints them
        for table in tables:
            for note in table.notes:
                console.print(f"{table.name}: {printable(note)}", highlight=False, soft_wrap=True, markup=False)
    if explain:
        from kvrescue.report.explain import explain as explain_runs

        for line in explain_runs(runs):
            stdout.print(line, highlight=False, soft_wrap=True, markup=False)
