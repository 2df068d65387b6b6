"""One device group's work: load the grid's models on it, and decode a cell's problems with them.

The same code runs in the `kvrescue run` process (one device) and in every worker (two or more groups).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

import psutil
import torch

from grader import grade
from kvrescue_cli.cost import Architecture, OnDevice, device_plan
from kvrescue_cli.data import Problem
from kvrescue_cli.engine.bounded import BoundedCache
from kvrescue_cli.engine.caches import FullCache
from kvrescue_cli.engine.loader import DTYPES, LoadedModel, ModelLoadError, load_model
from kvrescue_cli.engine.prm import PRMScorer
from kvrescue_cli.engine.prm_recipe import RECIPES
from kvrescue_cli.engine.runner import Runner
from kvrescue_cli.engine.scoring import HelperLoglik, Scorer
from kvrescue_cli.errors import InputError
from kvrescue_cli.grid import Cell, GridOptions
from kvrescue_cli.outputs import Candidate, Tokens, Trace
from kvrescue_cli.prompts import generation_prompt
from kvrescue_cli.rank_group import RankGroup, rank_device
from kvrescue_cli.methods import METHODS
from kvrescue_cli.model_config import ModelConfigError, load_config
from kvrescue_cli.search import Controller, DecodeProgress, Finished, SearchSettings, StepRunner
from kvrescue_cli.vllm_engine.roles import VllmEngines, engine_specs

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
    """K/V entries the caches of the grid's largest cell hold for `role` on this engine (what `_runners`/`_scorer`
    build)."""
    s, n = options.settings, max(options.ns)
    if role == "base":
        evicted = s.batch * (n + 1) * (max(options.budgets) + options.buffer + s.max_step_tokens)
        return max([evicted if options.evicts(m) else _full_tokens(s, n) for m in options.methods
                    if METHODS[m].base and not options.on_vllm("base", m)])
    if role == "prm":
        return PRMScorer.cache_tokens(s.batch, s.batch * 2 * n, s.max_step_tokens)
    sampled = any(METHODS[m].helper for m in options.methods) and not options.vllm_roles() & {"helper"}
    return max(_loglik_tokens(s, n) if options.scorer == "helper-loglik" else 0, _full_tokens(s, n) if sampled else 0)


def memory_plan(options: GridOptions, tp: int = 1) -> list[OnDevice] | None:
    """Each device's share of the grid's models and of the caches of its largest cell, in the run's
    dtype; None when a model has no readable config (the loader then says why)."""
    try:
        archs = {role: Architecture.from_config(options.models[role], load_config(options.models[role]))
                 for role in sorted(options.native_roles())}
    except (ModelConfigError, KeyError, TypeError, ValueError):
        return None
    size = DTYPES[options.dtype].itemsize
    return device_plan({role: (replace(a, dtype_bytes=size), _cache_tokens(options, role)) for role, a in archs.items()}, tp)


def refuse_what_does_not_fit(options: GridOptions, free_bytes: int, tp: int = 1, beside_vllm: bool = False) -> None:
    """A one-line error, before any weights are read, when the memory plan needs more than `free_bytes` (with
    `beside_vllm`: what is left beside vLLM's share)."""
    plan = memory_plan(options, tp) or []
    need = sum(m.weight_bytes + m.kv_bytes for m in plan)
    if need > free_bytes:
        parts = ", ".join(f"{m.role} {m.weight_bytes / 2**30:.1f} + KV {m.kv_bytes / 2**30:.1f}" for m in plan)
        dtype = ", --dtype bfloat16" if DTYPES[options.dtype].itemsize > 2 else ""
        free = f"{free_bytes / 2**30:.1f} GiB is left beside vLLM's share" if beside_vllm else \
            f"{free_bytes / 2**30:.1f} GiB is free"
        vllm = ", --vllm-memory" if beside_vllm else ""
        raise InputError(f"the models and caches need {need / 2**30:.1f} GiB per device ({parts}) but {free}; "
                         f"lower --batch or --n{dtype}{vllm}, or use larger devices")


def device_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of a GPU, or of RAM (available, total) for the CPU."""
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))
    ram = psutil.virtual_memory()
    return ram.available, ram.total


def vllm_memory(options: GridOptions, device: str, free: int, total: int) -> list[dict]:
    """Each vLLM engine's share of the device as `start_llm` takes it (`roles.engine_specs` order), after one-line
    errors, before anything is loaded, for a plan that does not fit: vLLM gets --vllm-memory of the device (of RAM
    on a CPU), split evenly between its engines, each of which must hold its weights and one whole context's KV;
    on a GPU this engine's models and caches must fit in the rest. On a CPU an engine's KV cache is given in bytes
    (vLLM's share of RAM there counts its whole process). `free`, `total`: the device's bytes (`device_memory`)."""
    specs = engine_specs(options)
    if not specs:
        return []
    share = options.vllm_memory * total
    each, size, shares = share / len(specs), DTYPES[options.dtype].itemsize, []
    for spec in specs:
        try:
            arch = replace(Architecture.from_config(spec.model, load_config(spec.model)), dtype_bytes=size)
        except (ModelConfigError, KeyError, TypeError, ValueError) as err:
            raise InputError(f"{'/'.join(spec.roles)} model {spec.model}: no usable config.json for vLLM ({err})") from None
        need = arch.params * size + arch.kv_bytes_per_token * spec.max_model_len
        if need > each:
            raise InputError(f"--vllm-memory {options.vllm_memory}: vLLM's {share / 2**30:.2f} GiB of {device} over its "
                             f"{len(specs)} engine(s) leaves {each / 2**30:.2f} GiB for the {'/'.join(spec.roles)} "
                             f"model, whose weights and one {spec.max_model_len}-token context need "
                             f"{need / 2**30:.2f} GiB; raise --vllm-memory")
        shares.append({"memory": each / total} if device.startswith("cuda")
                      else {"kv_cache_bytes": int(each - arch.params * size)})
    if device.startswith("cuda"):
        refuse_what_does_not_fit(options, int(free - share), options.tp, beside_vllm=True)
    elif share > free:
        raise InputError(f"--vllm-memory {options.vllm_memory}: {share / 2**30:.1f} GiB of RAM for vLLM, but "
                         f"{free / 2**30:.1f} GiB is available; lower --vllm-memory")
    return shares


def check_policy_tokenizers(tokenizers: dict[str, Any]) -> None:
    """Base and helper (by role) must share a tokenizer: KV-Rescue commits the same tokens to both."""
    policy = [tokenizers[r] for r in ("base", "helper") if r in tokenizers]
    if len(policy) == 2 and policy[0].get_vocab() != policy[1].get_vocab():
        raise InputError("base and helper tokenizers differ; KV-Rescue commits the same tokens to both models")


def load_roles(options: GridOptions, device: str) -> dict[str, LoadedModel]:
    """Every model the grid runs on this engine, loaded once on `device`; base and helper must share a tokenizer."""
    loaded: dict[str, LoadedModel] = {}
    by_name: dict[str, LoadedModel] = {}
    if device.startswith("cuda"):
        refuse_what_does_not_fit(options, torch.cuda.mem_get_info(torch.device(device))[0], options.tp)
    for role in sorted(options.native_roles()):
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
    check_policy_tokenizers({role: model.tokenizer for role, model in loaded.items()})
    return loaded


def _runners(options: GridOptions, cell: Cell, models: dict[str, LoadedModel],
             vllm: VllmEngines | None = None) -> dict[str, StepRunner]:
    """Fresh caches for one cell: the base evicted or full, the helper full; a role on vLLM, a fresh `VllmRunner`."""
    spec, s = METHODS[cell.method], options.settings
    runners: dict[str, StepRunner] = {}
    for role in sorted(options.vllm_roles([cell.method]) - {"prm"}):
        runners[role] = vllm.runner(role)
    if spec.base and "base" not in runners:
        base = models["base"]
        cache = (BoundedCache.for_model(base.net, cell.budget, options.evictor, slack=options.buffer,
                                        max_append=s.max_step_tokens, rows=s.batch * (cell.n + 1))
                 if options.evicts(cell.method) else FullCache.for_model(base.net, _full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2)))
        runners["base"] = Runner(base, cache, cuda_graphs=options.cuda_graphs)
    if spec.helper and "helper" not in runners:
        helper = models["helper"]
        cache = FullCache.for_model(helper.net, _full_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
        runners["helper"] = Runner(helper, cache)
    return runners


def _scorer(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], vllm: VllmEngines | None = None) -> Scorer:
    s = options.settings
    if options.on_vllm("prm", cell.method) and options.scorer == "prm":
        return vllm.scorer()
    if options.scorer == "prm":
        return PRMScorer(models["prm"], max_problems=s.batch, max_candidates=s.batch * 2 * cell.n,
                         max_step_tokens=s.max_step_tokens, recipe=RECIPES[options.prm_format])
    helper = models["helper"]
    cache = FullCache.for_model(helper.net, _loglik_tokens(s, cell.n), max_rows=s.batch * (2 * cell.n + 2))
    return HelperLoglik(Runner(helper, cache))


def decode(options: GridOptions, cell: Cell, models: dict[str, LoadedModel], problems: Iterable[Problem],
           emit: Callable[[Trace, int], None], on_progress: Callable[[DecodeProgress], None] | None = None,
           vllm: VllmEngines | None = None) -> None:
    """Decode `problems` of one cell, pulled lazily (so they may come from a shared queue), and `emit`
    each one's trace with the tokens it generated: skipped ones when pulled, decoded ones as they finish;
    `on_progress` gets running totals every few seconds while problems are in flight. `vllm`: the engines of
    the roles on vLLM (`--engine vllm`)."""
    role = "base" if METHODS[cell.method].base else "helper"
    tokenizer, eos_ids = vllm.tokenizers[role] if options.on_vllm(role, cell.method) else \
        (models[role].tokenizer, models[role].eos_ids)
    cap = options.settings.context_cap
    by_idx: dict[int, Problem] = {}

    def work() -> Iterator[tuple[int, str, list[int]]]:
        for problem in problems:
            prompt = tokenizer.encode(generation_prompt(tokenizer, problem.problem), add_special_tokens=False)
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
    controller = Controller(settings, _runners(options, cell, models, vllm), _scorer(options, cell, models, vllm),
                            set(eos_ids))
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
        self.vllm: VllmEngines | None = None
        try:
            device = rank_device(group, 0)
            shares = vllm_memory(options, device, *device_memory(device))  # one-line errors before any loading
            self.models = load_roles(options, device)
            if options.engine == "vllm":
                self.vllm = VllmEngines(options, shares)
                check_policy_tokenizers({**{role: m.tokenizer for role, m in self.models.items()},
                                         **{role: t for role, (t, _) in self.vllm.tokenizers.items()}})
        except BaseException:
            self.close()
            raise

    def decode(self, cell: Cell, problems: list[Problem], emit: Callable[[Trace, int], None],
               on_progress: Callable[[DecodeProgress], None] | None = None) -> None:
        """Decode `problems` of `cell` here, emitting every problem's trace once (and running totals to
        `on_progress` every few seconds)."""
        if problems:
            decode(self.options, cell, self.models, self.ranks.lead(cell, problems) if self.ranks else problems, emit,
                   on_progress, self.vllm)

    def close(self) -> None:
        """Stop the group's other ranks and the vLLM engines, if any."""
        if self.ranks is not None:
            self.ranks.close()
        if self.vllm is not None:
            self.vllm.close()

    def record(self) -> dict:
        """The executor, for config.json."""
        return {"kind": "in-process", "devices": list(self.group), **({"tp": self.options.tp} if self.ranks else {}),
                **({"vllm_memory": self.options.vllm_memory} if self.vllm else {})}
