"""The report's tables (the paper's Tables 1, 2 and 5, Figure 6, oracle, calibration) as raw values."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvrescue.printable import printable
from kvrescue.report.load import FolderNote, Run
from kvrescue.report.numbers import (
    PAPER_ACCURACY, QUANTILES, Row, Table, agreement, budget_rank, find_row, method_rank, quantiles, thresholds,
    group_rows, oracle, recovery, recovery_means,
)
from kvrescue.report.seeds import DEFAULT_KS, seed_metrics


def setup_title(setup: tuple[str, str | None]) -> str:
    scorer, prm = setup
    return f"scorer {scorer}" + (f" ({prm})" if prm and prm != scorer else "")


def row_label(row: Row, rows: list[Row]) -> list[str]:
    """method (with its evictor when not the default), and models when the setup has several."""
    k = row.key
    label = k.method if k.evictor in ("rkv", "none") else f"{k.method}[{k.evictor}]"
    bases = {r.key.base for r in rows if r.key.base}
    helpers = {r.key.helper for r in rows if r.key.helper}
    extra = []
    if len(bases) > 1 and k.base:
        extra.append(f"base={k.base}")
    if len(helpers) > 1 and k.helper:
        extra.append(f"helper={k.helper}")
    return [label + (f" ({', '.join(extra)})" if extra else "")]


def build_tables(runs: list[Run], notes: list[FolderNote], ks: Sequence[int] = DEFAULT_KS) -> list[Table]:
    """Every table of the report, in display order; `ks`: the k of pass@k and maj@k."""
    tables = [runs_table(runs, notes)]
    for setup, rows in group_rows(runs).items():
        title = setup_title(setup)
        tables += [accuracy_table(rows, title), accuracy_table(rows, title, grader=True),
                   vote_table(rows, title), seeds_table(rows, title, ks), graders_table(rows, title),
                   recovery_table(rows, title), recovery_mean_table(rows, title),
                   cost_table(rows, title), token_change_table(rows, title),
                   ablation_table(rows, title), throughput_table(rows, title), helper_share_table(rows, title),
                   oracle_table(rows, title), calibration_table(rows, title)]
    return [t for t in tables if t.rows]


def runs_table(runs: list[Run], notes: list[FolderNote]) -> Table:
    t = Table("runs", "Run folders", ["folder", "bench", "method", "evictor", "N", "budget", "seed", "problems",
                                      "accuracy", "status"],
              ["text", "text", "text", "text", "int", "int", "int", "text", "pct", "text"], keys=7)
    for r in sorted(runs, key=lambda r: str(r.path)):
        s = r.summary
        t.rows.append([shown(r.path), r.config.bench_name(), s.method, s.evictor, s.n, s.budget, s.seed,
                       f"{s.problems}/{s.total if s.total is not None else '?'}", s.accuracy,
                       f"* {r.in_progress}" if r.in_progress else ("synthetic" if s.synthetic else "done")])
    t.notes = [f"{p.path}: {p.message}" for p in notes if not p.message.startswith("in progress:")]
    return t


def shown(path: Path) -> str:
    """A path as the user would type it (relative to the working folder when under it), safe to print."""
    try:
        return printable(str(path.resolve().relative_to(Path.cwd())))
    except ValueError:
        return printable(str(path))


def accuracy_table(rows: list[Row], setup: str, grader: bool = False) -> Table:
    """Rows method x budget, columns benches (Table 5): the paper's "is_correct ∧ \\boxed", or (`grader`) the
    grader's verdict alone, which also takes "the answer is" and the last number."""
    benches = sorted({r.key.bench for r in rows})
    metric = "accuracy" if grader else PAPER_ACCURACY
    title = ("Accuracy by the grader alone (a \\boxed answer, else \"the answer is\", else the last number)" if grader
             else "Accuracy, is_correct ∧ \\boxed (Table 5)")
    t = Table("accuracy_grader" if grader else "accuracy",
              f"{title}, mean ± population std over seeds — {setup}", ["method", "N", "budget", *benches],
              ["text", "int", "int", *["pct"] * len(benches)], keys=3)
    keys = sorted({(r.key.method, r.key.evictor, r.key.n, r.key.budget, r.key.base, r.key.helper) for r in rows},
                  key=lambda k: (method_rank(k[0]), k[0], k[1], k[2], budget_rank(k[3]), k[4] or "", k[5] or ""))
    for method, evictor, n, budget, base, helper in keys:
        cells = [find_row(rows, bench=b, method=method, evictor=evictor, n=n, budget=budget, base=base, helper=helper)
                 for b in benches]
        first = next(c for c in cells if c)
        t.rows.append([*row_label(first, rows), n, budget, *(c.stat(metric) if c else None for c in cells)])
    if any(r.partial for r in rows):
        t.notes.append("* includes runs still in progress")
    if any(r.runs[0].config.synthetic for r in rows):
        t.notes.append("synthetic runs (random checkpoints) report no accuracy")
    return t


def vote_table(rows: list[Row], setup: str) -> Table:
    """The PRM-weighted vote over the last step's solutions beside pass@1 (both by the grader's verdicts), for the
    configurations whose traces record the voters' answers."""
    t = Table("vote", f"PRM-weighted vote over the last step's solutions vs pass@1, by the grader's verdicts, mean ± "
              f"population std over seeds — {setup}", ["bench", "method", "N", "budget", "pass@1", "PRM vote"],
              ["text", "text", "int", "int", "pct", "pct"], keys=4)
    for row in rows:
        if row.stat("vote_accuracy").mean is not None:
            t.rows.append([row.key.bench, *row_label(row, rows), row.key.n, row.key.budget, row.stat("accuracy"),
                           row.stat("vote_accuracy")])
    t.notes.append("voters: the committed candidate of the last step and every other that ended with EOS, each "
                   "weighted by its score (search-and-learn's compute_weighted_pred)")
    return t


def seeds_table(rows: list[Row], setup: str, ks: Sequence[int]) -> Table:
    """avg@n, pass@k and maj@k of every configuration run with two seeds or more (k up to the most seeds)."""
    rows = [r for r in rows if len(r.runs) >= 2 and not r.runs[0].config.synthetic]
    most = max((len(r.runs) for r in rows), default=0)
    ks = [k for k in ks if k <= most]
    t = Table("seeds", f"Over seeds, by the grader's verdicts: avg@n, pass@k, maj@k — {setup}",
              ["bench", "method", "N", "budget", "seeds", "problems", "avg@n",
               *[f"pass@{k}" for k in ks], *[f"maj@{k}" for k in ks]],
              ["text", "text", "int", "int", "int", "int", "pct", *["pct"] * (2 * len(ks))], keys=4)
    for row in rows:
        m = seed_metrics(row, ks)
        t.rows.append([row.key.bench, *row_label(row, rows), row.key.n, row.key.budget, m.seeds, m.problems, m.avg,
                       *(m.pass_at[k] for k in ks), *(m.maj_at[k] for k in ks)])
    if t.rows:
        t.notes += ["over the problems every seed recorded; pass@k: the unbiased estimator (Chen et al. 2021); "
                    "maj@k: majority of k seeds' predictions, ties to the lowest seed's answer, averaged over every "
                    "choice of k seeds; n/a where k exceeds the seeds"]
    if any(r.partial for r in rows):
        t.notes.append("* includes runs still in progress")
    return t


def graders_table(rows: list[Row], setup: str) -> Table:
    """Per configuration and other grader (`--also-grade`): accuracy by each and where they agree."""
    t = Table("graders", f"Cross-grader agreement — {setup}",
              ["bench", "method", "N", "budget", "grader", "other", "problems", "accuracy", "other accuracy",
               "both correct", "only grader", "only other", "neither"],
              ["text", "text", "int", "int", "text", "text", "int", "pct", "pct", "int", "int", "int", "int"], keys=6)
    for row in rows:
        primary = row.runs[0].config.settings.get("grader", "qwen")
        traces = [tr for run in row.runs for tr in run.traces]
        for other in sorted({name for tr in traces for name in tr.graders}):
            pairs = [(bool(tr.correct), bool(tr.graders[other]["correct"])) for tr in traces if other in tr.graders]
            t.rows.append([row.key.bench, *row_label(row, rows), row.key.n, row.key.budget, primary, other, len(pairs),
                           sum(a for a, _ in pairs) / len(pairs), sum(b for _, b in pairs) / len(pairs),
                           *agreement(pairs)])
    if t.rows:
        t.notes.append("problems of every seed whose trace has both verdicts (kvrescue run --also-grade)")
    return t


def recovery_table(rows: list[Row], setup: str) -> Table:
    """Recovery per (evictor, base model, N, budget) and bench, from Table 5's accuracy, and its mean over benches."""
    recs = recovery(rows)
    benches = sorted({r["bench"] for r in recs})
    several = len({r["base"] for r in recs}) > 1
    t = Table("recovery", f"Recovery (A_kvrescue - A_bon) / (A_full - A_bon), A: is_correct ∧ \\boxed — {setup}",
              ["evictor", *(["base"] if several else []), "N", "budget", *benches, "mean"],
              ["text", *(["text"] if several else []), "int", "int", *["pct"] * len(benches), "pct"],
              keys=4 if several else 3)
    settings = sorted({(r["evictor"], r["n"], r["budget"], r["base"]) for r in recs},
                      key=lambda s: (s[0], s[3] or "", s[1], budget_rank(s[2])))
    for evictor, n, budget, base in settings:
        cells = {r["bench"]: r for r in recs if (r["evictor"], r["n"], r["budget"], r["base"]) == (evictor, n, budget, base)}
        vals = [cells[b]["recovery"] if b in cells else None for b in benches]
        known = [v for v in vals if v is not None]
        t.rows.append([evictor, *([base] if several else []), n, budget, *vals,
                       sum(known) / len(known) if known else None])
        for b in benches:
            if b in cells and cells[b]["reason"]:
                t.notes.append(f"n/a {b}, N={n}, B={budget}" + (f", base={base}" if several else "")
                               + f": {cells[b]['reason']}")
    if any(r["in_progress"] for r in recs):
        t.notes.append("* includes runs still in progress")
    return t


def recovery_mean_table(rows: list[Row], setup: str) -> Table:
    """The paper's average recovery per evictor and budget ("87% at B = 64"): over benches, base models and N."""
    t = Table("recovery_mean", f"Average recovery per evictor and budget — {setup}",
              ["evictor", "budget", "base", "settings", "benches", "base models", "N", "recovery"],
              ["text", "int", "text", "text", "int", "int", "text", "pct"], keys=3)
    for m in recovery_means(recovery(rows)):
        t.rows.append([m["evictor"], m["budget"], m["base"] or "all", f"{m['settings']}/{m['of']}", m["benches"],
                       m["bases"], ",".join(map(str, m["ns"])), m["mean"]])
    if t.rows:
        t.notes.append("the mean of the settings' recoveries (one per bench, base model and N with kvrescue, bon and "
                       "full runs), as the paper averages its 20 settings at B = 64; per base model below \"all\"")
    return t


def _pair_rows(rows: list[Row], methods: tuple[str, ...]) -> list[Row]:
    return [r for r in rows if r.key.method in methods]


def _bon_of(rows: list[Row], row: Row) -> Row | None:
    """The bon row a kvrescue or interleave row is compared with: same bench, evictor, N, budget and base model."""
    k = row.key
    return find_row(rows, bench=k.bench, method="bon", evictor=k.evictor, n=k.n, budget=k.budget, base=k.base)


def token_change(rows: list[Row], row: Row) -> float | None:
    """Relative change of base tokens per problem, kvrescue against its bon (Table 1); None without both."""
    bon = _bon_of(rows, row)
    b, kv = (bon.stat("base_tokens").mean if bon else None), row.stat("base_tokens").mean
    return (kv - b) / b if b and kv is not None else None


def cost_table(rows: list[Row], setup: str) -> Table:
    """Decode cost (Table 1): full-KV, bon and kvrescue per budget, and the relative change in base tokens."""
    t = Table("cost", f"Decode cost per problem — {setup}",
              ["bench", "method", "N", "budget", "steps", "output tokens", "base tokens", "helper tokens",
               "Δ base tokens vs bon"],
              ["text", "text", "int", "int", "num", "num", "num", "num", "rel"], keys=4)
    for row in _pair_rows(rows, ("full", "bon", "kvrescue")):
        k = row.key
        t.rows.append([k.bench, *row_label(row, rows), k.n, k.budget, row.stat("mean_steps"),
                       row.stat("mean_output_tokens"), row.stat("base_tokens"), row.stat("helper_tokens"),
                       token_change(rows, row) if k.method == "kvrescue" else None])
    return t


def token_change_table(rows: list[Row], setup: str) -> Table:
    """The paper's "cuts base-model token generation by 43%": per evictor, base model, N and budget, the mean over
    benches of each one's change (Table 1's reading), and beside it the change of the pooled tokens."""
    t = Table("token_change", f"Base tokens, kvrescue vs bon, over benches — {setup}",
              ["evictor", "base", "N", "budget", "benches", "mean Δ base tokens", "pooled Δ base tokens"],
              ["text", "text", "int", "int", "int", "rel", "rel"], keys=4)
    pairs = [(row, _bon_of(rows, row)) for row in rows if row.key.method == "kvrescue"]
    pairs = [(kv, bon) for kv, bon in pairs if token_change(rows, kv) is not None]
    for evictor, base, n, budget in sorted({(kv.key.evictor, kv.key.base, kv.key.n, kv.key.budget) for kv, _ in pairs},
                                           key=lambda s: (s[0], s[1] or "", s[2], budget_rank(s[3]))):
        mine = [(kv, bon) for kv, bon in pairs if (kv.key.evictor, kv.key.base, kv.key.n, kv.key.budget)
                == (evictor, base, n, budget)]
        changes = [token_change(rows, kv) for kv, _ in mine]
        pooled = (sum(kv.stat("base_tokens").mean for kv, _ in mine) / sum(bon.stat("base_tokens").mean for _, bon in mine)
                  - 1)
        t.rows.append([evictor, base, n, budget, len(mine), sum(changes) / len(changes), pooled])
    if t.rows:
        t.notes.append("mean: of the benches' changes (how the paper's -43% at B = 64 is computed, Table 1); pooled: "
                       "total kvrescue base tokens against total bon base tokens per problem")
    return t


def ablation_table(rows: list[Row], setup: str) -> Table:
    """Ablation (Table 2): full-KV, bon, interleave, kvrescue; degeneration over all problems as the table's numbers
    are, and over the incorrect ones as its caption reads."""
    t = Table("ablation", f"Ablation (Table 2) — {setup}",
              ["bench", "method", "N", "budget", "accuracy", "degeneration", "degeneration of incorrect",
               "base tokens", "steps", "early exit"],
              ["text", "text", "int", "int", "pct", "pct", "pct", "num", "num", "pct"], keys=4)
    for row in _pair_rows(rows, ("full", "bon", "interleave", "kvrescue")):
        k = row.key
        t.rows.append([k.bench, *row_label(row, rows), k.n, k.budget, row.stat(PAPER_ACCURACY),
                       row.stat("degeneration_rate"), row.stat("degeneration_rate_incorrect"),
                       row.stat("base_tokens"), row.stat("mean_steps"), row.stat("early_exit_rate")])
    t.notes.append("accuracy: is_correct ∧ \\boxed; degeneration: incorrect trajectories with >= 256 committed steps "
                   "over all problems (how Table 2's numbers count); of incorrect: over the incorrect ones (its "
                   "caption's wording); early exit: share of base candidates stopped by the detector")
    return t


def throughput_table(rows: list[Row], setup: str) -> Table:
    """Throughput (Table 3): problems per minute in the steady state, and each method's ratio to full-KV and bon of
    the same bench, N and base model (the batch is not recorded: report each batch size's runs on their own)."""
    t = Table("throughput", f"Throughput, problems/min after the first problem finished (Table 3) — {setup}",
              ["bench", "method", "N", "budget", "problems/min", "× full", "× bon"],
              ["text", "text", "int", "int", "num", "ratio", "ratio"], keys=4)
    for row in rows:
        k = row.key
        rate = row.stat("steady_throughput_per_min")
        same = dict(bench=k.bench, n=k.n, base=k.base)
        full, bon = find_row(rows, method="full", **same), find_row(rows, method="bon", budget=k.budget, **same)
        ratio = lambda other: (rate.mean / other.stat("steady_throughput_per_min").mean  # noqa: E731
                               if other and rate.mean and other.stat("steady_throughput_per_min").mean else None)
        t.rows.append([k.bench, *row_label(row, rows), k.n, k.budget, rate,
                       ratio(full) if k.method != "full" else None, ratio(bon) if k.method not in ("full", "bon") else None])
    t.notes.append("the problems that finished after the first one, over the time they took (model loading and the "
                   "first problems' start excluded); runs at another batch size belong in another report")
    return t


def helper_share_table(rows: list[Row], setup: str) -> Table:
    """Helper share of committed steps by budget (rows) and N (columns) (Figure 6)."""
    picked = _pair_rows(rows, ("interleave", "kvrescue"))
    ns = sorted({r.key.n for r in picked})
    t = Table("helper_share", f"Helper share of committed steps — {setup}",
              ["bench", "method", "budget", *[f"N={n}" for n in ns]], ["text", "text", "int", *["pct"] * len(ns)],
              keys=3)
    for bench, method, evictor, budget, base, helper in sorted(
            {(r.key.bench, r.key.method, r.key.evictor, r.key.budget, r.key.base, r.key.helper) for r in picked},
            key=lambda k: (k[0], method_rank(k[1]), k[2], budget_rank(k[3]), k[4] or "", k[5] or "")):
        cells = [find_row(picked, bench=bench, method=method, evictor=evictor, budget=budget, n=n, base=base,
                       helper=helper) for n in ns]
        first = next(c for c in cells if c)
        t.rows.append([bench, *row_label(first, rows), budget,
                       *(c.stat("helper_step_share") if c else None for c in cells)])
    return t


def oracle_table(rows: list[Row], setup: str) -> Table:
    recs = oracle(rows)
    t = Table("oracle", f"Oracle of two (bon N=1 or helper N=1 solved it) — {setup}",
              ["bench", "budget", "seeds", "bon", "helper", "oracle", "full", "loss recovered"],
              ["text", "int", "int", "pct", "pct", "pct", "pct", "pct"], keys=2)
    for r in recs:
        t.rows.append([r["bench"], r["budget"], r["seeds"], r["bon"], r["helper_acc"], r["oracle"], r["full"],
                       r["recovered"]])
        if r["reason"]:
            t.notes.append(f"n/a {r['bench']}, B={r['budget']}: {r['reason']}")
    return t


def calibration_table(rows: list[Row], setup: str) -> Table:
    """Quantiles of per-candidate max mean entropy and min gzip ratio, committed vs not."""
    t = Table("calibration", f"Detector calibration (base candidates) — {setup}",
              ["bench", "method", "N", "budget", "statistic", "committed", "count",
               *[f"q{round(100 * q)}" for q in QUANTILES], "threshold", "beyond"],
              ["text", "text", "int", "int", "text", "text", "int", *["ratio"] * len(QUANTILES), "ratio", "pct"],
              keys=6)
    for row in rows:
        run = row.runs[0]
        tau_ent, tau_cmp = thresholds(run)
        cands = [c for r in row.runs for t_ in r.traces for cs in t_.candidates for c in cs if c.source == "base"]
        for stat, tau, beyond in (("max_mean_entropy", tau_ent, lambda v: v > tau_ent),
                                  ("min_gzip_ratio", tau_cmp, lambda v: v < tau_cmp)):
            for committed in (True, False):
                vals = [getattr(c, stat) for c in cands if c.committed == committed and getattr(c, stat) is not None]
                if not vals:
                    continue
                t.rows.append([row.key.bench, *row_label(row, rows), row.key.n, row.key.budget, stat,
                               "yes" if committed else "no",
                               len(vals), *quantiles(vals), tau, sum(map(beyond, vals)) / len(vals)])
    t.notes.append("beyond: share past the threshold (entropy > tau_ent, gzip ratio < tau_cmp)")
    return t
