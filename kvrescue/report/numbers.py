"""The report's numbers: runs grouped into rows (seeds together), mean ± std, recovery, oracle-of-two, quantiles."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvrescue.detect import DetectorConfig
from kvrescue.outputs import Trace, boxed
from kvrescue.report.load import Run, RowKey

METHOD_ORDER = ("full", "helper", "bon", "interleave", "kvrescue")
QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
PAPER_ACCURACY = "boxed_accuracy"  # Table 5's "is_correct ∧ \boxed": the accuracy recovery and the oracle use


def paper_correct(trace: Trace) -> bool:
    """A problem as Table 5 counts it: graded correct and its output holds a `\\boxed` (`outputs.boxed`)."""
    return bool(trace.correct) and boxed(trace)


@dataclass
class Stat:
    """A number averaged over seeds, with the population standard deviation (n, not n - 1, in the denominator: the
    paper's ± in Table 5)."""

    mean: float | None
    std: float | None
    seeds: int
    partial: bool = False

    @classmethod
    def of(cls, values: list[float | None], partial: bool) -> Stat:
        vals = [v for v in values if v is not None]
        if not vals:
            return cls(None, None, 0, partial)
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals)) if len(vals) > 1 else None
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
    """One output table: raw values, their column kinds, and notes (n/a reasons, markers). Its first `keys` columns
    name a row (the long CSV's row keys); the others are its values."""

    name: str
    title: str
    columns: list[str]
    kinds: list[str]   # per column: text, int, pct (a fraction), num, ratio, rel (a relative change)
    keys: int = 0
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def method_rank(method: str) -> int:
    return METHOD_ORDER.index(method) if method in METHOD_ORDER else len(METHOD_ORDER)


def budget_rank(budget: int | None) -> int:
    return -1 if budget is None else budget


def group_rows(runs: list[Run]) -> dict[tuple[str, str | None], list[Row]]:
    """Runs grouped by setup (scorer, PRM), then by configuration (seeds together)."""
    by_setup: dict[tuple[str, str | None], dict[RowKey, list[Run]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        by_setup[run.setup][run.row].append(run)
    return {
        setup: sorted((Row(k, sorted(v, key=lambda r: r.config.seed)) for k, v in rows.items()),
                      key=lambda r: (r.key.bench, method_rank(r.key.method), r.key.method, r.key.evictor,
                                     r.key.n, budget_rank(r.key.budget), r.key.base or "", r.key.helper or ""))
        for setup, rows in sorted(by_setup.items(), key=lambda kv: (kv[0][0], kv[0][1] or ""))
    }


def find_row(rows: list[Row], **want: Any) -> Row | None:
    for row in rows:
        if all(getattr(row.key, k) == v for k, v in want.items()):
            return row
    return None


def _full_for(rows: list[Row], bench: str, n: int, base: str | None) -> Row | None:
    return find_row(rows, bench=bench, method="full", n=n, base=base)


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
        bon = find_row(rows, bench=k.bench, method="bon", evictor=k.evictor, n=k.n, budget=k.budget, base=k.base)
        full = _full_for(rows, k.bench, k.n, k.base)
        missing = [name for name, r in (("bon", bon), ("full", full)) if r is None]
        rec = {"bench": k.bench, "n": k.n, "budget": k.budget, "evictor": k.evictor, "base": k.base,
               "recovery": None, "reason": None, "in_progress": row.partial or any(r and r.partial for r in (bon, full))}
        if missing:
            rec["reason"] = f"no {' or '.join(missing)} run for {k.bench} at N={k.n}" + \
                ("" if missing == ["full"] else f", B={k.budget}")
        else:
            rec["recovery"], rec["reason"] = _share(*(r.stat(PAPER_ACCURACY).mean for r in (row, bon, full)))
        out.append(rec)
    return out


def recovery_means(recs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's average recovery (its "87% at B = 64"): per evictor and budget, the mean over the settings
    (benches, base models, N) that have one, for all base models together (`base` None) and for each."""
    out = []
    groups: dict[tuple[str, int | None], list[dict[str, Any]]] = defaultdict(list)
    for rec in recs:
        groups[(rec["evictor"], rec["budget"])].append(rec)
    for (evictor, budget), group in sorted(groups.items(), key=lambda kv: (kv[0][0], budget_rank(kv[0][1]))):
        bases = sorted({r["base"] or "" for r in group})
        for base in [None, *bases] if len(bases) > 1 else [None]:
            mine = [r for r in group if base is None or (r["base"] or "") == base]
            known = [r for r in mine if r["recovery"] is not None]
            out.append({"evictor": evictor, "budget": budget, "base": base, "settings": len(known), "of": len(mine),
                        "benches": len({r["bench"] for r in known}), "ns": sorted({r["n"] for r in known}),
                        "bases": len({r["base"] for r in known}),
                        "mean": sum(r["recovery"] for r in known) / len(known) if known else None,
                        "in_progress": any(r["in_progress"] for r in mine)})
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
                bc = {t.idx: paper_correct(t) for t in b.traces}
                hc = {t.idx: paper_correct(t) for t in h.traces}
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
                rec["full"] = full.stat(PAPER_ACCURACY).mean
                rec["recovered"], rec["reason"] = _share(rec["oracle"], rec["bon"], rec["full"])
            out.append(rec)
    return out


def agreement(pairs: list[tuple[bool, bool]]) -> tuple[int, int, int, int]:
    """Of (verdict a, verdict b) pairs: how many both correct, only a, only b, neither."""
    return (sum(a and b for a, b in pairs), sum(a and not b for a, b in pairs), sum(b and not a for a, b in pairs),
            sum(not a and not b for a, b in pairs))


def quantiles(values: list[float]) -> list[float | None]:
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


def thresholds(run: Run) -> tuple[float, float]:
    det = run.config.settings.get("detector") or {}
    return float(det.get("tau_ent", DetectorConfig.tau_ent)), float(det.get("tau_cmp", DetectorConfig.tau_cmp))
