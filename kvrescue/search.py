"""The stepwise controller: every method of DESIGN section 2 over many problems at once.

The scheduler keeps up to `batch` problems in flight. Each iteration advances every open candidate
step of every problem by one token (one batched forward per model, inside the runners); a problem
whose candidates are all done is scored, commits its best candidate, and opens its next step, while
the others keep decoding. Finished problems retire and new ones enter. Policy lives here, without
tensors; the `Runner`s own the models, caches and logits (nano-vllm's scheduler / model runner split).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

from kvrescue.engine.scoring import UNSEEN_SCORE, PendingScores, Scorer
from kvrescue.engine.steps import CandidateStep, StepRules
from kvrescue.errors import env_seconds
from kvrescue.methods import METHODS
from kvrescue.outputs import Step
from kvrescue.reasons import CONTEXT, DETECTOR_FINISHES, EOS, NONFINITE, STEPS
from kvrescue.search_settings import SearchSettings

# Seconds between running-total reports (progress bars); $KVRESCUE_PROGRESS_EVERY_S overrides (0: every iteration).
PROGRESS_EVERY_S = env_seconds("KVRESCUE_PROGRESS_EVERY_S", 2.0)


class StepRunner(Protocol):
    """What the controller needs from a model's `Runner` (tests drive the controller with a scripted one)."""

    def prefill(self, token_lists: Sequence[Sequence[int]]) -> list[int]: ...
    def fork_each(self, rows: Sequence[int], n: int) -> list[int]: ...  # n children of each row, row after row
    def adopt(self, row: int, child: int) -> None: ...
    def release(self, rows: Sequence[int]) -> None: ...
    def commit(self, rows: Sequence[int], steps: Sequence[Sequence[int]]) -> None: ...
    def start(self, rows: Sequence[int], keys: Sequence[Sequence[int]], contexts: Sequence[int],
              screened: Sequence[bool], rules: StepRules) -> None: ...
    def prepare(self) -> None: ...  # launch the next `advance`'s device work without waiting for it (or nothing)
    def advance(self, wait: bool = False) -> list[CandidateStep]: ...
    def rows_held(self, row: int) -> int: ...
    def peak_length(self, row: int) -> int: ...

    @property
    def open_steps(self) -> int: ...  # steps `advance` decodes here, a token each (0 where they decode in another process)

    decoded: int  # candidate tokens decoded so far (progress)


@dataclass
class CandidateState:
    """One candidate of a problem's open step: its source, stream index, cache row, result and score."""

    source: str
    index: int
    row: int
    screened: bool
    result: CandidateStep | None = None
    score: float | None = None
    committed: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.result.tokens

    @property
    def text(self) -> str:
        return self.result.text

    @property
    def finish(self) -> str | None:
        return self.result.finish if self.result else None

    @property
    def dropped(self) -> bool:
        """The detector fired on it: it is not scored."""
        return self.finish in DETECTOR_FINISHES


@dataclass
class ProblemState:
    """A problem in flight: committed rows of each model, committed steps, and the open step."""

    idx: int
    prompt: list[int]
    rows: dict[str, int]
    started: float
    committed: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    candidates: list[CandidateState] = field(default_factory=list)
    history: list[list[CandidateState]] = field(default_factory=list)
    unseen: int = 0  # candidates the scorer saw no token of (scored UNSEEN_SCORE)
    generated: dict[str, int] = field(default_factory=lambda: {"base": 0, "helper": 0})
    prefilled: dict[str, int] = field(default_factory=lambda: {"base": 0, "helper": 0})
    stop: str | None = None

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.committed)


@dataclass(frozen=True)
class DecodeProgress:
    """Running totals the controller reports every few seconds while problems are in flight."""

    committed_steps: int
    generated_tokens: int


@dataclass
class Finished:
    """What the controller hands back for one problem; the caller grades and records it."""

    state: ProblemState
    output: str
    wall_s: float
    peak_base_rows: int
    scorer_tokens: int
    scorer_truncations: int
    scorer_unseen: int = 0


class Controller:
    """Runs one method with `n` candidates per model and step (streams of `seed`) over a stream of problems with the
    given models' runners and scorer."""

    def __init__(self, settings: SearchSettings, runners: dict[str, StepRunner], scorer: Scorer, eos: set[int], *,
                 method: str, n: int, seed: int = 0) -> None:
        self.settings, self.spec, self.n, self.seed = settings, METHODS[method], n, seed
        self.runners = runners
        self.scorer = scorer
        synthetic = settings.synthetic_steps
        self.rules = StepRules(frozenset(eos), settings.sampling, settings.max_step_tokens, settings.context_cap,
                               fixed_length=synthetic[0] if synthetic else None,
                               detector=settings.detector if self.spec.detector else None)
        self.open: dict[tuple[str, int], CandidateState] = {}  # (source, row) of every decoding candidate
        self.totals = DecodeProgress(0, 0)

    def run(self, problems: Iterable[tuple[int, str, list[int]]], on_finished: Callable[[Finished], None],
            on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode every (idx, problem text, prompt tokens); call `on_finished` as each completes, and
        `on_progress` with running totals every PROGRESS_EVERY_S seconds.

        Problems are pulled lazily, only when a slot frees up, so `problems` may be a shared work queue.
        """
        source = iter(problems)
        active: list[ProblemState] = []
        exhausted = False
        reported = time.monotonic()
        scoring: tuple[list[ProblemState], PendingScores] | None = None  # the problems whose scores are on their way
        while not exhausted or active:
            admitted = []
            while not exhausted and len(active) + len(admitted) < self.settings.batch:
                item = next(source, None)
                exhausted = item is None
                if item is not None:
                    admitted.append(item)
            if admitted:
                active += self._admit(admitted)
            if not active:
                continue
            self._open_steps([p for p in active if not p.candidates])
            self._decode_one_token()
            if scoring is not None:  # launched an iteration ago: its forward ran beside this iteration's decode
                ready, pending = scoring
                scoring = None
                self._end_steps(ready, pending.wait(), active, on_finished)
            ready = [p for p in active if p.candidates and all(c.finish for c in p.candidates)]
            if ready:
                scoring = self._score(ready)
                if scoring is None:
                    self._end_steps(ready, self.scorer.score(self._requests(ready)), active, on_finished)
            if on_progress is not None and time.monotonic() - reported >= PROGRESS_EVERY_S:
                on_progress(self.totals)
                reported = time.monotonic()

    # -- admission ----------------------------------------------------------------------------------
    def _admit(self, admitted: list[tuple[int, str, list[int]]]) -> list[ProblemState]:
        started = time.time()
        states = [ProblemState(idx=idx, prompt=prompt, rows={}, started=started) for idx, _, prompt in admitted]
        for name, runner in self.runners.items():
            for state, row in zip(states, runner.prefill([s.prompt for s in states])):
                state.rows[name] = row
                state.prefilled[name] += len(state.prompt)
        for (idx, text, prompt), state in zip(admitted, states):
            self.scorer.open(idx, text, prompt)
        return states

    # -- one step -----------------------------------------------------------------------------------
    def _open_steps(self, problems: list[ProblemState]) -> None:
        spec, n = self.spec, self.n
        for source in (["base"] if spec.base else []) + (["helper"] if spec.helper else []):
            if not problems:
                break
            runner, first = self.runners[source], 0 if source == "base" or not spec.base else n
            screened = spec.detector and source == "base"
            rows, keys, contexts = [], [], []
            children = runner.fork_each([problem.rows[source] for problem in problems], n)
            for k, problem in enumerate(problems):
                for index, row in enumerate(children[k * n:(k + 1) * n], start=first):
                    cand = CandidateState(source, index, row, screened)
                    problem.candidates.append(cand)
                    self.open[source, row] = cand
                    rows.append(row)
                    keys.append((self.seed, problem.idx, len(problem.steps), index))
                    contexts.append(problem.context)
            runner.start(rows, keys, contexts, [screened] * len(rows), self.rules)

    def _decode_one_token(self) -> None:
        # A runner whose steps decode in another process (vLLM) is waited on only when none decodes here.
        wait = not any(runner.open_steps for runner in self.runners.values())
        # Every runner's sampling is queued before any runner waits for its tokens (on CUDA each on its model's own
        # stream, `engine/streams.py`): the helper's does not wait behind the base's forward, nor the base's next one
        # behind the helper's, and the host reads each after one wait for its own stream.
        for runner in self.runners.values():
            runner.prepare()
        for source, runner in self.runners.items():
            for result in runner.advance(wait):
                cand = self.open.pop((source, result.row))
                cand.result = result
        generated = sum(runner.decoded for runner in self.runners.values())
        self.totals = DecodeProgress(self.totals.committed_steps, generated)

    # -- scoring and commit -------------------------------------------------------------------------
    @staticmethod
    def _requests(ready: list[ProblemState]) -> list[tuple[int, str, list[int]]]:
        return [(p.idx, c.text, c.tokens) for p in ready for c in p.candidates if not c.dropped]

    def _score(self, ready: list[ProblemState]) -> tuple[list[ProblemState], PendingScores] | None:
        """Launch the scoring of the ready problems' candidates where the scorer launches its work on a device
        (`launch`): their scores are read an iteration later, so that the other problems' next tokens are launched
        before the host waits for them, and the device runs both. None: the scorer scores when asked."""
        launch = getattr(self.scorer, "launch", None)
        return None if launch is None else (ready, launch(self._requests(ready)))

    def _end_steps(self, ready: list[ProblemState], scores: list[float | None], active: list[ProblemState],
                   on_finished: Callable[[Finished], None]) -> None:
        """Commit each ready problem's best candidate by `scores` (its candidates not dropped, in order); retire
        the problems that stop."""
        self._commit(ready, scores)
        for problem in [p for p in ready if p.stop]:
            active.remove(problem)
            on_finished(self._retire(problem))

    def _commit(self, ready: list[ProblemState], scores: list[float | None]) -> None:
        scored = iter(scores)  # the candidates not dropped, in order
        for problem in ready:
            for cand in problem.candidates:
                if not cand.dropped:
                    score = next(scored)
                    cand.score = UNSEEN_SCORE if score is None else score
                    problem.unseen += score is None
        commits: dict[str, list[tuple[ProblemState, list[int]]]] = {name: [] for name in self.runners}
        losers: dict[str, list[int]] = {name: [] for name in self.runners}  # released once per runner
        for problem in ready:
            for cand in problem.candidates:
                problem.generated[cand.source] += len(cand.tokens)
            scored = [c for c in problem.candidates if c.score is not None]
            winner = max(scored, key=lambda c: c.score)  # max keeps the first on ties: base before helper
            winner.committed = True
            problem.steps.append(Step(winner.text, winner.source, winner.score, len(winner.tokens)))
            problem.committed += winner.tokens
            self.scorer.commit(problem.idx, winner.text, winner.tokens)
            if winner.finish in (EOS, NONFINITE):
                problem.stop = winner.finish
            elif problem.context >= self.settings.context_cap:
                problem.stop = CONTEXT
            elif len(problem.steps) >= self.settings.step_cap:
                problem.stop = STEPS
            for name, runner in self.runners.items():
                mine = [c for c in problem.candidates if c.source == name]
                if winner in mine:
                    runner.adopt(problem.rows[name], winner.row)
                    mine.remove(winner)
                elif not problem.stop:  # a stopped problem's last step is never appended
                    problem.prefilled[name] += len(winner.tokens)
                losers[name] += [c.row for c in mine]
                commits[name].append((problem, winner.tokens))
            problem.history.append(problem.candidates)
            problem.candidates = []
        for name, runner in self.runners.items():
            runner.release(losers[name])
            live = [(p, step) for p, step in commits[name] if not p.stop]
            if live:
                runner.commit([p.rows[name] for p, _ in live], [step for _, step in live])
        if "base" in self.runners:
            for problem in ready:
                problem.steps[-1].base_rows = self.runners["base"].rows_held(problem.rows["base"])
        self.totals = DecodeProgress(self.totals.committed_steps + len(ready), self.totals.generated_tokens)

    def _retire(self, problem: ProblemState) -> Finished:
        peak = self.runners["base"].peak_length(problem.rows["base"]) if "base" in self.runners else 0
        for name, runner in self.runners.items():
            runner.release([problem.rows[name]])
        tokens, truncations = self.scorer.close(problem.idx)
        output = "".join(step.text for step in problem.steps)
        return Finished(problem, output, time.time() - problem.started, peak, tokens, truncations, problem.unseen)
