"""One device group's work: load the grid's models on it, and decode a cell's problems with them.

The same code runs in the `kvrescue run` process (one device) and in every worker (two or more groups).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Callable, Iterable, Iterator

import torch

from grader import grade
from kvrescue_cli.cost import Architecture, OnDevice, device_plan
from kvrescue_cli.data import Problem
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.loader import DTYPES, LoadedModel, ModelLoadError, load_model
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.scoring import HelperLoglik, Scorer
from kvrescue_cli.errors import InputError
from kvrescue_cli.grid import Cell, GridOptions, roles_needed
from kvrescue_cli.outputs import Candidate, Tokens, Trace
from kvrescue_cli.prompts import generation_prompt
from kvrescue_cli.rank_group import RankGroup, rank_device
from kvrescue_cli.methods import METHODS
from kvrescue_cli.model_config import ModelConfigError, load_config
from kvrescue_cli.search import Controller, DecodeProgress, Finished, SearchSettings
from kvrescue_cli.shapes import SLACK

CPU_PARAMS = 3e9  # larger models are refused on a CPU: hours per problem, and tens of GB in fp32


def trace_of(finished: Finished, problem, gt_norm: str, pred: str, correct: bool, timed_out: bool) -> Trace:
    """The traces.jsonl record of one decoded problem."""
    state = finished.state
    candidates = []
    for cands in state.history:
        candidates.append([
            Candidate(
                source=c.source, score=c.score, tokens=len(c.tokens), finish=c.finish,
                max_mean_entropy=c.result.max_mean_entropy, min_gzip_ratio=c.result.min_ratio,
                fired_at=c.result.fired_at, committed=c.committed, text=None if c.committed else c.text,
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


def _full_tokens(s: SearchSettings, n: int) -> int:
    """Token room of a full-context cache for `batch` problems of N candidates (base `full`, helper)."""
    return s.batch * (s.context_cap + 2 * n * s.max_step_tokens)


def _loglik_tokens(s: SearchSettings, n: int) -> int:
    """Token room of the helper-loglik scorer's cache."""
    return s.batch * (2 * s.context_cap + 2 * n * s.max_step_tokens)


def _cache_tokens(options: GridOptions, role: str) -> int:
    """K/V entries the caches of the grid's largest cell hold for `role` (what `_runners`/`_scorer` build)."""
    s, n = options.settings, max(options.ns)
    if role == "base":
        evicted = s.batch * (n + 1) * (max(options.budgets) + SLACK + s.max_step_tokens)
        return max([evicted if options.evicts(m) else _full_tokens(s, n) for m in options.methods if METHODS[m].base])
    if role == "prm":
        return PRMScorer.cache_tokens(s.batch, s.batch * 2 * n, s.max_step_tokens)
    return max(_loglik_tokens(s, n) if options.scorer == "helper-loglik" else 0, _full_tokens(s, n))


def memory_plan(options: GridOptions, tp: int = 1) -> list[OnDevice] | None:
    """Each device's share of the grid's models and of the caches of its largest cell, in the run's
    dtype; None when a model has no readable config (the loader then says why)."""
    try:
        archs = {role: Architecture.from_config(options.models[role], load_config(options.models[role]))
                 for role in sorted(roles_needed(options.methods, options.scorer))}
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return None
    size = DTYPES[options.dtype].itemsize
    return device_plan({role: (replace(a, dtype_bytes=size), _cache_tokens(options, role)) for role, a in archs.items()}, tp)


def refuse_what_does_not_fit(options: GridOptions, free_bytes: int, tp: int = 1) -> None:
    """A one-line error, before any weights are read, when the memory plan needs more than `free_bytes`."""
    plan = memory_plan(options, tp) or []
    need = sum(m.weight_bytes + m.kv_bytes for m in plan)
    if need > free_bytes:
        parts = ", ".join(f"{m.role} {m.weight_bytes / 2**30:.1f} + KV {m.kv_bytes / 2**30:.1f}" for m in plan)
        dtype = ", --dtype bfloat16" if DTYPES[options.dtype].itemsize > 2 else ""
        raise InputError(f"the models and caches need {need / 2**30:.1f} GiB per device ({parts}) but "
                         f"{free_bytes / 2**30:.1f} GiB is free; lower --batch or --n{dtype}, or use larger devices")


def load_roles(options: GridOptions, device: str) -> dict[str, LoadedModel]:
    """Every model the grid needs, loaded once on `device`; base and helper must share a tokenizer."""
    loaded: dict[str, LoadedModel] = {}
    by_name: dict[str, LoadedModel] = {}
    if device.startswith("cuda"):
        refuse_what_does_not_fit(options, torch.cuda.mem_get_info(torch.device(device))[0], options.tp)
    for role in sorted(roles_needed(options.methods, options.scorer)):
        name = options.models[role]
        if device == "cpu":
            refuse_large_on_cpu(role, name)
        try:
            if name not in by_name:
                by_name[name] = load_model(name, options.dtype, device, tp=options.tp, exact_heads=role == "base")
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
    runners: dict[str, Runner] = {}
    if spec.base:
        base = models["base"]
        cache = (BoundedCache.for_model(base.net, cell.budget, options.evictor, max_append=s.max_step_tokens,
                                        rows=s.batch * (cell.n + 1))
                 if options.evicts(cell.method) else FullCache.for_model(base.net, _full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2)))
        runners["base"] = Runner(base, cache, cuda_graphs=options.cuda_graphs)
    if spec.helper:
        helper = models["helper"]
        cache = FullCache.for_model(helper.net, _full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
        runners["helper"] = Runner(helper, cache)
    return runners


def _scorer(options: GridOptions, cell: Cell, models: dict[str, LoadedModel]) -> Scorer:
    s = options.settings
    if options.scorer == "prm":
        return PRMScorer(models["prm"], max_problems=s.batch, max_candidates=s.batch * 2 * cell.n,
                         max_step_tokens=s.max_step_tokens)
    helper = models["helper"]
    cache = FullCache.for_model(helper.net, _loglik_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
    return HelperLoglik(Runner(helper, cache))


def decode(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: Iterable[Problem],
           emit: Callable[[Trace, int], None], on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
    """Decode `problems` of one cell, pulled lazily (so they may come from a shared queue), and `emit`
    each one's trace with the tokens it generated: skipped ones when pulled, decoded ones as they finish;
    `on_progress` gets running totals every few seconds while problems are in flight."""
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

    grading = Grading(cell.problems.grading_bench, emit)

    def record(finished: Finished) -> None:
        grading.submit(finished, by_idx.pop(finished.state.idx))
        grading.emit_graded()

    def progress(totals: DecodeProgress) -> None:
        grading.emit_graded()
        if on_progress is not None:
            on_progress(totals)

    settings = replace(options.settings, method=cell.method, n=cell.n, seed=cell.seed)
    controller = Controller(settings, _runners(options, cell, models), _scorer(options, cell, models),
                            set(policy.eos_ids))
    try:
        controller.run(work(), record, progress)
        grading.emit_graded(wait=True)
    finally:
        grading.close()


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
    in the order the problems finished."""

    def __init__(self, bench: str, emit: Callable[[Trace, int], None]) -> None:
        self.bench, self.emit = bench, emit
        self.pending: deque[Future] = deque()

    def submit(self, finished: Finished, problem: Problem) -> None:
        """Grade a decoded problem off this thread."""
        self.pending.append(_grading_thread().submit(self._trace, finished, problem))

    def _trace(self, finished: Finished, problem: Problem) -> tuple[Trace, int]:
        verdict = grade(finished.output, problem.gt, self.bench)
        return (trace_of(finished, problem, verdict.gt, verdict.pred, verdict.correct, verdict.timed_out),
                sum(finished.state.generated.values()))

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


class InProcess:
    """One device group decoding in this process, its models loaded once: the executor without Ray (with
    `--tp K`, this process is rank 0 of the group's K processes)."""

    def __init__(self, options: GridOptions, group: tuple[str, ...]) -> None:
        self.options = options
        self.group = group
        self.ranks = RankGroup(options, group) if len(group) > 1 else None
        try:
            self.models = load_roles(options, rank_device(group, 0))
        except BaseException:
            self.close()
            raise

    def decode(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None],
               on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode `problems` of `cell` here, emitting every problem's trace once (and running totals to
        `on_progress` every few seconds)."""
        if problems:
            decode(self.options, cell, self.models, self.ranks.lead(cell, problems) if self.ranks else problems, emit,
                   on_progress)

    def close(self) -> None:
        """Stop the group's other ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def record(self) -> dict:
        """The executor, for config.json."""
        return {"kind": "in-process", "devices": list(self.group), **({"tp": self.options.tp} if self.ranks else {})}
