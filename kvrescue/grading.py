"""Grading JSONL records of model outputs: the logic behind `kvrescue grade`."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from grader import GRADERS, GradeResult, grade, grade_many
from grader.verify import INSTALL, available
from kvrescue.data import BENCHES, GENERIC, Problem, raw_gt
from kvrescue.errors import InputError
from kvrescue.jsonl import require_field
from kvrescue.outputs import Trace
from kvrescue.outputs.decoded import trace_of
from kvrescue.prompts import answer_part
from kvrescue.reasons import EOS, UNDECODED

if TYPE_CHECKING:
    from kvrescue.search import CandidateState, Finished

GRADING_BENCHES = (*BENCHES, GENERIC)
GradeFn = Callable[..., GradeResult]  # grader.grade's signature: (answer, gt, bench, grader=...)


@dataclass
class GradeTally:
    """What the summary table shows."""

    records: int = 0
    correct: int = 0
    timeouts: int = 0
    empty: int = 0

    @property
    def accuracy(self) -> float:
        return self.correct / self.records if self.records else 0.0


def voters(finished: Finished) -> list[tuple[int, CandidateState, str]]:
    """The last step's candidates that end a solution, as (index, candidate, solution text): the committed one and
    every other that ended with EOS, each solution the committed steps before the last plus its own text. Their
    answers and PRM scores make the report's PRM-weighted vote."""
    state = finished.state
    if not state.history or not state.steps:
        return []
    before = "".join(step.text for step in state.steps[:-1])
    return [(i, c, before + c.text) for i, c in enumerate(state.history[-1]) if c.committed or c.finish == EOS]


def check_bench(bench: str) -> None:
    """Refuse a grading treatment the grader does not define."""
    if bench not in GRADING_BENCHES:
        raise InputError(f"unknown bench '{bench}': use one of {', '.join(GRADING_BENCHES)}")


def check_grader(grader: str, option: str = "--grader") -> None:
    """Refuse an unknown grader, and Math-Verify where it is not installed."""
    if grader not in GRADERS:
        raise InputError(f"unknown {option} '{grader}': use one of {', '.join(GRADERS)}")
    if grader == "math-verify" and not available():
        raise InputError(f"{option} math-verify: Math-Verify is not installed; {INSTALL}")


@dataclass
class Regraded:
    """One run folder graded again: its traces' verdicts by the grader it ran with and by another."""

    folder: str
    recorded: str  # the grader the run recorded
    grader: str
    pairs: list[tuple[bool, bool]]  # (recorded correct, regraded correct) per trace


def regrade_runs(paths: list[Path], grader: str, workers: int = 1,
                 timeout: float = 3.0) -> tuple[list[dict], list[Regraded], list[str]]:
    """Grade the traces of the run folders under `paths` again with `grader`, without decoding: one record per
    trace (folder, bench, method, seed, idx, the new verdict and the recorded one), a tally per folder, and the
    notes on folders that could not be read."""
    from kvrescue import report

    check_grader(grader)
    runs, notes = report.load_runs(paths)
    records, tallies = [], []
    for run in runs:
        config = run.config
        bench = config.bench if config.bench in BENCHES else GENERIC
        traces = [t for t in run.traces if t.stop not in UNDECODED]
        results = grade_many([(answer_part(t.output)[0], t.gt, bench) for t in traces], workers=workers,
                             timeout=timeout, grader=grader)
        recorded = config.settings.get("grader", "qwen")
        for t, r in zip(traces, results):
            records.append({"folder": str(run.path), "bench": config.bench, "method": config.method,
                            "seed": config.seed, "idx": t.idx, "grader": grader, "pred": r.pred, "gt_norm": r.gt,
                            "correct": r.correct, "timed_out": r.timed_out,
                            "recorded": {"grader": recorded, "pred": t.pred, "correct": t.correct}})
        tallies.append(Regraded(str(run.path), recorded, grader,
                                [(t.correct, r.correct) for t, r in zip(traces, results)]))
    return records, tallies, [f"{n.path}: {n.message}" for n in notes]


def grade_records(
    rows: list[tuple[int, dict]],
    *,
    source: str,
    bench: str,
    output_field: str = "output",
    gt_field: str = "gt",
    workers: int = 1,
    timeout: float = 3.0,
    grader: str = "qwen",
) -> tuple[list[dict], GradeTally]:
    """Each record plus pred, gt_norm, correct and timed_out; every record is checked before any is graded.

    The raw answer comes from `gt_field` when the record has it, otherwise from the benchmark's own
    fields (gsm8k `answer`, math500 `solution`, ...) as DESIGN section 6 defines.
    """
    check_bench(bench)
    check_grader(grader)
    items = []
    for line, record in rows:
        output = require_field(record, output_field, source, line)
        if not isinstance(output, str):
            raise InputError(f"field '{output_field}' is not a string", path=source, line=line)
        items.append((output, raw_gt(record, bench, gt_field, source, line), bench))
    answers = [answer_part(output) for output, _, _ in items]
    results = grade_many([(text, gt, b) for (text, _), (_, gt, b) in zip(answers, items)], workers=workers,
                         timeout=timeout, grader=grader)
    tally = GradeTally()
    graded = []
    for (_, record), result, (_, where) in zip(rows, results, answers):
        graded.append({**record, "pred": result.pred, "gt_norm": result.gt, "correct": result.correct,
                       "timed_out": result.timed_out, "answer_from": where})
        tally.records += 1
        tally.correct += result.correct
        tally.timeouts += result.timed_out
        tally.empty += not result.pred
    return graded, tally


_GRADING_THREAD: list[ThreadPoolExecutor] = []


def _grading_thread() -> ThreadPoolExecutor:
    """The process's one grading thread, kept for its whole life: the grader's sympy workers, which it starts,
    are killed when the thread that started them ends (PR_SET_PDEATHSIG follows the parent thread)."""
    if not _GRADING_THREAD:
        _GRADING_THREAD.append(ThreadPoolExecutor(1, thread_name_prefix="kvrescue-grading"))
    return _GRADING_THREAD[0]


class Grading:
    """Grades decoded problems on the grading thread, so that the decode loop never waits for the grader
    (its sympy workers may take seconds); the traces are emitted on the decode thread, as they are graded,
    in the order the problems finished. `grade`: grader.grade, or a caller's (a benchmark's instant verdicts)."""

    def __init__(self, bench: str, emit: Callable[[Trace, int], None], grader: str = "qwen",
                 also: tuple[str, ...] = (), grade: GradeFn = grade) -> None:
        self.bench, self.emit, self.grader, self.also, self.grade = bench, emit, grader, also, grade
        self.pending: deque[Future] = deque()

    def submit(self, finished: Finished, problem: Problem) -> None:
        """Grade a decoded problem off this thread."""
        self.pending.append(_grading_thread().submit(self._trace, finished, problem))

    def _trace(self, finished: Finished, problem: Problem) -> tuple[Trace, int]:
        answer, where = answer_part(finished.output)
        verdict = self.grade(answer, problem.gt, self.bench, grader=self.grader)
        others = {name: self.grade(answer, problem.gt, self.bench, grader=name) for name in self.also}
        graders = {name: {"pred": v.pred, "correct": v.correct, "timed_out": v.timed_out} for name, v in others.items()}
        votes = {i: verdict if c.committed else self.grade(answer_part(solution)[0], problem.gt, self.bench,
                                                            grader=self.grader)
                 for i, c, solution in voters(finished)}
        return (trace_of(finished, problem, verdict.gt, verdict.pred, verdict.correct, verdict.timed_out, graders,
                         where, votes), sum(finished.state.generated.values()))

    def emit_graded(self, wait: bool = False) -> None:
        """Emit the traces graded so far (`wait`: all of them, once graded)."""
        while self.pending and (wait or self.pending[0].done()):
            self.emit(*self.pending.popleft().result())

    def close(self) -> None:
        """Emit what is graded and drop the rest (after an interruption: those problems are decoded again on
        resume)."""
        try:
            self.emit_graded()
        finally:
            for future in self.pending:
                future.cancel()
            self.pending.clear()
