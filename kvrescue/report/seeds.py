"""Metrics over a configuration's seeds: avg@n, unbiased pass@k and maj@k.

Each seed of a row is one sample per problem. Over the problems that every seed recorded:
- avg@n: the mean ± std of the seeds' accuracies (as the accuracy table gives it);
- pass@k: Chen et al. (2021)'s unbiased estimator 1 - C(n - c, k) / C(n, k) per problem (c of its n samples
  correct), averaged over problems;
- maj@k: the majority vote over k seeds' normalised predictions (`pred`, as graded), correct when the winning
  answer was graded correct; ties go to the answer whose first vote comes from the lowest seed. It is the exact
  mean over all C(n, k) choices of k seeds, so it does not depend on which seeds were run first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

from kvrescue.report.numbers import Row, Stat

DEFAULT_KS = (1, 4, 8)
MAX_SUBSETS = 20_000  # per problem: maj@k past it is n/a (C(16, 8) = 12,870 still counts exactly)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that k of n samples, c of them correct, drawn without replacement, hold a correct one."""
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(votes: Sequence[tuple[str, bool]]) -> bool:
    """Whether the majority answer of `votes` ((pred, correct) in seed order) is correct; ties: the earliest."""
    counts: dict[str, int] = {}
    verdict: dict[str, bool] = {}
    for pred, correct in votes:
        counts[pred] = counts.get(pred, 0) + 1
        verdict.setdefault(pred, correct)
    return verdict[max(counts, key=counts.__getitem__)]  # max keeps the first of equal counts: insertion order


def maj_at_k(votes: Sequence[tuple[str, bool]], k: int) -> float:
    """maj@k of one problem: the share of the C(n, k) choices of k of its n votes whose majority is correct."""
    return sum(map(majority_correct, combinations(votes, k))) / math.comb(len(votes), k)


@dataclass
class SeedMetrics:
    """One row's metrics over its seeds (None where k exceeds the seeds, or maj@k has too many subsets)."""

    seeds: int
    problems: int
    avg: Stat
    pass_at: dict[int, float | None]
    maj_at: dict[int, float | None]


def seed_metrics(row: Row, ks: Sequence[int] = DEFAULT_KS) -> SeedMetrics:
    """avg@n, pass@k and maj@k of `row` over the problems that all of its seeds recorded."""
    runs = row.runs
    by_seed = [{t.idx: (t.pred, bool(t.correct)) for t in run.traces} for run in runs]
    common = sorted(set.intersection(*(set(s) for s in by_seed))) if by_seed else []
    n = len(runs)
    votes = [[s[i] for s in by_seed] for i in common]
    avg = Stat.of([sum(s[i][1] for i in common) / len(common) if common else None for s in by_seed], row.partial)
    pass_at: dict[int, float | None] = {}
    maj_at: dict[int, float | None] = {}
    for k in ks:
        fits = common and k <= n
        pass_at[k] = sum(pass_at_k(n, sum(c for _, c in v), k) for v in votes) / len(votes) if fits else None
        exact = fits and math.comb(n, k) <= MAX_SUBSETS
        maj_at[k] = sum(maj_at_k(v, k) for v in votes) / len(votes) if exact else None
    return SeedMetrics(n, len(common), avg, pass_at, maj_at)
