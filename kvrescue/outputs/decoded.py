"""The traces.jsonl record of a decoded problem, built from what the controller hands back (`search.Finished`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvrescue.outputs.records import Candidate, Tokens, Trace

if TYPE_CHECKING:
    from grader import GradeResult
    from kvrescue.data import Problem
    from kvrescue.search import Finished


def trace_of(finished: Finished, problem: Problem, gt_norm: str, pred: str, correct: bool, timed_out: bool,
             graders: dict[str, dict] | None = None, answer_from: str = "output",
             votes: dict[int, GradeResult] | None = None) -> Trace:
    """The traces.jsonl record of one decoded problem (`graders`: the other graders' verdicts; `answer_from`: where
    the answer was read, `prompts.answer_part`; `votes`: the verdicts of the last step's voters by index,
    `grading.voters`)."""
    state = finished.state
    candidates = []
    for cands in state.history:
        candidates.append([
            Candidate(
                source=c.source, score=c.score, tokens=len(c.tokens), finish=c.finish,
                max_mean_entropy=c.result.max_mean_entropy, min_gzip_ratio=c.result.min_gzip_ratio,
                fired_at=c.result.fired_at, committed=c.committed, text=None if c.committed else c.text,
            )
            for c in cands
        ])
    for i, verdict in (votes or {}).items():
        candidates[-1][i].pred, candidates[-1][i].correct = verdict.pred, verdict.correct
    tokens = Tokens(base=state.generated["base"], base_prefill=state.prefilled["base"],
                    helper=state.generated["helper"], helper_prefill=state.prefilled["helper"],
                    prm=finished.scorer_tokens)
    now = time.time()
    return Trace(
        idx=state.idx, problem=problem.problem, gt=problem.gt, gt_norm=gt_norm,
        steps=state.steps, candidates=candidates, output=finished.output,
        pred=pred, correct=correct, timed_out=timed_out, stop=state.stop, skip_reason=None, tokens=tokens,
        n_steps=len(state.steps),
        timings={"wall_s": finished.wall_s, "started_at": state.started, "finished_at": now},
        peak_base_rows=finished.peak_base_rows, prm_truncations=finished.scorer_truncations,
        prm_unseen=finished.scorer_unseen,
        graders=graders or {}, answer_from=answer_from,
    )

