"""`kvrescue view`: one self-contained HTML file to explore run folders."""

from __future__ import annotations

from pathlib import Path

import typer

from kvrescue.cli.shared import K_HELP, check_output_file, console, one_line_errors, parse_ks
from kvrescue.errors import InputError


@one_line_errors
def view(
    run_dirs: list[Path] = typer.Argument(..., help="run folders, or folders above them (e.g. runs/)"),
    out: Path = typer.Option(Path("runs.html"), "--out", "-o", help="the HTML file to write"),
    candidate_texts: bool = typer.Option(True, help="keep the texts of candidates not committed (most of the page's size)"),
    k: str = typer.Option("1,4,8", "--k", help=K_HELP),
) -> None:
    """One self-contained HTML file (no network) to explore runs: report, problem list, step-by-step trajectories."""
    from kvrescue.view import write_view

    if out.is_dir():
        raise InputError(f"--out {out} is a folder: give the HTML file to write, e.g. {out / 'runs.html'}")
    check_output_file(out, "--out")
    runs, notes = write_view(run_dirs, out, candidate_texts, parse_ks(k))
    for note in notes:
        console.print(f"  {note.path}: {note.message}", highlight=False, soft_wrap=True)
    console.print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB, {len(runs)} runs); open it in a browser",
                  highlight=False)
