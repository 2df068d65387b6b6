"""`kvrescue report`: the paper's tables and Figure 5 from run folders.

Every number is computed from traces with `outputs.summarize` (summary.json is not trusted, only used
to tell finished runs from running or interrupted ones). Conventions:
- A *row* aggregates the seeds of one configuration (bench, method, evictor, N, budget, models,
  scorer); its value is the mean over seeds of each run's number, with the sample standard deviation
  (n - 1) where there are two seeds or more.
- Runs still in progress (no summary.json, fewer problems than selected, or traces newer than the
  summary) are included and marked with `*`.
- Recovery = (A_kvrescue - A_bon) / (A_full - A_bon) for the same bench, N, budget, evictor and
  base model (full: same bench, N and base model); it is n/a, with the reason, when one is missing.
- Oracle-of-two: per seed present in both, a problem counts correct when `bon` (N = 1) or `helper`
  (N = 1) solved it, over the problems both recorded; the share of the eviction loss it recovers is
  (A_oracle - A_bon) / (A_full - A_bon) with `full` at N = 1.
"""

from __future__ import annotations

import csv
import io
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import orjson

from kvrescue_cli.errors import InputError
from kvrescue_cli.outputs import (
    CONFIG, SUMMARY, TRACES, RunConfig, RunFolderError, Summary, Trace, read_json, read_traces, summarize,
)

METHOD_ORDER = ("full", "helper", "bon", "interleave", "kvrescue")
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
DEFAULT_TAU_ENT, DEFAULT_TAU_CMP = 7.0, 0.18
PLOT_COLORS = {"full": "black", "helper": "dimgray", "bon": "tab:blue", "interleave": "tab:orange",
               "kvrescue": "tab:red"}


class ReportError(InputError):
    """Nothing to report on; the message is one line."""


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run folder, read back."""

    path: Path
    config: RunConfig
    traces: list[Trace]
    summary: Summary
    in_progress: str | None  # why it is not finished, or None
    shard: tuple[int, int] | None = None  # (i, k) of a `--shard i/k` run, or None

    @property
    def base(self) -> str | None:
        return self.config.models["base"].id if "base" in self.config.models else None

    @property
    def helper(self) -> str | None:
        return self.config.models["helper"].id if "helper" in self.config.models else None

    @property
    def setup(self) -> tuple[str, str | None]:
        """What every compared run must share: the scorer (and PRM model)."""
        prm = self.config.models.get("prm")
        return self.config.scorer, prm.id if prm else None

    @property
    def row(self) -> RowKey:
        c = self.config
        return RowKey(c.bench_name(), c.method, c.evictor, c.n, c.budget, self.base if c.method != "helper" else None,
                      self.helper if c.method in ("kvrescue", "interleave", "helper") else None)


@dataclass(frozen=True)
class RowKey:
    """A configuration without its seed; `bench` is the bench's name (a JSONL path's file stem)."""

    bench: str
    method: str
    evictor: str
    n: int
    budget: int | None
    base: str | None
    helper: str | None


@dataclass
class Problem:
    """A folder that could not be used, or a caveat about one."""

    path: str
    message: str


def find_run_folders(paths: Iterable[Path | str]) -> tuple[list[Path], list[Problem]]:
    """Run folders among `paths` (a run folder, or any folder above some)."""
    found: list[Path] = []
    problems: list[Problem] = []
    for p in map(Path, paths):
        if not p.exists():
            problems.append(Problem(str(p), "no such file or folder"))
        elif not p.is_dir():
            problems.append(Problem(str(p), "not a folder (give run folders or folders above them)"))
        elif (p / CONFIG).exists() or (p / TRACES).exists():
            found.append(p)
        else:
            below = sorted({q.parent for pattern in (CONFIG, TRACES) for q in p.rglob(pattern)})
            if below:
                found += below
            else:
                problems.append(Problem(str(p), "no run folders here (no config.json or traces.jsonl below it)"))
    return list(dict.fromkeys(found)), problems


def load_run(path: Path) -> tuple[Run | None, list[Problem]]:
    """Read one run folder without modifying it; problems are returned, not raised."""
    notes: list[Problem] = []
    try:
        stored = read_json(path / CONFIG)
        config = RunConfig.from_dict(stored["config"])
    except RunFolderError as e:
        return None, [Problem(str(path), f"unusable run folder: {e}")]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        return None, [Problem(str(path), f"unusable run folder: {path / CONFIG} is not a kvrescue config ({e})")]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            traces = read_traces(path / TRACES)
    except RunFolderError as e:
        return None, [Problem(str(path), f"unusable run folder: {e}")]
    notes += [Problem(str(path), str(w.message)) for w in caught]
    if not traces:
        return None, notes + [Problem(str(path), "no finished problems yet (traces.jsonl empty or missing)")]
    total = stored.get("run", {}).get("total")
    summary = summarize(traces, config, total)
    in_progress = None
    if not (path / SUMMARY).exists():
        in_progress = f"no summary.json: running or interrupted ({summary.problems} problems so far)"
    elif total is not None and summary.problems < total:
        in_progress = f"{summary.problems} of {total} problems"
    else:
        try:
            written = read_json(path / SUMMARY).get("problems")
        except RunFolderError:
            written = None
        if written != summary.problems:
            in_progress = f"summary.json is stale ({written} problems, traces hold {summary.problems})"
    if in_progress:
        notes.append(Problem(str(path), f"in progress: {in_progress}"))
    shard = stored.get("run", {}).get("shard")
    return Run(path, config, traces, summary, in_progress, tuple(shard) if shard else None), notes


def merge_shards(runs: list[Run]) -> tuple[list[Run], list[Problem]]:
    """Shards of one configuration (same identity, `--shard i/k` with the same k) become one run.

    The merged run holds the union of the shards' traces (an idx recorded twice counts once), its total
    is the sum of the shards' totals, and it is in progress while a shard is missing or unfinished.
    A second folder of the same shard is left as it is (the duplicate check reports it).
    """
    merged: list[Run] = []
    notes: list[Problem] = []
    groups: dict[tuple[str, int], dict[tuple[int, int], Run]] = {}
    for run in runs:
        if run.shard is None or run.shard in groups.setdefault((run.config.digest(), run.shard[1]), {}):
            merged.append(run)
        else:
            groups[(run.config.digest(), run.shard[1])][run.shard] = run
    for (_, k), shards in groups.items():
        parts = [shards[key] for key in sorted(shards)]
        if len(parts) == 1 and k == 1:
            merged.append(parts[0])
            continue
        traces = list({t.idx: t for part in reversed(parts) for t in part.traces}.values())
        totals = [part.summary.total for part in parts]
        total = None if None in totals else sum(totals)
        summary = summarize(traces, parts[0].config, total)
        missing = sorted(set(range(k)) - {i for i, _ in shards})
        waiting = [f"shard {part.shard[0]}/{k}: {part.in_progress}" for part in parts if part.in_progress]
        if missing:
            waiting.insert(0, f"shards {', '.join(f'{i}/{k}' for i in missing)} missing")
        run = Run(parts[0].path, parts[0].config, traces, summary, "; ".join(waiting) or None, None)
        merged.append(run)
        notes.append(Problem(str(run.path), f"merged {len(parts)} of {k} shards: " +
                             ", ".join(f"{part.shard[0]}/{k} {part.path}" for part in parts)))
    return merged, notes


def load_runs(paths: Iterable[Path | str]) -> tuple[list[Run], list[Problem]]:
    """All usable runs under `paths`, and every problem met. Raises ReportError when none is usable."""
    folders, problems = find_run_folders(paths)
    runs: list[Run] = []
    for folder in folders:
        run, notes = load_run(folder)
        problems += notes
        if run is not None:
            runs.append(run)
    runs, notes = merge_shards(runs)
    problems += notes
    seen: dict[tuple[Any, ...], Run] = {}
    unique: list[Run] = []
    for run in runs:
        key = (run.setup, run.row, run.config.seed)
        if key in seen:
            same = seen[key].config.digest() == run.config.digest()
            problems.append(Problem(str(run.path), f"{'a copy of' if same else 'same bench, method, N, budget and seed as'} "
                                    f"{seen[key].path}{'' if same else ' with other settings'}; left out"))
            continue
        seen[key] = run
        unique.append(run)
    if not unique:
        detail = "; ".join(f"{p.path}: {p.message}" for p in problems) or "nothing given"
        raise ReportError(f"no usable run folders ({detail})")
    return unique, problems


# ---------------------------------------------------------------------------------------------
# Numbers
# ---------------------------------------------------------------------------------------------


@dataclass
class Stat:
    """A number averaged over seeds."""

    mean: float | None
    std: float | None
    seeds: int
    partial: bool = False

    @classmethod
    def of(cls, values: list[float | None], partial: bool = False) -> Stat:
        vals = [v for v in values if v is not None]
        if not vals:
            return cls(None, None, 0, partial)
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else None
        return cls(mean, std, len(vals), partial)

    def json(self) -> dict[str, Any]:
        return {"mean": self.mean, "std": self.std, "seeds": self.seeds, "in_progress": self.partial}


@dataclass
class Row:
    """The seeds of one configuration."""

    key: RowKey
    runs: list[Run]

    @property
    def partial(self) -> bool:
        return any(r.in_progress for r in self.runs)

    def stat(self, name: str) -> Stat:
        return Stat.of([getattr(r.summary, name) for r in self.runs], self.partial)


@dataclass
class Table:
    """One output table: raw values, their column kinds, and notes (n/a reasons, markers)."""

    name: str
    title: str
    columns: list[str]
    kinds: list[str]   # per column: text, int, pct, num, ratio, rel
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _method_rank(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def _budget_rank(budget: int | None) -> int:
    return -1 if budget is None else budget


def group_rows(runs: list[Run]) -> dict[tuple[str, str | None], list[Row]]:
    """Runs grouped by setup (scorer, PRM), then by configuration (seeds together)."""
    by_setup: dict[tuple[str, str | None], dict[RowKey, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_setup[run.setup][run.row].append(run)
    return {
        setup: sorted((Row(k, sorted(v, key=lambda r: r.config.seed)) for k, v in rows.items()),
                      key=lambda r: (r.key.bench, _method_rank(r.key.method), r.key.method, r.key.evictor,
                                     r.key.n, _budget_rank(r.key.budget), r.key.base or "", r.key.helper or ""))
        for setup, rows in sorted(by_setup.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
    }


def _find(rows: list[Row], **want: Any) -> Row | None:
    for row in rows:
        if all(getattr(row.key, k) == v for k, v in want.items()):
            return row
    return None


def _full_for(rows: list[Row], bench: str, n: int, base: str | None) -> Row | None:
    return _find(rows, bench=bench, method="full", n=n, base=base)


def _share(a: float | None, b: float | None, full: float | None) -> tuple[float | None, str | None]:
    """(a - b) / (full - b), or None and why."""
    if a is None or b is None or full is None:
        return None, "synthetic run (no accuracy)"
    if full == b:
        return None, f"full and bon accuracies are equal ({100 * full:.1f}%): no eviction loss to recover"
    return (a - b) / (full - b), None


def recovery(rows: list[Row]) -> list[dict[str, Any]]:
    """One record per kvrescue configuration: recovery or n/a with the reason."""
    out = []
    for row in rows:
        k = row.key
        if k.method != "kvrescue":
            continue
        bon = _find(rows, bench=k.bench, method="bon", evictor=k.evictor, n=k.n, budget=k.budget, base=k.base)
        full = _full_for(rows, k.bench, k.n, k.base)
        missing = [name for name, r in (("bon", bon), ("full", full)) if r is None]
        rec = {"bench": k.bench, "n": k.n, "budget": k.budget, "evictor": k.evictor, "base": k.base,
               "recovery": None, "reason": None, "in_progress": row.partial or any(r and r.partial for r in (bon, full))}
        if missing:
            rec["reason"] = f"no {' or '.join(missing)} run for {k.bench} at N={k.n}" + \
                ("" if missing == ["full"] else f", B={k.budget}")
        else:
            rec["recovery"], rec["reason"] = _share(row.stat("accuracy").mean, bon.stat("accuracy").mean,
                                                    full.stat("accuracy").mean)
        out.append(rec)
    return out


def oracle(rows: list[Row]) -> list[dict[str, Any]]:
    """Oracle-of-two per (bench, budget, base, helper): bon N=1 or helper N=1 solved it."""
    out = []
    for bon in rows:
        k = bon.key
        if k.method != "bon" or k.n != 1:
            continue
        for helper in (r for r in rows if r.key.method == "helper" and r.key.n == 1 and r.key.bench == k.bench):
            rec: dict[str, Any] = {"bench": k.bench, "budget": k.budget, "evictor": k.evictor, "base": k.base,
                                   "helper": helper.key.helper, "seeds": 0, "bon": None, "helper_acc": None,
                                   "oracle": None, "full": None, "recovered": None, "reason": None,
                                   "in_progress": bon.partial or helper.partial}
            pairs = [(b, h) for b in bon.runs for h in helper.runs if b.config.seed == h.config.seed]
            if not pairs:
                rec["reason"] = "no bon and helper runs with the same seed"
                out.append(rec)
                continue
            accs = []
            for b, h in pairs:
                bc = {t.idx: t.correct for t in b.traces}
                hc = {t.idx: t.correct for t in h.traces}
                common = bc.keys() & hc.keys()
                if common:
                    accs.append((sum(bc[i] for i in common) / len(common), sum(hc[i] for i in common) / len(common),
                                 sum(bc[i] or hc[i] for i in common) / len(common)))
            if not accs:
                rec["reason"] = "the paired bon and helper runs share no problems"
                out.append(rec)
                continue
            rec["seeds"] = len(accs)
            rec["bon"], rec["helper_acc"], rec["oracle"] = (sum(a[i] for a in accs) / len(accs) for i in range(3))
            full = _full_for(rows, k.bench, 1, k.base)
            if full is None:
                rec["reason"] = f"no full run for {k.bench} at N=1"
            elif bon.runs[0].config.synthetic:
                rec["reason"] = "synthetic run (no accuracy)"
            else:
                rec["full"] = full.stat("accuracy").mean
                rec["recovered"], rec["reason"] = _share(rec["oracle"], rec["bon"], rec["full"])
            out.append(rec)
    return out


def _quantiles(values: list[float]) -> list[float | None]:
    """Linear-interpolation quantiles (numpy's default)."""
    if not values:
        return [None] * len(QUANTILES)
    s = sorted(values)
    out = []
    for q in QUANTILES:
        pos = q * (len(s) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(s) - 1)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out


def _thresholds(run: Run) -> tuple[float, float]:
    det = run.config.settings.get("detector") or {}
    return float(det.get("tau_ent", DEFAULT_TAU_ENT)), float(det.get("tau_cmp", DEFAULT_TAU_CMP))


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def _setup_title(setup: tuple[str, str | None]) -> str:
    scorer, prm = setup
    return f"scorer {scorer}" + (f" ({prm})" if prm and prm != scorer else "")


def _row_label(row: Row, rows: list[Row]) -> list[str]:
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


def build_tables(runs: list[Run], problems: list[Problem]) -> list[Table]:
    """Every table of the report, in display order."""
    tables = [runs_table(runs, problems)]
    for setup, rows in group_rows(runs).items():
        title = _setup_title(setup)
        tables += [accuracy_table(rows, title), recovery_table(rows, title), cost_table(rows, title),
                   ablation_table(rows, title), helper_share_table(rows, title), oracle_table(rows, title),
                   calibration_table(rows, title)]
    return [t for t in tables if t.rows]


def runs_table(runs: list[Run], problems: list[Problem]) -> Table:
    t = Table("runs", "Run folders", ["folder", "bench", "method", "evictor", "N", "budget", "seed", "problems",
                                      "accuracy", "status"],
              ["text", "text", "text", "text", "int", "int", "int", "text", "pct", "text"])
    for r in sorted(runs, key=lambda r: str(r.path)):
        s = r.summary
        t.rows.append([_shown(r.path), r.config.bench_name(), s.method, s.evictor, s.n, s.budget, s.seed,
                       f"{s.problems}/{s.total if s.total is not None else '?'}", s.accuracy,
                       f"* {r.in_progress}" if r.in_progress else ("synthetic" if s.synthetic else "done")])
    t.notes = [f"{p.path}: {p.message}" for p in problems if not p.message.startswith("in progress:")]
    return t


def _shown(path: Path) -> str:
    """A path as the user would type it: relative to the working folder when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def accuracy_table(rows: list[Row], setup: str) -> Table:
    """Rows method x budget, columns benches (Table 5)."""
    benches = sorted({r.key.bench for r in rows})
    t = Table("accuracy", f"Accuracy, mean ± std over seeds — {setup}", ["method", "N", "budget", *benches],
              ["text", "int", "int", *["pct"] * len(benches)])
    keys = sorted({(r.key.method, r.key.evictor, r.key.n, r.key.budget, r.key.base, r.key.helper) for r in rows},
                  key=lambda k: (_method_rank(k[0]), k[0], k[1], k[2], _budget_rank(k[3]), k[4] or "", k[5] or ""))
    for method, evictor, n, budget, base, helper in keys:
        cells = [_find(rows, bench=b, method=method, evictor=evictor, n=n, budget=budget, base=base, helper=helper)
                 for b in benches]
        first = next(c for c in cells if c)
        t.rows.append([*_row_label(first, rows), n, budget, *(c.stat("accuracy") if c else None for c in cells)])
    if any(r.partial for r in rows):
        t.notes.append("* includes runs still in progress")
    if any(r.runs[0].config.synthetic for r in rows):
        t.notes.append("synthetic runs (random checkpoints) report no accuracy")
    return t


def recovery_table(rows: list[Row], setup: str) -> Table:
    """Recovery per (bench, N, budget) and its average per budget."""
    recs = recovery(rows)
    benches = sorted({r["bench"] for r in recs})
    t = Table("recovery", f"Recovery (A_kvrescue - A_bon) / (A_full - A_bon) — {setup}",
              ["evictor", "N", "budget", *benches, "mean"], ["text", "int", "int", *["pct"] * len(benches), "pct"])
    settings = sorted({(r["evictor"], r["n"], r["budget"], r["base"]) for r in recs},
                      key=lambda s: (s[0], s[1], _budget_rank(s[2]), s[3] or ""))
    for evictor, n, budget, base in settings:
        cells = {r["bench"]: r for r in recs if (r["evictor"], r["n"], r["budget"], r["base"]) == (evictor, n, budget, base)}
        vals = [cells[b]["recovery"] if b in cells else None for b in benches]
        known = [v for v in vals if v is not None]
        t.rows.append([evictor, n, budget, *vals, sum(known) / len(known) if known else None])
        for b in benches:
            if b in cells and cells[b]["reason"]:
                t.notes.append(f"n/a {b}, N={n}, B={budget}: {cells[b]['reason']}")
    for budget in sorted({r["budget"] for r in recs}, key=_budget_rank):
        known = [r["recovery"] for r in recs if r["budget"] == budget and r["recovery"] is not None]
        t.notes.append(f"average recovery at B={budget}: "
                       + (f"{100 * sum(known) / len(known):.1f}% over {len(known)} setting{'s' * (len(known) > 1)}" if known
                          else "n/a (no setting has kvrescue, bon and full)"))
    if any(r["in_progress"] for r in recs):
        t.notes.append("* includes runs still in progress")
    return t


def _pair_rows(rows: list[Row], methods: tuple[str, ...]) -> list[Row]:
    return [r for r in rows if r.key.method in methods]


def cost_table(rows: list[Row], setup: str) -> Table:
    """Decode cost (Table 1): bon vs kvrescue per budget, and the relative change in base tokens."""
    t = Table("cost", f"Decode cost per problem — {setup}",
              ["bench", "method", "N", "budget", "steps", "output tokens", "base tokens", "helper tokens",
               "Δ base tokens vs bon"],
              ["text", "text", "int", "int", "num", "num", "num", "num", "rel"])
    for row in _pair_rows(rows, ("bon", "kvrescue")):
        k = row.key
        change = None
        if k.method == "kvrescue":
            bon = _find(rows, bench=k.bench, method="bon", evictor=k.evictor, n=k.n, budget=k.budget, base=k.base)
            b, kv = (bon.stat("base_tokens").mean if bon else None), row.stat("base_tokens").mean
            change = (kv - b) / b if b and kv is not None else None
        t.rows.append([k.bench, *_row_label(row, rows), k.n, k.budget, row.stat("mean_steps"),
                       row.stat("mean_output_tokens"), row.stat("base_tokens"), row.stat("helper_tokens"), change])
    return t


def ablation_table(rows: list[Row], setup: str) -> Table:
    """Ablation (Table 2): bon, interleave, kvrescue."""
    t = Table("ablation", f"Ablation — {setup}",
              ["bench", "method", "N", "budget", "accuracy", "degeneration", "base tokens", "steps", "early exit"],
              ["text", "text", "int", "int", "pct", "pct", "num", "num", "pct"])
    for row in _pair_rows(rows, ("bon", "interleave", "kvrescue")):
        k = row.key
        t.rows.append([k.bench, *_row_label(row, rows), k.n, k.budget, row.stat("accuracy"),
                       row.stat("degeneration_rate"), row.stat("base_tokens"), row.stat("mean_steps"),
                       row.stat("early_exit_rate")])
    t.notes.append("degeneration: share of incorrect trajectories with >= 256 committed steps; "
                   "early exit: share of base candidates stopped by the detector")
    return t


def helper_share_table(rows: list[Row], setup: str) -> Table:
    """Helper share of committed steps by budget (rows) and N (columns) (Figure 6)."""
    picked = _pair_rows(rows, ("interleave", "kvrescue"))
    ns = sorted({r.key.n for r in picked})
    t = Table("helper_share", f"Helper share of committed steps — {setup}",
              ["bench", "method", "budget", *[f"N={n}" for n in ns]], ["text", "text", "int", *["pct"] * len(ns)])
    for bench, method, evictor, budget, base, helper in sorted(
            {(r.key.bench, r.key.method, r.key.evictor, r.key.budget, r.key.base, r.key.helper) for r in picked},
            key=lambda k: (k[0], _method_rank(k[1]), k[2], _budget_rank(k[3]), k[4] or "", k[5] or "")):
        cells = [_find(picked, bench=bench, method=method, evictor=evictor, budget=budget, n=n, base=base,
                       helper=helper) for n in ns]
        first = next(c for c in cells if c)
        t.rows.append([bench, *_row_label(first, rows), budget,
                       *(c.stat("helper_step_share") if c else None for c in cells)])
    return t


def oracle_table(rows: list[Row], setup: str) -> Table:
    recs = oracle(rows)
    t = Table("oracle", f"Oracle of two (bon N=1 or helper N=1 solved it) — {setup}",
              ["bench", "budget", "seeds", "bon", "helper", "oracle", "full", "loss recovered"],
              ["text", "int", "int", "pct", "pct", "pct", "pct", "pct"])
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
              ["text", "text", "int", "int", "text", "text", "int", *["ratio"] * len(QUANTILES), "ratio", "pct"])
    for row in rows:
        run = row.runs[0]
        tau_ent, tau_cmp = _thresholds(run)
        cands = [c for r in row.runs for t_ in r.traces for cs in t_.candidates for c in cs if c.source == "base"]
        for stat, tau, beyond in (("max_mean_entropy", tau_ent, lambda v: v > tau_ent),
                                  ("min_gzip_ratio", tau_cmp, lambda v: v < tau_cmp)):
            for committed in (True, False):
                vals = [getattr(c, stat) for c in cands if c.committed == committed and getattr(c, stat) is not None]
                if not vals:
                    continue
                t.rows.append([row.key.bench, *_row_label(row, rows), row.key.n, row.key.budget, stat,
                               "yes" if committed else "no",
                               len(vals), *_quantiles(vals), tau, sum(map(beyond, vals)) / len(vals)])
    t.notes.append("beyond: share past the threshold (entropy > tau_ent, gzip ratio < tau_cmp)")
    return t


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------


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


def to_json(tables: list[Table], runs: list[Run], problems: list[Problem]) -> bytes:
    """The whole report as JSON: tables with raw values (fractions, not percent), recovery, oracle."""
    by_setup = group_rows(runs)
    data = {
        "tables": [{"name": t.name, "title": t.title, "columns": t.columns,
                    "rows": [[_plain(v) for v in row] for row in t.rows], "notes": t.notes} for t in tables],
        "recovery": [rec for rows in by_setup.values() for rec in recovery(rows)],
        "oracle": [rec for rows in by_setup.values() for rec in oracle(rows)],
        "problems": [{"path": p.path, "message": p.message} for p in problems],
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


def plot(runs: list[Run], out: Path) -> Path:
    """Accuracy vs budget per bench (Figure 5): a line per method, dashed full, dotted helper."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
            label = _row_label(row, [r for _, r in mine])[0] + (f" N={row.key.n}" if len(ns) > 1 else "") + \
                (f" [{_setup_title(setup)}]" if several else "")
            curves[(label, row.key.method, row.key.n)].append((row.key.budget, row.stat("accuracy")))
        for (label, method, n), points in sorted(curves.items(), key=lambda kv: (_method_rank(kv[0][1]), kv[0])):
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
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
