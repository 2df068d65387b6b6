"""Folder names and texts from run folders reach the terminal without escapes and spreadsheets without formulas:
report tables, --explain, markdown, LaTeX, CSV and `grade --runs`."""

import io

import pandas as pd
from typer.testing import CliRunner

from kvrescue.cli import app
from kvrescue.printable import csv_text, printable
from tests.report.test_report import write_run

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"   # set the window title, clear the screen, turn red
HOSTILE = f"=HYPERLINK(\"http://x\"){ESCAPES}[bold]run\r\u202e"


def test_printable_shows_control_and_format_characters_as_escapes():
    assert printable(HOSTILE) == '=HYPERLINK("http://x")\\x1b]0;pwned\\x07\\x1b[2J\\x1b[31m[bold]run\\r\\u202e'
    assert printable("accuracy ± 5.0 — ∧ \\boxed") == "accuracy ± 5.0 — ∧ \\boxed"      # printable text stays
    assert [csv_text(t) for t in ("=1+1", "+1", "-1", "@SUM(A1)", "a=1")] == ["'=1+1", "'+1", "'-1", "'@SUM(A1)", "a=1"]


def hostile_root(tmp_path, monkeypatch):
    """A run folder under a folder named HOSTILE, the working folder its parent (paths are shown relative to it)."""
    root = tmp_path / HOSTILE
    write_run(root, "kvrescue", correct={0})
    monkeypatch.chdir(tmp_path)
    return root


def test_report_formats_print_no_escape(tmp_path, monkeypatch):
    root = hostile_root(tmp_path, monkeypatch)
    runner = CliRunner()
    for fmt in ("table", "md", "latex", "csv"):
        done = runner.invoke(app, ["report", HOSTILE, "--format", fmt, "--explain"], env={"COLUMNS": "300"})
        assert done.exit_code == 0, done.output
        assert "\x1b" not in done.output and "\x07" not in done.output and "\u202e" not in done.output, fmt
        assert "\\x1b]0;pwned" in done.output, fmt        # shown, as an escape
    table = runner.invoke(app, ["report", HOSTILE], env={"COLUMNS": "300"}).stdout
    assert "[bold]run" in table                            # a folder name is text, never rich markup
    assert root.exists()


def test_csv_cells_never_start_a_formula(tmp_path, monkeypatch):
    hostile_root(tmp_path, monkeypatch)
    done = CliRunner().invoke(app, ["report", HOSTILE, "--format", "csv"])
    frame = pd.read_csv(io.StringIO(done.stdout))
    folders = frame["folder"].dropna().unique()
    assert len(folders) == 1 and folders[0].startswith("'=HYPERLINK(")
    cells = [str(v) for v in frame.astype(str).to_numpy().ravel()]
    assert not any(c.startswith(("=", "+", "@")) for c in cells)


def test_grade_runs_prints_no_escape(tmp_path, monkeypatch):
    hostile_root(tmp_path, monkeypatch)
    done = CliRunner().invoke(app, ["grade", "--runs", HOSTILE], env={"COLUMNS": "300"})
    assert done.exit_code == 0, done.output
    assert "\x1b" not in done.stderr and "\x07" not in done.stderr
    assert "\\x1b]0;pwned" in done.stderr and "[bold]run" in done.stderr
