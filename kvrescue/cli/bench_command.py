"""`kvrescue bench`: the benchmarks, their sizes and where each is read from."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from kvrescue.cli.shared import one_line_errors, stdout
from kvrescue.errors import InputError


@one_line_errors
def bench(
    data_dir: Optional[Path] = typer.Option(None, help="folder holding <bench>.jsonl files (else $KVRESCUE_DATA_DIR, else the bundled copies)"),
    format: str = typer.Option("table", "--format", help="table (rich) or json; on stdout"),
) -> None:
    """List the benchmarks, their sizes and where each is read from (provenance: kvrescue/problem_sets/SOURCES.md)."""
    from kvrescue.data import BENCHES, bench_file, load_problems, source_of
    from kvrescue.data import data_dir as resolve_data_dir
    from kvrescue.jsonl import dumps_line

    if format not in ("table", "json"):
        raise InputError(f"unknown --format '{format}': use table or json")
    folder = resolve_data_dir(data_dir)
    rows = []
    for name, spec in BENCHES.items():
        path = bench_file(name, folder)
        size = spec.size if path is None else None  # None: missing
        if path is not None and path.is_file():
            size = len(load_problems(name, folder=folder).problems)
        rows.append({"bench": name, "problems": size, "problem_field": spec.problem_field, "licence": spec.licence,
                     "source": source_of(name, folder)})
    if format == "json":
        sys.stdout.buffer.write(dumps_line(rows))
        return
    table = Table(title="benchmarks")
    for column in ("bench", "problems", "problem field", "licence", "source"):
        table.add_column(column, justify="right" if column == "problems" else "left",
                         overflow="fold" if column == "source" else "ellipsis")
    for row in rows:
        table.add_row(*(("missing" if v is None else str(v)) for v in row.values()))
    stdout.print(table)
