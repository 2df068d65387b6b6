"""What the explorer page holds: the report (same code and numbers as `kvrescue report`) and every trace.

The page unpacks one index when it opens:
    report      `report.to_json` of the runs, parsed (the numbers `kvrescue report --format json` prints).
    tables      the report's tables as HTML, cells formatted by `report.fmt` (as the rich tables show them).
    plot        accuracy vs budget as inline SVG (`report.plot`), or null with `plot_note` saying why.
    runs        one record per run: id (its index), folder, bench, method, evictor, n, budget, seed,
                scorer, synthetic, in_progress (why it is unfinished, or null), label.
    problems    one record per (bench, idx) seen in any run: bench, idx, problem, gt, gt_norm.
    rows        per run (same order as `runs`), per trace what the problem list shows: idx, correct, stop,
                skip_reason, n_steps, tokens.base, tokens.helper.
    chunk       problems per detail chunk.
    candidate_texts  whether the detail chunks keep the texts of candidates not committed.
The traces themselves travel as detail chunks, unpacked only when a problem page needs them: per run, the
traces with idx // chunk == c, without the problem's text and answer (kept once in `problems`) nor `output`
(the steps joined), and without candidates' texts when the page is asked to be small.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import orjson

from kvrescue import report as rep
from kvrescue.report.seeds import DEFAULT_KS
from kvrescue.outputs import Trace

SHARED_FIELDS = ("problem", "gt", "gt_norm", "output")
CHUNK = 20


def run_label(run: rep.Run) -> str:
    """method[evictor] B=.. N=.. seed=.. (and the PRM's recipe when not the paper's), with a * when the run is in
    progress."""
    c = run.config
    method = c.method if run.evictor in ("rkv", "none") else f"{c.method}[{run.evictor}]"
    budget = "" if c.budget is None else f" B={c.budget}"
    recipe = f" prm:{run.prm_format}" if run.prm_format not in (None, "paper") else ""
    return f"{method}{budget} N={c.n} s{c.seed}{recipe}" + ("*" if run.in_progress else "")


def tables_html(tables: list[rep.Table]) -> str:
    """The report's tables as HTML; every cell is `report.fmt` of the value, escaped."""
    out = []
    for t in tables:
        head = "".join(f"<th>{html.escape(rep.header(c, k))}</th>" for c, k in zip(t.columns, t.kinds))
        body = "".join(
            "<tr>" + "".join(f'<td class="{"text" if k == "text" else "num"}">{html.escape(rep.fmt(v, k))}</td>'
                             for v, k in zip(row, t.kinds)) + "</tr>"
            for row in t.rows)
        notes = "".join(f"<li>{html.escape(n)}</li>" for n in t.notes)
        out.append(f'<section class="report-table" data-name="{html.escape(t.name)}"><h3>{html.escape(t.title)}</h3>'
                   f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
                   + (f"<ul class=\"notes\">{notes}</ul>" if notes else "") + "</section>")
    return "".join(out)


def plot_svg(runs: list[rep.Run]) -> tuple[str | None, str | None]:
    """(the accuracy-vs-budget figure as an <svg> element, None) or (None, why there is none)."""
    try:
        svg = rep.plot_image(runs, "svg").decode("utf-8")
    except rep.ReportError as e:
        return None, str(e)
    return svg[svg.index("<svg"):], None


def trace_record(trace: Trace, candidate_texts: bool = True) -> dict[str, Any]:
    """A trace as the page keeps it: everything but what `problems` holds once (its steps, candidates and
    tokens stay dataclasses, which orjson writes as objects); without candidates' texts unless asked."""
    record = {f.name: getattr(trace, f.name) for f in fields(trace) if f.name not in SHARED_FIELDS}
    if not candidate_texts:
        record["candidates"] = [[replace(c, text=None) for c in cands] for cands in trace.candidates]
    return record


def list_row(trace: Trace) -> dict[str, Any]:
    """What the problem list shows of a trace."""
    return {"idx": trace.idx, "correct": trace.correct, "stop": trace.stop, "skip_reason": trace.skip_reason,
            "n_steps": trace.n_steps, "tokens": {"base": trace.tokens.base, "helper": trace.tokens.helper}}


def detail_chunks(run: rep.Run, candidate_texts: bool = True) -> dict[int, list[dict[str, Any]]]:
    """The run's traces by chunk number (idx // CHUNK), each chunk in idx order."""
    chunks: dict[int, list[dict[str, Any]]] = {}
    for trace in sorted(run.traces, key=lambda t: t.idx):
        chunks.setdefault(trace.idx // CHUNK, []).append(trace_record(trace, candidate_texts))
    return chunks


def page_data(runs: list[rep.Run], notes: list[rep.FolderNote], candidate_texts: bool = True,
              ks: Sequence[int] = DEFAULT_KS) -> dict[str, Any]:
    """The index the page unpacks when it opens, as plain JSON data (see the module docstring)."""
    tables = rep.build_tables(runs, notes, ks)
    svg, plot_note = plot_svg(runs)
    shown: dict[tuple[str, int], dict[str, Any]] = {}
    for run in runs:
        bench = run.config.bench_name()
        for t in run.traces:
            shown.setdefault((bench, t.idx), {"bench": bench, "idx": t.idx, "problem": t.problem, "gt": t.gt,
                                              "gt_norm": t.gt_norm})
    return {
        "report": orjson.loads(rep.to_json(tables, runs, notes)),
        "tables": tables_html(tables),
        "plot": svg,
        "plot_note": plot_note,
        "runs": [{"id": i, "folder": rep.shown(run.path), "bench": run.config.bench_name(),
                  "method": run.config.method, "evictor": run.config.evictor, "n": run.config.n,
                  "budget": run.config.budget, "seed": run.config.seed, "scorer": run.config.scorer,
                  "synthetic": run.config.synthetic, "in_progress": run.in_progress, "label": run_label(run)}
                 for i, run in enumerate(runs)],
        "problems": [shown[key] for key in sorted(shown)],
        "rows": [[list_row(t) for t in sorted(run.traces, key=lambda t: t.idx)] for run in runs],
        "chunk": CHUNK,
        "candidate_texts": candidate_texts,
    }
