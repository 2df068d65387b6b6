"""summary.json: per-run aggregates computed from the traces alone (the report uses them too)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from grader.extract import cut_at_stop_words
from kvrescue.outputs.records import RunConfig, Trace
from kvrescue.prompts import answer_part
from kvrescue.reasons import DETECTOR_FINISHES, FAILED, SKIPPED, STOPS, UNDECODED
from kvrescue.scorers import HELPER_LOGLIK

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
    boxed_correct: int       # correct and the output holds a \boxed answer (`boxed`)
    boxed_accuracy: float | None  # boxed_correct / problems: the paper's Table 5 metric, "is_correct ∧ \boxed"
    vote_correct: int | None      # problems the PRM-weighted vote of the last step's solutions gets right (`vote`)
    vote_accuracy: float | None   # vote_correct / problems; null for synthetic runs and traces without voters
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
    degenerate: int                       # incorrect decoded problems with >= 256 committed steps
    degeneration_rate: float | None       # degenerate / problems: how Table 2's numbers count
    degeneration_rate_incorrect: float | None  # degenerate / incorrect decoded problems: Table 2's caption
    stops: dict[str, int]                 # count per stop reason
    wall_s: float                         # union of the problems' [started_at, finished_at] spans
    mean_problem_wall_s: float | None
    throughput_per_min: float | None      # problems / wall_s * 60
    steady_throughput_per_min: float | None  # after the first problem finished (`steady_throughput`)
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


def boxed(trace: Trace) -> bool:
    """Whether the text the grader read (after `</think>` when it read there, cut at end-of-text markers) holds a
    `\\boxed`: the condition of the paper's "is_correct ∧ \\boxed" (Table 5); the grader itself also takes "the
    answer is" and the last number. Derived from `output`, so folders of every version read the same."""
    return "\\boxed" in cut_at_stop_words(answer_part(trace.output)[0])


def vote(trace: Trace, scorer: str) -> bool | None:
    """The verdict of the PRM-weighted vote over the last step's solutions (the voters `grading.voters` grades):
    search-and-learn's `compute_weighted_pred`, answers grouped (here by the grader's normalised answer), each
    group's scores summed (a PRM's probabilities; the helper-loglik scorer's mean log-probabilities as exp), the
    first group of the largest sum winning. None where the trace records no voter (older traces, undecoded)."""
    voters = [c for c in trace.candidates[-1] if c.pred is not None] if trace.candidates else []
    if not voters:
        return None
    weight = math.exp if scorer == HELPER_LOGLIK else float
    sums: dict[str, float] = {}
    verdicts: dict[str, bool] = {}
    for c in voters:
        sums[c.pred] = sums.get(c.pred, 0.0) + (weight(c.score) if c.score is not None else 0.0)
        verdicts.setdefault(c.pred, bool(c.correct))
    return verdicts[max(sums, key=sums.__getitem__)]


def busy_seconds(traces: list[Trace], since: float = -math.inf) -> float:
    """Length of the union of the problems' [started_at, finished_at] spans, each cut to start at `since`
    (excludes gaps between interrupted sessions, and model loading)."""
    spans = sorted((max(t.timings["started_at"], since), t.timings["finished_at"]) for t in traces
                   if t.timings["finished_at"] > since)
    total, end = 0.0, -math.inf
    for a, b in spans:
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def steady_throughput(traces: list[Trace]) -> float | None:
    """Problems per minute once the first problem has finished (the paper's Table 3 measures the steady state):
    the problems finished after it over the busy time after it; None with fewer than two finish times."""
    first = min((t.timings["finished_at"] for t in traces), default=None)
    wall = busy_seconds(traces, first) if first is not None else 0.0
    later = sum(t.timings["finished_at"] > first for t in traces) if first is not None else 0
    return later * 60 / wall if wall > 0 else None


def summarize(traces: list[Trace], config: RunConfig, total: int | None = None) -> Summary:
    """All summary numbers, from the traces alone (the report uses this too)."""
    decoded = [t for t in traces if t.stop not in UNDECODED]
    correct = sum(t.correct for t in traces)
    steps = [s for t in decoded for s in t.steps]
    base_cands = [c for t in decoded for cs in t.candidates for c in cs if c.source == "base"]
    wrong = [t for t in decoded if not t.correct]
    degenerate = sum(t.n_steps >= DEGENERATE_STEPS for t in wrong)
    boxed_correct = sum(t.correct and boxed(t) for t in traces)
    votes = [vote(t, config.scorer) if t.stop not in UNDECODED else False for t in traces]
    vote_correct = None if config.synthetic or None in votes or not traces else sum(votes)
    wall = busy_seconds(traces)
    stops = {s: sum(t.stop == s for t in traces) for s in STOPS}
    return Summary(
        bench=config.bench, method=config.method, budget=config.budget, n=config.n,
        evictor=config.evictor, seed=config.seed, scorer=config.scorer, synthetic=config.synthetic,
        problems=len(traces), total=total, complete=total is not None and len(traces) >= total,
        correct=correct,
        accuracy=run_accuracy(config, traces),
        boxed_correct=boxed_correct,
        boxed_accuracy=None if config.synthetic else _ratio(boxed_correct, len(traces)),
        vote_correct=vote_correct,
        vote_accuracy=None if vote_correct is None else _ratio(vote_correct, len(traces)),
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
        degenerate=degenerate,
        degeneration_rate=_ratio(degenerate, len(traces)),
        degeneration_rate_incorrect=_ratio(degenerate, len(wrong)),
        stops=stops,
        wall_s=wall,
        mean_problem_wall_s=_mean([t.timings["wall_s"] for t in decoded]),
        throughput_per_min=len(traces) * 60 / wall if wall > 0 else None,
        steady_throughput_per_min=steady_throughput(traces),
        peak_base_rows=max((t.peak_base_rows for t in traces), default=0),
        prm_truncations=sum(t.prm_truncations for t in traces),
    )
