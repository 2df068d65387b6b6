"""summary.json: per-run aggregates computed from the traces alone (the report uses them too)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvrescue_cli.outputs.records import RunConfig, Trace
from kvrescue_cli.reasons import DETECTOR_FINISHES, FAILED, SKIPPED, STOPS, UNDECODED

DEGENERATE_STEPS = 256


@dataclass
class Summary:
    """Per-run aggregates; means are over decoded (non-skipped) problems unless stated."""

    bench: str
    method: str
    budget: int | None
    n: int
    evictor: str
    seed: int
    scorer: str
    synthetic: bool
    problems: int            # recorded problems, skipped included
    total: int | None        # problems the latest invocation selected (null if unknown)
    complete: bool           # problems >= total
    correct: int
    accuracy: float | None   # correct / problems (skipped count as wrong); null for synthetic runs
    skipped: int
    failed: int              # problems given up on after killing two workers (counted as wrong)
    timeouts: int            # grader timeouts (counted as incorrect)
    mean_steps: float | None
    mean_output_tokens: float | None      # committed tokens per problem
    base_tokens: float | None             # base tokens generated per problem (all candidates)
    base_prefill_tokens: float | None
    helper_tokens: float | None
    helper_prefill_tokens: float | None
    prm_tokens: float | None
    helper_step_share: float | None       # helper-sourced committed steps / committed steps
    early_exit_rate: float | None         # base candidates stopped by the detector / base candidates
    degeneration_rate: float | None       # incorrect decoded problems with >= 256 steps / incorrect
    stops: dict[str, int]                 # count per stop reason
    wall_s: float                         # union of the problems' [started_at, finished_at] spans
    mean_problem_wall_s: float | None
    throughput_per_min: float | None      # problems / wall_s * 60
    peak_base_rows: int
    prm_truncations: int


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def run_accuracy(config: RunConfig, traces: list[Trace]) -> float | None:
    """correct / problems (skipped count as wrong); None for synthetic runs (their outputs are no answers), as the
    summary and the progress line both show it."""
    return None if config.synthetic else _ratio(sum(t.correct for t in traces), len(traces))


def busy_seconds(traces: list[Trace]) -> float:
    """Length of the union of the problems' [started_at, finished_at] spans (excludes gaps between
    interrupted sessions, and model loading)."""
    spans = sorted((t.timings["started_at"], t.timings["finished_at"]) for t in traces)
    total, end = 0.0, -math.inf
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(traces: list[Trace], config: RunConfig, total: int | None = None) -> Summary:
    """All summary numbers, from the traces alone (the report uses this too)."""
    decoded = [t for t in traces if t.stop not in UNDECODED]
    correct = sum(t.correct for t in traces)
    steps = [s for t in decoded for s in t.steps]
    base_cands = [c for t in decoded for cs in t.candidates for c in cs if c.source == "base"]
    wrong = [t for t in decoded if not t.correct]
    wall = busy_seconds(traces)
    stops = {s: sum(t.stop == s for t in traces) for s in STOPS}
    return Summary(
        bench=config.bench, method=config.method, budget=config.budget, n=config.n,
        evictor=config.evictor, seed=config.seed, scorer=config.scorer, synthetic=config.synthetic,
        problems=len(traces), total=total, complete=total is not None and len(traces) >= total,
        correct=correct,
        accuracy=run_accuracy(config, traces),
        skipped=stops[SKIPPED], failed=stops[FAILED], timeouts=sum(t.timed_out for t in traces),
        mean_steps=_mean([t.n_steps for t in decoded]),
        mean_output_tokens=_mean([sum(s.tokens for s in t.steps) for t in decoded]),
        base_tokens=_mean([t.tokens.base for t in decoded]),
        base_prefill_tokens=_mean([t.tokens.base_prefill for t in decoded]),
        helper_tokens=_mean([t.tokens.helper for t in decoded]),
        helper_prefill_tokens=_mean([t.tokens.helper_prefill for t in decoded]),
        prm_tokens=_mean([t.tokens.prm for t in decoded]),
        helper_step_share=_ratio(sum(s.source == "helper" for s in steps), len(steps)),
        early_exit_rate=_ratio(sum(c.finish in DETECTOR_FINISHES for c in base_cands), len(base_cands)),
        degeneration_rate=_ratio(sum(t.n_steps >= DEGENERATE_STEPS for t in wrong), len(wrong)),
        stops=stops,
        wall_s=wall,
        mean_problem_wall_s=_mean([t.timings["wall_s"] for t in decoded]),
        throughput_per_min=len(traces) * 60 / wall if wall > 0 else None,
        peak_base_rows=max((t.peak_base_rows for t in traces), default=0),
        prm_truncations=sum(t.prm_truncations for t in traces),
    )
