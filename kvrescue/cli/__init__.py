"""The `kvrescue` command line: thin Typer commands over the package's modules, one module per command.

A command's product (JSONL, report, bench, cost) goes to stdout or files; progress, logs and errors to stderr.
"""

from __future__ import annotations

import typer

from kvrescue.cli.bench_command import bench
from kvrescue.cli.cost_command import cost
from kvrescue.cli.grade_command import grade
from kvrescue.cli.report_command import report
from kvrescue.cli.run_command import RUN_PANELS, num, pct, run, summary_table
from kvrescue.cli.run_config import run_option_kinds
from kvrescue.cli.shared import DEFAULT_MODELS, fit_consoles
from kvrescue.cli.view_command import view

__all__ = ["DEFAULT_MODELS", "RUN_PANELS", "app", "cost", "num", "pct", "run", "run_option_kinds", "summary_table"]

app = typer.Typer(help="KV-Rescue batch evaluation", no_args_is_help=True, add_completion=False,
                  context_settings={"help_option_names": ["-h", "--help"]})


def _print_version(value: bool) -> None:
    """--version: the installed package's version, then exit."""
    if value:
        from importlib.metadata import version

        print(f"kvrescue {version('kvrescue')}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="print the version and exit"),
) -> None:
    """kvrescue: evicted-KV reasoning with a full-context helper and a PRM."""
    fit_consoles()


for command in (grade, bench, run, report, view, cost):  # the order `kvrescue --help` lists them in
    app.command()(command)
