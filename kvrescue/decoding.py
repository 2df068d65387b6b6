"""Decoding one cell: its problems' prompts through the controller on the cell's runners and scorer, each trace
emitted once graded. The same code runs in the `kvrescue run` process, in every Ray worker and on every rank."""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

from grader import grade as grade_answer
from grader import normal_gt
from kvrescue.cell_plan import Cell, CellPlan
from kvrescue.cell_runners import CellRunners
from kvrescue.data import Problem
from kvrescue.engine.streams import join_all
from kvrescue.grading import GradeFn, Grading
from kvrescue.outputs import Trace
from kvrescue.prompts import generation_prompt
from kvrescue.search import Controller, DecodeProgress, Finished


def decode_cell(plan: CellPlan, cell: Cell, engine: CellRunners, problems: Iterable[Problem],
                emit: Callable[[Trace, int], None], on_progress: Callable[[DecodeProgress], None] | None = None,
                grade: GradeFn = grade_answer) -> None:
    """Decode `problems` of `cell` on `engine` (`cell_runners.build_cell` of the cell's `plan`), pulled lazily (so they
    may come from a shared queue), and `emit` each one's trace with the tokens it generated: skipped ones (a prompt as
    long as the context cap) when pulled, decoded ones once `grade` (grader.grade) has graded them; `on_progress` gets
    running totals every few seconds while problems are in flight."""
    tokenizer, cap, graders = engine.tokenizer, plan.context_cap, plan.grading
    by_idx: dict[int, Problem] = {}

    def work() -> Iterator[tuple[int, str, list[int]]]:
        for problem in problems:
            prompt = tokenizer.encode(generation_prompt(tokenizer, problem.problem, plan.prompt),
                                      add_special_tokens=False)
            if len(prompt) >= cap:
                gt_norm = normal_gt(problem.gt, cell.problems.grading_bench, graders.grader)
                emit(Trace.skipped(problem.idx, problem.problem, problem.gt, gt_norm,
                                   f"prompt has {len(prompt)} tokens, context cap is {cap}"), 0)
            else:
                by_idx[problem.idx] = problem
                yield problem.idx, problem.problem, prompt

    grading = Grading(cell.problems.grading_bench, emit, graders.grader, graders.also_grade, grade)

    def grade_finished(finished: Finished) -> None:
        grading.submit(finished, by_idx.pop(finished.state.idx))
        grading.emit_graded()

    def progress(totals: DecodeProgress) -> None:
        grading.emit_graded()
        if on_progress is not None:
            on_progress(totals)

    controller = Controller(plan.settings, engine.runners, engine.scorer, engine.eos_ids,
                            method=cell.method, n=cell.n, seed=cell.seed)
    try:
        controller.run(work(), grade_finished, progress)
        grading.emit_graded(wait=True)
    finally:
        join_all()  # before the cell's caches, made on the default stream, go back to the allocator
        grading.close()
