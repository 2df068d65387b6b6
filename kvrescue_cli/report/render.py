"""The report as text: rich tables, markdown, CSV, JSON, and the accuracy-vs-budget plot."""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson

from kvrescue_cli.files import write_file_atomic
from kvrescue_cli.report.load import FolderNote, ReportError, Run
from kvrescue_cli.report.numbers import Stat, Table, method_rank, group_rows, oracle, recovery
from kvrescue_cli.report.tables import row_label, setup_title

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
    if kind == "pct":
        return f"{100 * value:.1f}"
    if kind == "num":
        return f"{value:.1f}"
    if kind == "ratio":
        return f"{value:.3f}"
    if kind == "rel":
        return f"{100 * value:+.1f}%"
    return str(value)


def _plain(value: Any) -> Any:
    return value.json() if isinstance(value, Stat) else value


def to_json(tables: list[Table], runs: list[Run], notes: list[FolderNote]) -> bytes:
    """The whole report as JSON: tables with raw values (fractions, not percent), recovery, oracle."""
    by_setup = group_rows(runs)
    data = {
        "tables": [{"name": t.name, "title": t.title, "columns": t.columns,
                    "rows": [[_plain(v) for v in row] for row in t.rows], "notes": t.notes} for t in tables],
        "recovery": [rec for rows in by_setup.values() for rec in recovery(rows)],
        "oracle": [rec for rows in by_setup.values() for rec in oracle(rows)],
        "problems": [{"path": p.path, "message": p.message} for p in notes],
    }
    return orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n"


def to_markdown(tables: list[Table]) -> str:
    out = []
    for t in tables:
        out.append(f"### {t.title}\n")
        out.append("| " + " | ".join(t.columns) + " |")
        out.append("|" + "|".join("---" if k == "text" else "---:" for k in t.kinds) + "|")
        for row in t.rows:
            out.append("| " + " | ".join(fmt(v, k).replace("|", "\\|") for v, k in zip(row, t.kinds)) + " |")
        out += [""] + [f"- {n}" for n in t.notes] + ([""] if t.notes else [])
    return "\n".join(out) + "\n"


def to_csv(tables: list[Table]) -> str:
    """One CSV block per table: a `# name: title` line, the header, the rows (percent as in the tables),
    then a blank line. Stats are split into <column> and <column>_std."""
    buf = io.StringIO()
    for t in tables:
        buf.write(f"# {t.name}: {t.title}\n")
        w = csv.writer(buf, lineterminator="\n")
        stat_cols = {i for i, _ in enumerate(t.columns) if any(isinstance(r[i], Stat) for r in t.rows)}
        header = []
        for i, c in enumerate(t.columns):
            header += [c, f"{c}_std", f"{c}_seeds"] if i in stat_cols else [c]
        w.writerow(header)
        for row in t.rows:
            cells = []
            for i, (v, k) in enumerate(zip(row, t.kinds)):
                if i in stat_cols:
                    s = v if isinstance(v, Stat) else Stat(None, None, 0)
                    cells += [_csv_num(s.mean, k), _csv_num(s.std, k), s.seeds]
                else:
                    cells.append(_csv_num(v, k) if k != "text" else v)
            w.writerow(cells)
        buf.write("\n")
    return buf.getvalue()


def _csv_num(v: Any, kind: str) -> Any:
    if v is None:
        return ""
    return round(100 * v, 4) if kind in ("pct", "rel") else v


def print_rich(tables: list[Table], console: Any) -> None:
    """Rich tables (to the given console, normally stderr)."""
    from rich.table import Table as RichTable

    for t in tables:
        rt = RichTable(title=t.title, title_justify="left")
        for c, k in zip(t.columns, t.kinds):
            rt.add_column(c, justify="left" if k == "text" else "right", overflow="fold")
        for row in t.rows:
            rt.add_row(*(fmt(v, k) for v, k in zip(row, t.kinds)))
        console.print(rt)
        for n in t.notes:
            console.print(f"  {n}", highlight=False, soft_wrap=True)


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
