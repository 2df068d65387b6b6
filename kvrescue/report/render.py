"""The report as text: rich tables, markdown, LaTeX, CSV, JSON, and the accuracy-vs-budget plot.

Units: one per format, named where the numbers are. Tables, markdown, LaTeX and CSV give shares and relative changes
in percent (their headers, or the CSV's `unit` column, say `%`); JSON gives them as fractions (each table's `units`).
Every text taken from run folders is printed through `printable` (no terminal escapes); CSV text cells also through
`csv_text` (no spreadsheet formulas).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from kvrescue.files import write_file_atomic
from kvrescue.printable import csv_text, printable
from kvrescue.report.load import FolderNote, ReportError, Run
from kvrescue.report.numbers import Stat, Table, method_rank, group_rows, oracle, recovery
from kvrescue.report.tables import row_label, setup_title

PLOT_COLORS = {"full": "black", "helper": "dimgray", "bon": "tab:blue", "interleave": "tab:orange",
               "kvrescue": "tab:red"}


def fmt(value: Any, kind: str) -> str:
    """A cell as text; Stat as mean ± std (seeds) with * when in progress."""
    if isinstance(value, Stat):
        if value.mean is None:
            return "n/a" + ("*" if value.partial else "")
        text = fmt(value.mean, kind)
        if value.std is not None:
            text += f" ± {fmt(value.std, kind).rstrip('%')}"
        return text + ("*" if value.partial else "")
    if value is None:
        return "n/a" if kind != "int" else "—"
    if kind == "text":
        return printable(str(value))
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "num":
        return f"{value:.1f}"
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "rel":
        return f"{100 * value:+.1f}"
    return str(value)


PERCENT_KINDS = ("pct", "rel")
JSON_UNITS = {"pct": "fraction", "rel": "relative change, fraction"}


def header(column: str, kind: str) -> str:
    """A column's header in the text formats: its unit named where its numbers are in percent."""
    return f"{column} (%)" if kind in PERCENT_KINDS else column


def _plain(value: Any) -> Any:
    return value.json() if isinstance(value, Stat) else value


def to_json(tables: list[Table], runs: list[Run], notes: list[FolderNote]) -> bytes:
    """The whole report as JSON: tables with raw values (fractions, not percent: each table's `units` says which
    columns), recovery, oracle."""
    by_setup = group_rows(runs)
    data = {
        "tables": [{"name": t.name, "title": t.title, "columns": t.columns,
                    "units": [JSON_UNITS.get(k) for k in t.kinds],
                    "rows": [[_plain(v) for v in row] for row in t.rows], "notes": t.notes} for t in tables],
        "recovery": [rec for rows in by_setup.values() for rec in recovery(rows)],
        "oracle": [rec for rows in by_setup.values() for rec in oracle(rows)],
        "problems": [{"path": p.path, "message": p.message} for p in notes],
    }
    return orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n"


def to_markdown(tables: list[Table]) -> str:
    out = []
    for t in tables:
        out.append(f"### {_md(t.title)}\n")
        out.append("| " + " | ".join(_md(header(c, k)) for c, k in zip(t.columns, t.kinds)) + " |")
        out.append("|" + "|".join("---" if k == "text" else "---:" for k in t.kinds) + "|")
        for row in t.rows:
            out.append("| " + " | ".join(_md(fmt(v, k)) for v, k in zip(row, t.kinds)) + " |")
        out += [""] + [f"- {_md(n)}" for n in t.notes] + ([""] if t.notes else [])
    return "\n".join(out) + "\n"


def _md(text: str) -> str:
    return printable(text).replace("|", "\\|")


LATEX_SPECIALS = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_",
                  "{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "±": r"$\pm$",
                  "∧": r"$\wedge$", "Δ": r"$\Delta$", "×": r"$\times$", "—": "---"}


def _tex(text: str) -> str:
    return "".join(LATEX_SPECIALS.get(ch, ch) for ch in printable(text))


def to_latex(tables: list[Table]) -> str:
    """One booktabs `table` per report table (needs `\\usepackage{booktabs}`); notes as `%` comments after it."""
    out = []
    for t in tables:
        align = "".join("l" if k == "text" else "r" for k in t.kinds)
        out += ["\\begin{table}[t]", "\\centering", f"\\caption{{{_tex(t.title)}}}",
                f"\\begin{{tabular}}{{{align}}}", "\\toprule",
                " & ".join(_tex(header(c, k)) for c, k in zip(t.columns, t.kinds)) + " \\\\", "\\midrule"]
        out += [" & ".join(_tex(fmt(v, k)) for v, k in zip(row, t.kinds)) + " \\\\" for row in t.rows]
        out += ["\\bottomrule", "\\end{tabular}", "\\end{table}"]
        out += [f"% {printable(n)}" for n in t.notes] + [""]
    return "\n".join(out)


CSV_COLUMNS = ("table", "row", "metric", "value", "std", "seeds", "unit", "text")


def to_csv(tables: list[Table]) -> str:
    """One tidy CSV (long format, `pandas.read_csv` loads it): a line per table row and value column, with the
    row's keys in columns of their own (the union over tables, empty where a table has no such key), the value
    (percent where `unit` is `%`), and for a mean over seeds its std and seed count; a value that is text (a run's
    status) is in `text`, so that `value` stays numeric. Notes go to stderr."""
    keys = list(dict.fromkeys(c for t in tables for c in t.columns[:t.keys]))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*CSV_COLUMNS[:2], *keys, *CSV_COLUMNS[2:]])
    for t in tables:
        for i, row in enumerate(t.rows):
            named = dict(zip(t.columns[:t.keys], row[:t.keys]))
            key_cells = [_csv_cell(named.get(k), "text" if isinstance(named.get(k), str) else "int") for k in keys]
            for column, kind, value in zip(t.columns[t.keys:], t.kinds[t.keys:], row[t.keys:]):
                stat = value if isinstance(value, Stat) else None
                text = isinstance(value, str)
                cells = ([_csv_cell(stat.mean, kind), _csv_cell(stat.std, kind), stat.seeds] if stat
                         else ["" if text else _csv_cell(value, kind), "", ""])
                w.writerow([t.name, i, *key_cells, csv_text(column), *cells, "%" if kind in PERCENT_KINDS else "",
                            _csv_cell(value, "text") if text else ""])
    return buf.getvalue()


def _csv_cell(v: Any, kind: str) -> Any:
    if v is None:
        return ""
    if kind == "text" or isinstance(v, str):
        return csv_text(str(v))
    return round(100 * v, 4) if kind in PERCENT_KINDS else v


def print_rich(tables: list[Table], console: Any) -> None:
    """Rich tables (to the given console); every text is plain text, never rich markup."""
    from rich.table import Table as RichTable
    from rich.text import Text

    for t in tables:
        rt = RichTable(title=Text(printable(t.title)), title_justify="left")
        for c, k in zip(t.columns, t.kinds):
            rt.add_column(Text(printable(header(c, k))), justify="left" if k == "text" else "right", overflow="fold")
        for row in t.rows:
            rt.add_row(*(Text(fmt(v, k)) for v, k in zip(row, t.kinds)))
        console.print(rt)
        for n in t.notes:
            console.print(f"  {printable(n)}", highlight=False, soft_wrap=True, markup=False)


MIN_ACCURACY_SPAN = 10.0  # percentage points: an axis over equal accuracies still reads as a scale


def plot(runs: list[Run], out: Path) -> Path:
    """Write `plot_image` to `out` atomically (a regular file or absent, never through a link), in the format
    its suffix names."""
    write_file_atomic(out, plot_image(runs, out.suffix.lstrip(".").lower() or "png"))
    return out


def plot_image(runs: list[Run], image_format: str) -> bytes:
    """`accuracy_figure(runs)` as a `image_format` (png, svg) image."""
    import matplotlib.pyplot as plt

    fig = accuracy_figure(runs)
    image = io.BytesIO()
    fig.savefig(image, format=image_format, dpi=120)
    plt.close(fig)
    return image.getvalue()


def accuracy_limits(low: float, high: float) -> tuple[float, float]:
    """The accuracy axis: the data's range within 0-100 %, at least MIN_ACCURACY_SPAN points wide."""
    low, high = max(0.0, low), min(100.0, high)
    grow = max(0.0, MIN_ACCURACY_SPAN - (high - low)) / 2
    low, high = low - grow, high + grow
    shift = max(0.0, -low) - max(0.0, high - 100.0)  # slide a widened axis back inside 0-100
    return max(0.0, low + shift), min(100.0, high + shift)


def accuracy_figure(runs: list[Run]):
    """Accuracy vs budget per bench (Figure 5): a line per method, dashed full, dotted helper. Every text is plain
    text: a `$` in a model id is a dollar sign, never mathtext."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    groups = group_rows([r for r in runs if not r.config.synthetic])
    rows = [(setup, row) for setup, rs in groups.items() for row in rs]
    benches = sorted({row.key.bench for _, row in rows})
    if not benches:
        raise ReportError("nothing to plot: no run with an accuracy (synthetic runs have none)")
    fig, axes = plt.subplots(1, len(benches), figsize=(5.5 * len(benches), 4.2), squeeze=False)
    several = len(groups) > 1
    ns = sorted({row.key.n for _, row in rows})
    for ax, bench in zip(axes[0], benches):
        mine = [(s, r) for s, r in rows if r.key.bench == bench]
        curves: dict[tuple[str, str, int], list[tuple[int | None, Stat]]] = defaultdict(list)
        for setup, row in mine:
            label = row_label(row, [r for _, r in mine])[0] + (f" N={row.key.n}" if len(ns) > 1 else "") + \
                (f" [{setup_title(setup)}]" if several else "")
            curves[(label, row.key.method, row.key.n)].append((row.key.budget, row.stat("accuracy")))
        for (label, method, n), points in sorted(curves.items(), key=lambda kv: (method_rank(kv[0][1]), kv[0])):
            color = PLOT_COLORS.get(method)
            acc = points[0][1]
            if method in ("full", "helper"):
                if acc.mean is not None:
                    ax.axhline(100 * acc.mean, linestyle="--" if method == "full" else ":", color=color,
                               linewidth=1.2, label=label + (" *" if acc.partial else ""))
                continue
            pts = sorted((b, s) for b, s in points if b is not None and s.mean is not None)
            if pts:
                ax.errorbar([b for b, _ in pts], [100 * s.mean for _, s in pts],
                            yerr=[100 * (s.std or 0) for _, s in pts], color=color, capsize=3,
                            marker="osD^v<>"[ns.index(n) % 7],
                            label=label + (" *" if any(s.partial for _, s in pts) else ""))
        budgets = sorted({r.key.budget for _, r in mine if r.key.budget is not None})
        if budgets:
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_title(bench)
        ax.set_xlabel("KV budget B")
        ax.set_ylabel("accuracy (%)")
        ax.set_ylim(*accuracy_limits(*ax.get_ylim()))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for text in fig.findobj(Text):
        text.set_parse_math(False)
    fig.tight_layout()
    return fig
