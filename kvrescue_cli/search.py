"""The stepwise controller: every method of DESIGN section 2 over many problems at once.

The scheduler keeps up to `batch` problems in flight. Each iteration samples one token for every
live candidate of every problem (one batched forward per model); a problem whose candidates are all
done is scored, commits its best candidate, and opens its next step, while the others keep decoding.
Finished problems retire and new ones enter. Policy lives here; tensors live in `Runner` and the
caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from kvrescue_cli.detect import Detector, DetectorConfig
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.sampling import SamplingParams, sample
from kvrescue_cli.engine.steps import CandidateStep, StepLimits
from kvrescue_cli.engine.scoring import Scorer
from kvrescue_cli.methods import METHODS, Method
from kvrescue_cli.outputs import Step
from kvrescue_cli.prompts import STEP_DELIMITER


@dataclass(frozen=True)
class SearchSettings:
    """Everything the controller decides with; defaults are the paper's."""

    method: str = "kvrescue"
    n: int = 8
    seed: int = 0
    sampling: SamplingParams = SamplingParams()
    detector: DetectorConfig = DetectorConfig()
    max_step_tokens: int = 512
    max_steps: int = 1024
    context_cap: int = 4096
    batch: int = 8
    synthetic_steps: tuple[int, int] | None = None  # (LEN, COUNT): steps end after LEN tokens, problems after COUNT steps

    @property
    def step_cap(self) -> int:
        return self.max_steps if self.synthetic_steps is None else self.synthetic_steps[1]

    @property
    def spec(self) -> Method:
        return METHODS[self.method]


@dataclass
class CandidateState:
    """One candidate of a problem's open step: its source, stream index, cache row, logits and score."""

    source: str
    index: int
    row: int
    logits: torch.Tensor
    detector: Detector | None
    step: CandidateStep
    score: float | None = None
    committed: bool = False

    @property
    def tokens(self) -> list[int]:
        return self.step.tokens

    @property
    def text(self) -> str:
        return self.step.text

    @property
    def finish(self) -> str | None:
        return self.step.finish


@dataclass
class ProblemState:
    """A problem in flight: committed rows of each model, committed steps, and the open step."""

    idx: int
    prompt: list[int]
    rows: dict[str, int]
    logits: dict[str, torch.Tensor]
    started: float
    committed: list[int] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    candidates: list[CandidateState] = field(default_factory=list)
    history: list[list[CandidateState]] = field(default_factory=list)
    generated: dict[str, int] = field(default_factory=lambda: {"base": 0, "helper": 0})
    prefilled: dict[str, int] = field(default_factory=lambda: {"base": 0, "helper": 0})
    stop: str | None = None

    @property
    def context(self) -> int:
        return len(self.prompt) + len(self.committed)


@dataclass
class Finished:
    """What the controller hands back for one problem; the caller grades and records it."""

    state: ProblemState
    output: str
    wall_s: float
    peak_base_rows: int
    scorer_tokens: int
    scorer_truncations: int


class Controller:
    """Runs one method over a stream of problems with the given models and scorer."""

    def __init__(self, settings: SearchSettings, runners: dict[str, Runner], scorer: Scorer, eos: set[int]) -> None:
        self.settings = settings
        self.runners = runners
        self.scorer = scorer
        self.tokenizer = next(iter(runners.values())).tokenizer
        self.vocab = len(self.tokenizer)
        synthetic = settings.synthetic_steps
        self.limits = StepLimits(frozenset(eos), settings.max_step_tokens, settings.context_cap, STEP_DELIMITER,
                                 fixed_length=synthetic[0] if synthetic else None)

    def run(self, problems: Iterable[tuple[int, str, list[int]]], on_finished: Callable[[Finished], None]) -> None:
        """Decode every (idx, problem text, prompt tokens); call `on_finished` as each completes.

        Problems are pulled lazily, only when a slot frees up, so `problems` may be a shared work queue.
        """
        source = iter(problems)
        active: list[ProblemState] = []
        exhausted = False
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
            for problem in active:
                if not problem.candidates:
                    self._open_step(problem)
            self._decode_one_token(active)
            ready = [p for p in active if all(c.finish for c in p.candidates)]
            if ready:
                self._score(ready)
                self._commit(ready)
                for problem in [p for p in ready if p.stop]:
                    active.remove(problem)
                    on_finished(self._retire(problem))

    # -- admission ----------------------------------------------------------------------------------
    def _admit(self, admitted: list[tuple[int, str, list[int]]]) -> list[ProblemState]:
        started = time.time()
        states = []
        for idx, _, prompt in admitted:
            states.append(ProblemState(idx=idx, prompt=prompt, rows={}, logits={}, started=started))
        for name, runner in self.runners.items():
            rows = [runner.cache.create() for _ in states]
            logits = runner.append(rows, [s.prompt for s in states])
            for state, row, row_logits in zip(states, rows, logits):
                state.rows[name] = row
                state.logits[name] = row_logits
                state.prefilled[name] += len(state.prompt)
        for (idx, text, prompt), state in zip(admitted, states):
            self.scorer.open(idx, text, prompt)
        return states

    # -- one step -----------------------------------------------------------------------------------
    def _open_step(self, problem: ProblemState) -> None:
        spec, n = self.settings.spec, self.settings.n
        sources = (["base"] if spec.base else []) + (["helper"] if spec.helper else [])
        index = 0
        for source in sources:
            for row in self.runners[source].cache.fork(problem.rows[source], n):
                detector = Detector(self.settings.detector) if spec.detector and source == "base" else None
                step = CandidateStep(self.tokenizer, problem.context, self.limits, detector.update if detector else None)
                problem.candidates.append(CandidateState(source, index, row, problem.logits[source], detector, step))
                index += 1

    def _decode_one_token(self, active: list[ProblemState]) -> None:
        for source, runner in self.runners.items():
            live = [(p, c) for p in active for c in p.candidates if c.source == source and not c.finish]
            if not live:
                continue
            keys = [(self.settings.seed, p.idx, len(p.steps), c.index) for p, c in live]
            counters = [len(c.tokens) for _, c in live]
            # Rows past the tokenizer's vocabulary are padding (Qwen2.5 pads its embeddings): never sample them.
            logits = torch.stack([c.logits[: self.vocab] for _, c in live])
            tokens, entropies = sample(logits, keys, counters, self.settings.sampling)
            feed = []
            for (problem, cand), token, entropy in zip(live, tokens.tolist(), entropies.tolist()):
                problem.generated[source] += 1
                if cand.step.push(token, entropy) is None:
                    feed.append(cand)
            if feed:
                logits = runner.step([c.row for c in feed], [c.tokens[-1] for c in feed])
                for cand, row_logits in zip(feed, logits):
                    cand.logits = row_logits

    # -- scoring and commit -------------------------------------------------------------------------
    def _score(self, ready: list[ProblemState]) -> None:
        requests = []
        for problem in ready:
            survivors = [c for c in problem.candidates if c.detector is None or not c.detector.fired]
            for cand in survivors or problem.candidates:
                requests.append((problem, cand))
        scores = self.scorer.score([(p.idx, c.text, c.tokens) for p, c in requests])
        for (_, cand), score in zip(requests, scores):
            cand.score = score

    def _commit(self, ready: list[ProblemState]) -> None:
        appends: dict[str, list[tuple[ProblemState, list[int]]]] = {name: [] for name in self.runners}
        for problem in ready:
            scored = [c for c in problem.candidates if c.score is not None]
            winner = max(scored, key=lambda c: c.score)  # max keeps the first on ties: base before helper
            winner.committed = True
            no_survivor = all(c.detector is not None and c.detector.fired for c in problem.candidates)
            problem.steps.append(Step(winner.text, winner.source, winner.score, len(winner.tokens), no_survivor))
            problem.committed += winner.tokens
            self.scorer.commit(problem.idx, winner.text, winner.tokens)
            for name, runner in self.runners.items():
                mine = [c for c in problem.candidates if c.source == name]
                if winner in mine:
                    runner.cache.adopt(problem.rows[name], winner.row)
                    mine.remove(winner)
                    tail = winner.tokens[-1:]
                else:
                    tail = winner.tokens
                    problem.prefilled[name] += len(tail)
                runner.cache.release([c.row for c in mine])
                appends[name].append((problem, tail))
            problem.history.append(problem.candidates)
            problem.candidates = []
            if winner.finish == "eos":
                problem.stop = "eos"
            elif problem.context >= self.settings.context_cap:
                problem.stop = "context"
            elif len(problem.steps) >= self.settings.step_cap:
                problem.stop = "steps"
        for name, runner in self.runners.items():
            live = [(p, tail) for p, tail in appends[name] if not p.stop]
            if live:
                logits = runner.append([p.rows[name] for p, _ in live], [tail for _, tail in live])
                for (problem, _), row_logits in zip(live, logits):
                    problem.logits[name] = row_logits
                    if runner.cache.length(problem.rows[name]) != problem.context:
                        raise RuntimeError(f"problem {problem.idx}: the {name} cache holds "
                                           f"{runner.cache.length(problem.rows[name])} tokens, the trajectory {problem.context}")
        if "base" in self.runners:
            for problem in ready:
                problem.steps[-1].base_rows = self.runners["base"].rows_held(problem.rows["base"])

    def _retire(self, problem: ProblemState) -> Finished:
        peak = 0
        for name, runner in self.runners.items():
            if name == "base":
                peak = runner.peak_rows(problem.rows[name])
            runner.cache.release([problem.rows[name]])
        tokens, truncations = self.scorer.close(problem.idx)
        output = "".join(step.text for step in problem.steps)
        return Finished(problem, output, time.time() - problem.started, peak, tokens, truncations)
