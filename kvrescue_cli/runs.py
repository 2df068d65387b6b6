"""`kvrescue run`: a grid of configurations over problem sets, models loaded once, one run folder per cell."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Iterator

from rich.progress import Progress

from grader import grade
from kvrescue_cli import workers
from kvrescue_cli.cost import Architecture, ModelConfigError, load_config
from kvrescue_cli.data import GENERIC, Problem, ProblemSet, data_dir, load_problems
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.loader import LoadedModel, ModelLoadError, load_model
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.engine.scoring import HelperLoglik, Scorer
from kvrescue_cli.errors import InputError
from kvrescue_cli.outputs import Candidate, ModelRef, RunConfig, RunFolder, Summary, Tokens, Trace, run_dir
from kvrescue_cli.prompts import generation_prompt
from kvrescue_cli.search import METHODS, Controller, Finished, SearchSettings

EVICTORS = ("rkv", "snapkv", "streaming", "none")
MIN_BUDGET = 16
CPU_PARAMS = 3e9  # larger models are refused on a CPU: hours per problem, and tens of GB in fp32
SCORERS = ("prm", "helper-loglik")


@dataclass(frozen=True)
class Cell:
    """One configuration of the grid."""

    problems: ProblemSet
    method: str
    budget: int | None
    n: int
    seed: int


@dataclass(frozen=True)
class GridOptions:
    """Everything `kvrescue run` was asked for, validated."""

    benches: list[str]
    methods: list[str]
    budgets: list[int]
    ns: list[int]
    seeds: list[int]
    evictor: str
    models: dict[str, str]
    scorer: str
    settings: SearchSettings
    out: Path
    limit: int | None = None
    data_dir: Path | None = None
    problem_field: str | None = None
    answer_field: str | None = None
    overwrite: bool = False
    devices: tuple[str, ...] = ("cpu",)  # one device decodes in this process; more, one worker process each
    dtype: str = "float32"
    shard: tuple[int, int] | None = None  # (i, k): every k-th problem from the i-th
    cuda_graphs: bool = True  # the evicted base's decode step as CUDA graphs (on a GPU)

    def check(self) -> None:
        """One-line errors for options that can't run."""
        for method in self.methods:
            if method not in METHODS:
                raise InputError(f"unknown method '{method}': use one of {', '.join(METHODS)}")
        if self.evictor not in EVICTORS:
            raise InputError(f"unknown evictor '{self.evictor}': use one of {', '.join(EVICTORS)}")
        if self.scorer not in SCORERS:
            raise InputError(f"unknown scorer '{self.scorer}': use a PRM, or one of {', '.join(SCORERS[1:])}")
        for budget in self.budgets:
            if budget < MIN_BUDGET:
                raise InputError(f"--budget {budget} is below the smallest supported budget {MIN_BUDGET}")
        for n in self.ns:
            if n < 1:
                raise InputError(f"--n {n}: need at least one candidate per model")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise InputError(f"--shard {self.shard[0]}/{self.shard[1]}: need 0 <= i < k")

    def cells(self, problem_sets: list[ProblemSet]) -> list[Cell]:
        """The grid; methods without an evicted cache run once whatever the budget list."""
        cells, seen = [], set()
        for problems, method, budget, n, seed in itertools.product(
            problem_sets, self.methods, self.budgets, self.ns, self.seeds
        ):
            cell = Cell(problems, method, budget if METHODS[method].evicted else None, n, seed)
            key = (problems.name, method, cell.budget, n, seed)
            if key not in seen:
                seen.add(key)
                cells.append(cell)
        return cells


def roles_needed(methods: list[str], scorer: str) -> set[str]:
    """Which models the grid needs: base, helper, prm."""
    roles = set()
    for method in methods:
        spec = METHODS[method]
        roles |= {"base"} if spec.base else set()
        roles |= {"helper"} if spec.helper else set()
    roles.add("prm" if scorer == "prm" else "helper")
    return roles


def cell_config(options: GridOptions, cell: Cell) -> RunConfig:
    """The run folder identity of one cell."""
    spec = METHODS[cell.method]
    roles = roles_needed([cell.method], options.scorer)
    s = options.settings
    return RunConfig(
        bench=cell.problems.name if cell.problems.grading_bench != GENERIC else cell.problems.source,
        method=cell.method,
        budget=cell.budget,
        n=cell.n,
        evictor=options.evictor if spec.evicted else "none",
        seed=cell.seed,
        models={role: ModelRef(options.models[role]) for role in sorted(roles)},
        scorer=options.scorer,
        synthetic=s.synthetic_steps is not None,
        settings={
            "temperature": s.sampling.temperature, "top_p": s.sampling.top_p, "top_k": s.sampling.top_k,
            "detector": vars(s.detector) if spec.detector else None,
            "max_step_tokens": s.max_step_tokens, "max_steps": s.max_steps, "context_cap": s.context_cap,
            "synthetic_steps": list(s.synthetic_steps) if s.synthetic_steps else None,
            "dtype": options.dtype, "problem_field": options.problem_field, "answer_field": options.answer_field,
        },
    )


def trace_of(finished: Finished, problem, gt_norm: str, pred: str, correct: bool, timed_out: bool) -> Trace:
    """The traces.jsonl record of one decoded problem."""
    state = finished.state
    candidates = []
    for cands in state.history:
        candidates.append([
            Candidate(
                source=c.source, score=c.score, tokens=len(c.tokens), finish=c.finish,
                max_mean_entropy=c.detector.max_mean_entropy if c.detector else None,
                min_gzip_ratio=c.detector.min_ratio if c.detector else None,
                fired_at=c.detector.fired_at if c.detector else None,
                committed=c.committed,
            )
            for c in cands
        ])
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
    )



def refuse_large_on_cpu(role: str, name: str) -> None:
    """A one-line error, before any weights are read, for a model too large to decode on a CPU."""
    try:
        params = Architecture.from_config(name, load_config(name)).params
    except (ModelConfigError, KeyError, TypeError, ValueError):  # no usable config: the loader says why
        return
    if params > CPU_PARAMS:
        raise InputError(f"{role} model {name} has {params / 1e9:.1f}B parameters, too many for a CPU run; "
                         "use --device cuda, --preset cpu-demo, or smaller local models with --base/--helper/--prm")


def load_roles(options: GridOptions, device: str) -> dict[str, LoadedModel]:
    """Every model the grid needs, loaded once on `device`; base and helper must share a tokenizer."""
    loaded: dict[str, LoadedModel] = {}
    by_name: dict[str, LoadedModel] = {}
    for role in sorted(roles_needed(options.methods, options.scorer)):
        name = options.models[role]
        if device == "cpu":
            refuse_large_on_cpu(role, name)
        try:
            if name not in by_name:
                by_name[name] = load_model(name, options.dtype, device)
        except ModelLoadError as err:
            raise InputError(f"{role} model: {err}; on a CPU without the Hub try --preset cpu-demo, "
                             "or give local folders with --base/--helper/--prm") from None
        loaded[role] = by_name[name]
    if "prm" in loaded and not loaded["prm"].is_prm:
        raise InputError(f"--prm {options.models['prm']} has no PRM head (score.0/score.2 weights); "
                         "give a process reward model, or --prm helper-loglik for the named alternative scorer")
    policy = [loaded[r] for r in ("base", "helper") if r in loaded]
    if len(policy) == 2 and policy[0].tokenizer.get_vocab() != policy[1].tokenizer.get_vocab():
        raise InputError("base and helper tokenizers differ; KV-Rescue commits the same tokens to both models")
    return loaded


def _runners(options: GridOptions, cell: Cell, models: dict[str, LoadedModel]) -> dict[str, Runner]:
    """Fresh caches for one cell: the base evicted or full, the helper full."""
    spec, s = METHODS[cell.method], options.settings
    per_problem = s.context_cap + 2 * cell.n * s.max_step_tokens
    runners: dict[str, Runner] = {}
    if spec.base:
        base = models["base"]
        cache = (BoundedCache.for_model(base.net, cell.budget, options.evictor, max_append=s.max_step_tokens,
                                        rows=s.batch * (cell.n + 1))
                 if spec.evicted else FullCache.for_model(base.net, s.batch * per_problem, max_rows=s.batch * (2 * cell.n + 2)))
        runners["base"] = Runner(base, cache, cuda_graphs=options.cuda_graphs)
    if spec.helper:
        helper = models["helper"]
        cache = FullCache.for_model(helper.net, s.batch * per_problem, max_rows=s.batch * (2 * cell.n + 2))
        runners["helper"] = Runner(helper, cache)
    return runners


def _scorer(options: GridOptions, cell: Cell, models: dict[str, LoadedModel]) -> Scorer:
    s = options.settings
    if options.scorer == "prm":
        return PRMScorer(models["prm"], max_problems=s.batch, max_candidates=s.batch * 2 * cell.n,
                         max_step_tokens=s.max_step_tokens)
    helper = models["helper"]
    tokens = s.batch * (2 * s.context_cap + 2 * cell.n * s.max_step_tokens)
    cache = FullCache.for_model(helper.net, tokens, max_rows=s.batch * (2 * cell.n + 2))
    return HelperLoglik(Runner(helper, cache))


def decode(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: Iterable[Problem],
           emit: Callable[[Trace, int], None]) -> None:
    """Decode `problems` of one cell, pulled lazily (so they may come from a shared queue), and `emit`
    each one's trace with the tokens it generated: skipped ones when pulled, decoded ones as they finish."""
    policy = models["base" if METHODS[cell.method].base else "helper"]
    cap = options.settings.context_cap
    by_idx: dict[int, Problem] = {}

    def work() -> Iterator[tuple[int, str, list[int]]]:
        for problem in problems:
            prompt = policy.tokenizer.encode(generation_prompt(policy.tokenizer, problem.problem),
                                             add_special_tokens=False)
            if len(prompt) >= cap:
                gt_norm = grade("", problem.gt, cell.problems.grading_bench).gt
                emit(Trace.skipped(problem.idx, problem.problem, problem.gt, gt_norm,
                                   f"prompt has {len(prompt)} tokens, context cap is {cap}"), 0)
            else:
                by_idx[problem.idx] = problem
                yield problem.idx, problem.problem, prompt

    def record(finished: Finished) -> None:
        problem = by_idx.pop(finished.state.idx)
        verdict = grade(finished.output, problem.gt, cell.problems.grading_bench)
        emit(trace_of(finished, problem, verdict.gt, verdict.pred, verdict.correct, verdict.timed_out),
             sum(finished.state.generated.values()))

    settings = replace(options.settings, method=cell.method, n=cell.n, seed=cell.seed)
    controller = Controller(settings, _runners(options, cell, models), _scorer(options, cell, models),
                            set(policy.eos_ids))
    controller.run(work(), record)


def run_cell(options: GridOptions, cell: Cell, models: dict[str, LoadedModel] | workers.WorkerPool,
             progress: Progress) -> Summary:
    """Decode the cell's missing problems into its run folder and return its summary: in this process
    with loaded `models`, or on the worker processes of a `WorkerPool`."""
    config = cell_config(options, cell)
    problems = cell.problems.problems
    with RunFolder.open(run_dir(options.out, config), config, total=len(problems), devices=list(options.devices),
                        overwrite=options.overwrite, shard=options.shard) as folder:
        pending = [p for p in problems if p.idx not in folder.done]
        task = progress.add_task(_cell_label(config), total=len(problems), completed=len(problems) - len(pending),
                                 accuracy="", speed="")
        started, generated = time.time(), 0

        def record(trace: Trace, tokens: int) -> None:
            nonlocal generated
            folder.append(trace)
            generated += tokens
            accuracy = sum(t.correct for t in folder.traces) / len(folder.traces)
            progress.update(task, advance=1, accuracy=f"acc {100 * accuracy:.1f}%",
                            speed=f"{generated / max(time.time() - started, 1e-9):.1f} tok/s")

        try:
            if isinstance(models, workers.WorkerPool):
                models.decode(cell, pending, record)
            elif pending:
                decode(options, cell, models, pending, record)
        finally:
            summary = folder.write_summary()
    return summary


def _cell_label(config: RunConfig) -> str:
    budget = "" if config.budget is None else f" B={config.budget}"
    return f"{config.bench_name()} {config.method}{budget} N={config.n} seed={config.seed}"


def run_grid(options: GridOptions, progress: Progress) -> list[tuple[RunConfig, Summary]]:
    """Every cell of the grid, models loaded once; cells already complete are only summarised."""
    options.check()
    folder = data_dir(options.data_dir)
    sets = [load_problems(b, folder=folder, problem_field=options.problem_field, answer_field=options.answer_field,
                          limit=options.limit) for b in options.benches]
    if options.shard is not None:
        i, k = options.shard
        sets = [replace(problems, problems=problems.problems[i::k]) for problems in sets]
    cells = options.cells(sets)
    if len(options.devices) == 1:
        models = load_roles(options, options.devices[0])
        return [(cell_config(options, cell), run_cell(options, cell, models, progress)) for cell in cells]

    def say(message: str) -> None:
        progress.console.print(message, markup=False, highlight=False)

    with workers.WorkerPool(options, say) as pool:
        pool.start()
        return [(cell_config(options, cell), run_cell(options, cell, pool, progress)) for cell in cells]
